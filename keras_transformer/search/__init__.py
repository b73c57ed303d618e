"""Greedy and beam search over a cached decoder step (the decoding protocol: `search/api.py`).

- `api.py`: `generate`, `generate_in_graph`, `search_graph` and the choice of driver;
- `greedy.py`, `beam.py`: each search as pure functions of a declared state;
- `lengths.py`: the length rules and `length_penalty_factor`;
- `loop.py`: the loop that runs either search, compiled (`while_loop`) or eager;
- `compiled.py`: compiling the loop (TensorFlow, JAX, PyTorch) and the caches.

`keras_transformer.generation` re-exports the public names.
"""
