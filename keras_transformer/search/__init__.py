"""Greedy and beam search over a cached decoder step (the decoding protocol: `search/api.py`).

- `api.py`: `generate`, `generate_hypotheses` (n-best, target prefixes,
  sampling), `generate_in_graph`, `search_graph`, `hypotheses_graph` and the
  choice of driver;
- `options.py`: `SearchOptions`, the search options as one value (checked
  once, when made), which every entry point takes as `options=`;
- `greedy.py`, `beam.py`, `sample.py`: each search as pure functions of a
  declared state (sampling: greedy search with a counter-based random draw);
- `lengths.py`: the length rules and `length_penalty_factor`;
- `log_probs.py`: the token rule (log-softmax, excluded ids, forced prefixes), in `keras.ops`
  and as its NumPy twin;
- `scoring.py`: teacher-forced scoring of given targets (NumPy: the ONNX
  Runtime server scores without Keras);
- `loop.py`: the loop that runs either search, compiled (`while_loop`) or eager;
- `segments.py`: the loop in compiled segments, between which done rows
  leave and the cache grows (TensorFlow, JAX; batches of 8 rows or more);
- `compiled.py`: compiling the loop (TensorFlow, JAX, PyTorch) and the caches.

`keras_transformer.generation` re-exports the public names.
"""
