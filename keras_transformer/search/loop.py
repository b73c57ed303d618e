"""The search loop: either search's update around a decoding-protocol model.

A search (`greedy`, `beam` or `sample`, modules of pure functions) is driven here:
`start` encodes the source and builds the state and cache, `step` runs one
decoder step and one search update, and

- `run` loops with `keras.ops.while_loop` (`compiled=True`, traced inside
  `jax.jit` / `tf.function`, or exported as an ONNX `Loop`) or in Python;
- `run_hybrid` loops in Python around an eager `decode_step` and a compiled
  search update (`search_step`);
- `run_steps` loops in Python over one compiled step (PyTorch);
- `segments.run_segments` loops in Python over compiled segments of `run`'s
  loop, between which done rows leave and the cache grows.

The functions that compile and cache these live in `search/compiled.py`.
"""

import keras
from keras import ops

from keras_transformer.search import beam, greedy, sample
from keras_transformer.search.common import ModelConstants, dim, state_keys

SEARCHES = {search.NAME: search for search in (greedy, beam, sample)}
# The state of each search, in the order `search_step` documents it.
SEARCH_STATE_KEYS = {name: state_keys(search.STATE_SPEC) for name, search in SEARCHES.items()}


def start(model, encoder_token_ids, beam_size, length, index, search_name=None, options=None, cache_length=None):
    """Encodes the source; returns `(search, state, cache)`.

    The search is greedy for `beam_size == 1` and beam search otherwise,
    unless `search_name` names it ("beam" with a `beam_size` tensor: one
    exported graph serves every beam size; "sample"). `options`: a dict of
    the search's option tensors (`target_prefix`, `num_hypotheses`, the
    sampling ones; see each search's `init`), carried in its state.
    `cache_length`: the decoder cache's length, L by default (shorter for
    a driver that grows it: `search/segments.py`).
    """
    encoder_outputs = model.encode(encoder_token_ids)  # [B, S, D]
    cache = model.init_cache(encoder_outputs, encoder_token_ids, length if cache_length is None else cache_length)
    if search_name is None:
        search_name = "greedy" if beam_size == 1 else "beam"
    search = SEARCHES[search_name]
    state, cache = search.init(model, dim(encoder_token_ids, 0), beam_size, length, index, cache, options)
    return search, state, cache


def step(model, search, state, cache, max_lengths, alpha):
    """One decoder step and search update; returns the next `(state, cache)`."""
    logits, cache = model.decode_step(search.tokens(state), state["index"], cache)
    state, parents = search.update(model, state, logits, max_lengths, alpha)
    if parents is not None:
        cache = beam.reorder_cache(cache, parents, beam_invariant_keys(model))
    return state, cache


def split_cache(model, cache):
    """The cache as a compiled loop carries it: split per layer where the model can (`split_cache`).

    Optional in the decoding protocol: a model whose
    `decode_step` takes its cache split per layer (`TransformerModel`)
    reads each layer's keys and values in place inside a compiled loop,
    instead of slicing (copying) them out of stacked entries every step.
    """
    split = getattr(model, "split_cache", None)
    return cache if split is None else split(cache)


def beam_invariant_keys(model):
    """The cache entries that are the same for every beam of a row (`beam_invariant_cache_keys`).

    Optional in the decoding protocol: the cross-attention keys and values
    and the padding mask are functions of the source only, so beam search
    never reorders them (tiled once, they stay equal across a row's beams).
    """
    return tuple(getattr(model, "beam_invariant_cache_keys", ()))


def run(
    model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled, search_name=None, options=None,
    split=False,
):
    """Runs a search; returns its `hypotheses`: `(sequences [B, K, L], scores [B, K], log_probs [B, K])`.

    K is 1 for greedy search and sampling; hypotheses are best first.

    Args:
        encoder_token_ids: int32 `[B, S]`.
        max_lengths: int32 `[B]`, most generated tokens per row (end included).
        alpha: float32 scalar, the length penalty.
        beam_size: Python int K (or a scalar tensor with `search_name="beam"`).
        length: Python int L, the output buffer length (>= max(max_lengths) + 1).
        compiled: use `ops.while_loop` (inside jax.jit / tf.function) rather
            than a Python loop with a Python int index.
        search_name: "greedy", "beam" or "sample", or None to choose by `beam_size`.
        options: None or a dict of option tensors (see `start`).
        split: carry the cache split per layer (`split_cache`): Keras'
            compiled drivers (`search/compiled.py`); the exported graphs
            keep the stacked cache.
    """
    index = ops.convert_to_tensor(0, "int32") if compiled else 0
    search, state, cache = start(model, encoder_token_ids, beam_size, length, index, search_name, options)
    if split:
        cache = split_cache(model, cache)

    def cond(loop):
        return search.keep_going(loop["state"], max_lengths, alpha, length)

    def body(loop):
        state, cache = step(model, search, loop["state"], loop["cache"], max_lengths, alpha)
        return {"state": state, "cache": cache}

    loop = {"state": state, "cache": cache}
    if compiled:
        loop = ops.while_loop(cond, body, loop)
    else:
        # The index stays a Python int, so a NumPy-based decode_step (ONNX
        # Runtime) receives plain integers.
        while bool(ops.convert_to_numpy(cond(loop))):
            loop = body(loop)
    return search.hypotheses(loop["state"])


def run_eager(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None):
    """`run` in a Python loop (under `torch.no_grad()` on PyTorch)."""
    arguments = (model, encoder_token_ids, max_lengths, alpha, beam_size, length)
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            return run(*arguments, compiled=False, search_name=search_name, options=options)
    return run(*arguments, compiled=False, search_name=search_name, options=options)


def search_step(search_name, model):
    """The search's own work between two decoder steps, as one function.

    For drivers that run the decoder step elsewhere: the hybrid driver
    compiles it (`search/compiled.py`).

    Args:
        search_name: "greedy", "beam" or "sample".
        model: read for its ids and vocabulary size only.

    Returns:
        A function `(state, logits, max_lengths, alpha, length, cache) ->
        (state, cache, tokens, keep_going)`: `state` a dict with the keys
        `SEARCH_STATE_KEYS[search_name]`, `logits` `[B * K, V]` of the step,
        `cache` a dict of `[B * K, ...]` entries to reorder with the beams
        (beam search; returned as is by greedy search), `tokens` the ids to
        feed next, `keep_going` a scalar bool. The beam size is taken from
        the state's shapes, so a traced graph serves every beam size.
    """
    search = SEARCHES[search_name]
    constants = ModelConstants(model)

    def update(state, logits, max_lengths, alpha, length, cache):
        state, parents = search.update(constants, state, logits, max_lengths, alpha)
        if parents is not None:
            cache = beam.reorder_cache(cache, parents)
        return state, cache, search.tokens(state), search.keep_going(state, max_lengths, alpha, length)

    return update


def run_hybrid(
    model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled_update, search_name=None, options=None
):
    """Python loop around an eager `decode_step` and a compiled search update.

    For models whose step cannot be traced: the model runs as it is; the
    search's own work per step (log-softmax, top-k, gathers, stopping test,
    the beam reordering of the cache), dozens of small ops, is one compiled
    `search_step` call instead of dozens of eager dispatches.

    Args:
        compiled_update: `search name -> search_step(name, model)` compiled.
    """
    search, state, cache = start(model, encoder_token_ids, beam_size, length, 0, search_name, options)
    update = compiled_update(search.NAME)
    tokens, index, keep_going = search.tokens(state), 0, True
    while keep_going:
        logits, cache = model.decode_step(tokens, index, cache)
        state = dict(state, index=ops.convert_to_tensor(index, "int32"))
        # Greedy search reorders nothing: the cache stays out of the call;
        # beam search reorders the entries that differ between beams.
        reordered = {} if not search.REORDERS_CACHE else {
            name: value for name, value in cache.items() if name not in beam_invariant_keys(model)
        }
        state, reordered, tokens, keep_going = update(
            state, ops.convert_to_tensor(logits), max_lengths, alpha, length, reordered
        )
        cache = dict(cache, **reordered)
        index += 1
        keep_going = bool(ops.convert_to_numpy(keep_going))
    return search.hypotheses(state)


def run_steps(
    model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled_step, search_name=None, options=None
):
    """PyTorch: a Python loop over one compiled step.

    The encoder and the cache run eagerly once; the loop's only host sync
    per step is the stopping test.

    Args:
        compiled_step: `(search, state, cache) -> step`, where `step(values,
            state, cache, max_lengths, alpha) -> (state, cache, keep_going)`
            is `step` and the stopping test compiled, `values` the values of
            `model.variables`.
    """
    import torch

    with torch.no_grad():
        index = ops.convert_to_tensor(0, "int32")
        search, state, cache = start(model, encoder_token_ids, beam_size, length, index, search_name, options)
        # Contiguous, as the step's outputs: torch.compile guards on strides,
        # and the broadcast start state would make it compile twice.
        state, cache = ({name: x.contiguous() for name, x in entries.items()} for entries in (state, cache))
        compiled = compiled_step(search, state, cache)
        values = [variable.value for variable in model.variables]
        keep_going = search.keep_going(state, max_lengths, alpha, length)
        while bool(ops.convert_to_numpy(keep_going)):
            state, cache, keep_going = compiled(values, state, cache, max_lengths, alpha)
        return search.hypotheses(state)


def initial_search_state(model, encoder_token_ids, beam_size, length):
    """Encodes the source and starts a search, for a driver outside this package.

    Returns:
        `(search_name, state, cache)`: "greedy" or "beam"; the state (keys
        `SEARCH_STATE_KEYS[search_name]`, index 0); the cache from
        `model.init_cache`, tiled per beam for beam search.
    """
    search, state, cache = start(model, encoder_token_ids, beam_size, length, 0)
    return search.NAME, dict(state, index=ops.convert_to_tensor(0, "int32")), cache


def search_tokens(search_name, state):
    """The ids to feed at the state's index (`[B * K]`)."""
    return SEARCHES[search_name].tokens(state)


def search_result(search_name, state):
    """`(sequences [B, L], scores [B])` of a finished search's state."""
    return SEARCHES[search_name].result(state)
