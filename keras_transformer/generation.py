"""Greedy and beam search over a cached decoder step.

One search drives every model that implements the *decoding protocol*: the
Keras `TransformerModel` on TensorFlow, JAX and PyTorch, and the ONNX Runtime
wrapper in `export/runtime.py`, so both produce the same tokens.

The decoding protocol (duck typing; nothing else of the model is used):

- attributes `vocabulary_size`, `pad_id` (must be 0), `start_id`, `end_id`,
  and optionally `max_sequence_length` (generation is capped to fit it);
- `encode(encoder_token_ids [B, S] int32) -> encoder_outputs [B, S, D]`;
- `init_cache(encoder_outputs, encoder_token_ids, max_length) -> cache`: a
  dict of arrays that all have the batch on axis 0 (the search tiles and
  reorders every entry with one `ops.take(x, indices, axis=0)` and never
  looks inside); `max_length` is a Python int (a scalar int32 tensor under
  `generate_in_graph`, which traces the search for a SavedModel);
- `decode_step(token_ids [B] int32, index, cache) -> (logits [B, V], cache)`:
  feeds the token at position `index` (0 for the start id) and returns the
  logits of position `index + 1`. `index` is a Python int, except inside
  the compiled loop used for Keras models (a scalar int32 tensor there).
- optionally `run_search(encoder_token_ids, max_lengths, alpha, beam_size,
  length) -> (sequences, scores)`: a model that runs the search loop
  itself, from this module's pieces (`initial_search_state`,
  `search_step`, `search_tokens`, `search_result`), as the ONNX Runtime
  wrapper does with `search_step` exported to ONNX. `generate` then does
  the rest (checks, lengths, padding, trimming); `compile=False` ignores it.

Arguments handed to the protocol methods are backend tensors (or, for the
very first calls, NumPy arrays); a NumPy-based implementation such as ONNX
Runtime converts them with `keras.ops.convert_to_numpy` and may return NumPy
arrays.

Shape legend: B batch, K beam size, S source length, L output buffer length
(the start id plus the generated tokens), V vocabulary size.

References:
- Vaswani et al., "Attention Is All You Need", 2017, section 6.1 (beam size
  4, length penalty alpha = 0.6, maximum output length input + 50, early
  termination when possible).
- Wu et al., "Google's Neural Machine Translation System", 2016,
  arXiv:1609.08144, section 7 (the length penalty).
- tensor2tensor's `beam_search.py` and the Flax WMT example's `decode.py`
  (the vectorised search with live and finished beams).
"""

import logging
import weakref

import keras
import numpy as np
from keras import ops

from keras_transformer.decoding import LENGTH_BUCKET, check_search_args, finish_rows
from keras_transformer.model import check_token_ids

logger = logging.getLogger(__name__)

NEG_INF = float("-inf")
# The least log-probability the forced end id gets at the maximum length.
FORCED_END_LOG_PROB = -1e9


_PROTOCOL_ATTRIBUTES = ("vocabulary_size", "pad_id", "start_id", "end_id", "encode", "init_cache", "decode_step")

# XLA for the compiled search on TensorFlow; on a 2-core CPU it was faster
# than a plain tf.function graph (see benchmarks/README.md).
TF_JIT_COMPILE = True

# PyTorch: None runs the search in an eager loop. Otherwise each step of the
# search (decoder step, search update, beam reordering) is captured as one
# graph with `torch.export`, once per shape, and then run as captured
# ("export": seconds to capture) or compiled with the `torch.compile`
# backend of that name ("inductor": the fast one, about a minute per shape
# on a 2-core CPU). Opt-in for that cost; see benchmarks/README.md.
TORCH_COMPILE_BACKEND = None

# model -> {"search": the whole search compiled, or a PyTorch step per shape}
# for models exposing Keras variables.
_COMPILED = weakref.WeakKeyDictionary()
# (backend, search, vocabulary size and ids) -> the compiled search update of
# the hybrid driver; it reads nothing else of the model, so models share it.
_COMPILED_UPDATES = {}


def length_penalty_factor(length, alpha):
    """The GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha.

    A hypothesis Y is scored `log P(Y | X) / lp(Y)` (Wu et al., 2016,
    equation 14, without the coverage penalty). |Y| counts the generated
    tokens including the end id, not the start id. alpha = 0 gives plain
    log-probabilities; the paper uses alpha = 0.6.

    Args:
        length: int or int tensor, |Y|.
        alpha: float or float tensor, `length_penalty` >= 0.

    Returns:
        float32 tensor shaped like `length`.

    Example:
    >>> float(length_penalty_factor(3, 1.0))  # (5 + 3) / 6
    1.3333334
    """
    length = ops.cast(length, "float32")
    return ops.power((5.0 + length) / 6.0, ops.cast(alpha, "float32"))


def generate(
    model,
    encoder_token_ids,
    beam_size=4,
    length_penalty=0.6,
    max_extra_length=50,
    compile=True,
    return_scores=False,
):
    """Translates source ids into target ids with greedy or beam search.

    `beam_size=1` is greedy search: the most probable token at every step,
    stopping at the end id (`length_penalty` then only affects the returned
    score). `beam_size > 1` is the paper's beam search: hypotheses are scored
    by their log-probability divided by `length_penalty_factor(|Y|, alpha)`;
    the best `2 * beam_size` extensions of the live beams are kept, those
    ending with the end id join a set of finished hypotheses and the best
    `beam_size` others stay live (as tensor2tensor). A row stops as soon as
    no live beam can beat its best finished hypothesis: a live beam's
    log-probability only decreases, and for alpha >= 0 the penalty is
    largest at the row's maximum length, so `live_log_prob / lp(max_length)`
    bounds its final score. The search stops when every row has stopped.

    Output length: row b generates at most `max_length_b = n_b +
    max_extra_length` tokens (at least 1), with n_b the number of non-pad
    ids of source row b (its end id included), i.e. per row as in the paper,
    and capped at `model.max_sequence_length - 1` when the model has one.
    At the step that reaches `max_length_b` only the end id may be chosen,
    so a hypothesis that hits the maximum length still ends with the end id
    (with its log-probability counted, floored at -1e9 when the model gives it
    probability 0). The pad and start ids are never generated.

    Compilation (`compile=True`), per backend and model:
    - a model with a `run_search` method (the ONNX Runtime wrapper, which
      runs this module's search exported as ONNX graphs): that method, on
      every backend;
    - TensorFlow and JAX, a model exposing its Keras `variables` (a
      `TransformerModel`, or a wrapper forwarding them): the whole search
      (encoder, cache and a `keras.ops.while_loop` over the decoder step) is
      compiled, with `tf.function(jit_compile=True)` (XLA) or `jax.jit`,
      once per (batch size, source length bucket, output length bucket,
      beam size) and cached per model;
    - TensorFlow and JAX, any other model (e.g. one whose `decode_step`
      calls another runtime with NumPy arrays): a Python loop
      calls `decode_step` eagerly and the search's own per-step work
      (log-softmax, top-k, gathers, stopping test) as one compiled function;
    - PyTorch: a Python loop under `torch.no_grad()` (`ops.while_loop` is a
      Python loop there anyway); eager unless `TORCH_COMPILE_BACKEND` is set
      (opt-in: compiling costs about a minute per shape with "inductor" on
      a small CPU) and the model exposes its Keras `variables`: then each
      step (decoder step, search update, beam reordering, stopping test) is
      one graph, captured with `torch.export` and compiled with
      `torch.compile(backend=TORCH_COMPILE_BACKEND)` ("export": run as
      captured), once per (batch size, source length bucket, output length
      bucket, beam size) and cached per model.
    `compile=False` runs everything eagerly in a Python loop. All give the
    same tokens (compiled PyTorch code may round scores differently in the
    last bits).

    Args:
        model: an object implementing the decoding protocol (see the module
            docstring), e.g. a `TransformerModel`.
        encoder_token_ids: int `[B, S]` source ids (tokens + end id, then pad
            id 0), NumPy array or tensor.
        beam_size: int >= 1. Defaults to 4 (the paper).
        length_penalty: float alpha >= 0. Defaults to 0.6 (the paper).
        max_extra_length: int >= 0, extra output tokens allowed beyond the
            source length. Defaults to 50 (the paper).
        compile: bool. Compile the search where possible (see above);
            `False` runs eagerly. Both give the same tokens.
        return_scores: bool. Also return the score of each output row.

    Returns:
        int32 NumPy array `[B, L]`: each row is the start id, the generated
        tokens, the end id, then pad ids (0); L is the longest row. With
        `return_scores=True`, `(ids, scores)` with `scores` float32 `[B]`,
        `log P(Y | X) / lp(Y)`.

    Example:
    >>> model = TransformerModel.from_preset("tiny")
    >>> src = np.array([[5, 6, 7, 3], [8, 9, 3, 0]])
    >>> ids = generate(model, src, beam_size=4)
    >>> ids[:, 0]
    array([2, 2], dtype=int32)
    """
    _check_protocol(model)
    check_search_args(beam_size, length_penalty, max_extra_length)
    encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", model.vocabulary_size)
    if model.pad_id != 0:
        raise ValueError(f"pad_id={model.pad_id}: only 0 is supported (masks are built from ids > 0)")
    source = np.asarray(ops.convert_to_numpy(encoder_token_ids)).astype("int32")
    batch, source_length = source.shape
    if batch == 0:
        empty = np.zeros((0, 0), "int32")
        return (empty, np.zeros((0,), "float32")) if return_scores else empty

    max_lengths, length, padded_length = _search_lengths(
        source, max_extra_length, getattr(model, "max_sequence_length", None)
    )
    max_lengths = np.asarray(ops.convert_to_numpy(max_lengths)).astype("int32")  # [B]
    length = int(ops.convert_to_numpy(length))  # L
    padded_length = int(ops.convert_to_numpy(padded_length))
    source = np.pad(source, ((0, 0), (0, padded_length - source_length)))  # [B, S_bucket]

    search = _select_search(model, compile)
    sequences, scores = search(
        model,
        ops.convert_to_tensor(source, "int32"),
        ops.convert_to_tensor(max_lengths, "int32"),
        ops.convert_to_tensor(float(length_penalty), "float32"),
        int(beam_size),
        length,
    )
    sequences = finish_rows(np.asarray(ops.convert_to_numpy(sequences)), model.end_id, model.pad_id)
    if return_scores:
        return sequences, np.asarray(ops.convert_to_numpy(scores)).astype("float32")
    return sequences


def generate_in_graph(model, encoder_token_ids, beam_size=4, length_penalty=0.6, max_extra_length=50):
    """`generate` inside a TensorFlow graph: symbolic ids in, symbolic ids out.

    For exporting the search (`export/saved_model.py`): called while an
    enclosing `tf.function` is traced, with ids of unknown batch and length.
    The lengths (`max_length_b`, the buffer length L, the padded source
    length) are computed as `generate` computes them, but as tensors, and
    the search is the same compiled function that `generate` runs
    (`tf.function(jit_compile=TF_JIT_COMPILE)`, cached per model); under XLA
    the tensor L is a compile-time constant, so it is compiled once per
    (batch, source bucket, L, beam size), as `generate` is.

    Args:
        model: a `TransformerModel` (or a protocol object exposing its Keras
            `variables`).
        encoder_token_ids: int `[B, S]` symbolic tensor, tokens + end id then
            pad id 0; B >= 1.
        beam_size, length_penalty, max_extra_length: as in `generate`
            (Python numbers, fixed in the graph).

    Returns:
        `(sequences, scores)`: int32 `[B, L]`, each row the start id, the
        generated tokens, the end id, then pad ids (not trimmed to the
        longest row, as `generate` does); float32 `[B]`.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "generate_in_graph builds a TensorFlow graph; KERAS_BACKEND is "
            f"{keras.backend.backend()!r}. Run with KERAS_BACKEND=tensorflow."
        )
    _check_protocol(model)
    check_search_args(beam_size, length_penalty, max_extra_length)
    if not isinstance(getattr(model, "variables", None), (list, tuple)):
        raise TypeError(
            f"generate_in_graph needs a model exposing its Keras variables, received {type(model).__name__}"
        )
    if model.pad_id != 0:
        raise ValueError(f"pad_id={model.pad_id}: only 0 is supported (masks are built from ids > 0)")
    encoder_token_ids = ops.cast(encoder_token_ids, "int32")
    max_lengths, length, padded_length = _search_lengths(
        encoder_token_ids, max_extra_length, getattr(model, "max_sequence_length", None)
    )
    source_length = _dim(encoder_token_ids, 1)
    source = ops.pad(encoder_token_ids, [[0, 0], [0, padded_length - source_length]])  # [B, S_bucket]
    search = _compiled_search(model)
    return search(
        model, source, max_lengths, ops.convert_to_tensor(float(length_penalty), "float32"), int(beam_size), length
    )


def search_graph(model, search_name):
    """The whole search as one function of tensors, to export as one graph.

    For `export/onnx.py`, which converts it (traced with unknown batch and
    source length, without XLA) into one ONNX graph: the `keras.ops.while_loop`
    over the decoder step becomes an ONNX `Loop` with the caches as its state,
    so ONNX Runtime runs a whole search per call with this module's code. The
    lengths and the source padding are computed as `generate` computes them.

    Args:
        model: a `TransformerModel`.
        search_name: "greedy" or "beam" (for beams, `beam_size` is an
            input, so one graph serves every beam size).

    Returns:
        A function `(encoder_token_ids [B, S] int32, beam_size [] int32,
        alpha [] float32, max_extra_length [] int32) -> (sequences [B, L]
        int32, scores [B] float32)`, rows not trimmed (see
        `decoding.finish_rows`); greedy search ignores `beam_size`.
    """
    if search_name not in _SEARCHES:
        raise ValueError(f"search_name={search_name!r} must be one of {sorted(_SEARCHES)}")
    limit = getattr(model, "max_sequence_length", None)

    def search(encoder_token_ids, beam_size, alpha, max_extra_length):
        encoder_token_ids = ops.cast(encoder_token_ids, "int32")
        max_lengths, length, padded_length = _search_lengths(encoder_token_ids, max_extra_length, limit)
        source_length = _dim(encoder_token_ids, 1)
        source = ops.pad(encoder_token_ids, [[0, 0], [0, padded_length - source_length]])  # [B, S_bucket]
        if search_name == "greedy":
            beam_size = 1
        return _search(model, source, max_lengths, alpha, beam_size, length, compiled=True, search_name=search_name)

    return search


def _search_lengths(encoder_token_ids, max_extra_length, limit):
    """The lengths of a search over int `[B, S]` source ids (B >= 1).

    `keras.ops` only: `generate` calls it on concrete ids, `generate_in_graph`
    on symbolic ones, where the results are tensors.

    Returns:
        `(max_lengths, length, padded_length)`: int32 `[B]`, the most
        tokens row b may generate (`n_b + max_extra_length`, at least 1, at
        most `limit - 1`); the output buffer length L (the start id and the
        longest row, rounded up to `LENGTH_BUCKET`); and the length S_bucket
        to pad the source to (rounded up to `LENGTH_BUCKET`, not beyond
        `limit` unless the source is already longer).
    """
    source_length = _dim(encoder_token_ids, 1)
    source_lengths = ops.sum(ops.cast(ops.not_equal(encoder_token_ids, 0), "int32"), axis=1)  # n_b, [B]
    max_lengths = ops.maximum(source_lengths + max_extra_length, 1)
    if limit is not None:
        max_lengths = ops.minimum(max_lengths, int(limit) - 1)
    length = _round_up(ops.max(max_lengths) + 1, LENGTH_BUCKET)
    padded_length = _round_up(ops.maximum(source_length, 1), LENGTH_BUCKET)
    if limit is not None:
        padded_length = ops.minimum(padded_length, ops.maximum(source_length, int(limit)))
    return ops.cast(max_lengths, "int32"), length, padded_length


# ---------------------------------------------------------------------- #
# Validation
# ---------------------------------------------------------------------- #
def _check_protocol(model):
    missing = [name for name in _PROTOCOL_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not implement the decoding protocol: missing {missing}. "
            "See keras_transformer.generation for the protocol."
        )


def _dim(x, axis):
    """`x.shape[axis]`, or a scalar tensor where it is unknown (a TensorFlow graph traced for any batch)."""
    size = x.shape[axis]
    return ops.shape(x)[axis] if size is None else size


def _round_up(value, multiple):
    # For value >= 0 (lengths); not `-(-value // multiple)`: tf2onnx exports
    # an integer FloorDiv as ONNX Div, which truncates negative quotients.
    return (value + multiple - 1) // multiple * multiple


# ---------------------------------------------------------------------- #
# The search: keras.ops only, shared by every driver
#
# A search is four functions of a small state (sequences and scores; the
# decoder cache is kept beside it): `tokens(state)` -> the ids to feed,
# `update(model, state, logits, ...)` -> the next state and, for beams, the
# parent of each new beam (by which the driver reorders the cache),
# `keep_going(state, ...)` and `result(state)`. Three drivers run them here:
# - compiled: the whole search in a `keras.ops.while_loop` (jax.jit / XLA);
# - hybrid: a Python loop calling the model's `decode_step` eagerly (a model
#   that cannot be traced) and a compiled `search_step` (TensorFlow, JAX);
# - eager: a Python loop (compile=False, PyTorch), or on PyTorch a Python
#   loop over one compiled step (`TORCH_COMPILE_BACKEND`);
# and a model may drive them itself (`run_search`, `search_step`): the ONNX
# Runtime wrapper runs `search_step` exported as ONNX graphs.
# ---------------------------------------------------------------------- #
def _initial_state(model, encoder_token_ids, beam_size, length, index, search_name=None):
    """Encodes the source; returns `(search, state, cache)`.

    The search is greedy for `beam_size == 1` and beam search otherwise,
    unless `search_name` names it ("beam" with a `beam_size` tensor: one
    exported graph serves every beam size).
    """
    encoder_outputs = model.encode(encoder_token_ids)  # [B, S, D]
    cache = model.init_cache(encoder_outputs, encoder_token_ids, length)
    batch = _dim(encoder_token_ids, 0)
    if search_name is None:
        search_name = "greedy" if beam_size == 1 else "beam"
    if search_name == "greedy":
        return GREEDY, _greedy_initial_state(model, batch, length, index), cache
    return BEAM, _beam_initial_state(model, batch, beam_size, length, index), tile_cache(cache, beam_size)


def initial_search_state(model, encoder_token_ids, beam_size, length):
    """Encodes the source and starts a search, for a driver outside this module.

    Returns:
        `(search_name, state, cache)`: "greedy" or "beam"; the state (keys
        `SEARCH_STATE_KEYS[search_name]`, index 0); the cache from
        `model.init_cache`, tiled per beam for beam search.
    """
    search, state, cache = _initial_state(model, encoder_token_ids, beam_size, length, 0)
    return search.name, dict(state, index=ops.convert_to_tensor(0, "int32")), cache


def search_tokens(search_name, state):
    """The ids to feed at the state's index (`[B * K]`)."""
    return _SEARCHES[search_name].tokens(state)


def search_result(search_name, state):
    """`(sequences [B, L], scores [B])` of a finished search's state."""
    return _SEARCHES[search_name].result(state)


def _search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled, search_name=None):
    """Runs greedy or beam search; returns `(sequences [B, L], scores [B])`.

    Args:
        encoder_token_ids: int32 `[B, S]`.
        max_lengths: int32 `[B]`, most generated tokens per row (end included).
        alpha: float32 scalar, the length penalty.
        beam_size: Python int K.
        length: Python int L, the output buffer length (>= max(max_lengths) + 1).
        compiled: use `ops.while_loop` (inside jax.jit / tf.function) rather
            than a Python loop with a Python int index.
    """
    index = ops.convert_to_tensor(0, "int32") if compiled else 0
    search, state, cache = _initial_state(model, encoder_token_ids, beam_size, length, index, search_name)

    def cond(loop):
        return search.keep_going(loop["state"], max_lengths, alpha, length)

    def body(loop):
        state, cache = _step(model, search, loop["state"], loop["cache"], max_lengths, alpha)
        return {"state": state, "cache": cache}

    loop = {"state": state, "cache": cache}
    if compiled:
        loop = ops.while_loop(cond, body, loop)
    else:
        # The index stays a Python int, so a NumPy-based decode_step (ONNX
        # Runtime) receives plain integers.
        while bool(ops.convert_to_numpy(cond(loop))):
            loop = body(loop)
    return search.result(loop["state"])


def _step(model, search, state, cache, max_lengths, alpha):
    """One decoder step and search update; returns the next `(state, cache)`."""
    logits, cache = model.decode_step(search.tokens(state), state["index"], cache)
    state, parents = search.update(model, state, logits, max_lengths, alpha)
    if parents is not None:
        cache = reorder_cache(cache, parents)
    return state, cache


def _hybrid_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
    """Python loop around an eager `decode_step` and a compiled search update.

    For models whose step cannot be traced: the model runs as it is; the
    search's own work per step (log-softmax, top-k, gathers, stopping test,
    the beam reordering of the cache), dozens of small ops, is one compiled
    `search_step` call instead of dozens of eager dispatches.
    """
    search, state, cache = _initial_state(model, encoder_token_ids, beam_size, length, 0)
    update = _compiled_update(search, model)
    tokens, index, keep_going = search.tokens(state), 0, True
    while keep_going:
        logits, cache = model.decode_step(tokens, index, cache)
        state = dict(state, index=ops.convert_to_tensor(index, "int32"))
        # Greedy search reorders nothing: the cache stays out of the call.
        reordered = cache if search is BEAM else {}
        state, reordered, tokens, keep_going = update(
            state, ops.convert_to_tensor(logits), max_lengths, alpha, length, reordered
        )
        if search is BEAM:
            cache = reordered
        index += 1
        keep_going = bool(ops.convert_to_numpy(keep_going))
    return search.result(state)


def _token_log_probs(model, logits, generated_length, max_lengths):
    """Log-probabilities of the next token, with forbidden tokens at -inf.

    Args:
        logits: `[B, ..., V]`.
        generated_length: int or scalar tensor, |Y| once this token is added.
        max_lengths: int32 `[B]`.

    The log-softmax is taken over the model's full distribution first, so a
    hypothesis' score is its true log-probability; then the pad and start
    ids are excluded, and at a row's maximum length everything but the end
    id.
    """
    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    vocabulary = ops.arange(model.vocabulary_size, dtype="int32")
    allowed = ops.logical_and(
        ops.not_equal(vocabulary, model.pad_id), ops.not_equal(vocabulary, model.start_id)
    )  # [V]
    at_max = ops.equal(max_lengths, generated_length)  # [B]
    at_max = ops.reshape(at_max, (-1,) + (1,) * (len(log_probs.shape) - 1))  # [B, 1, ..., 1]
    is_end = ops.equal(vocabulary, model.end_id)  # [V]
    allowed = ops.logical_and(allowed, ops.logical_or(ops.logical_not(at_max), is_end))
    # A model that gives the end id probability 0 still gets it at the maximum length.
    forced = ops.logical_and(at_max, is_end)
    log_probs = ops.where(forced, ops.maximum(log_probs, FORCED_END_LOG_PROB), log_probs)
    return ops.where(allowed, log_probs, NEG_INF)


def _write_position(sequences, position, tokens):
    """`sequences[..., position] = tokens` for `[..., L]` ids and `[...]` tokens."""
    length = _dim(sequences, -1)
    here = ops.equal(ops.arange(length, dtype="int32"), position)  # [L]
    return ops.where(here, ops.expand_dims(tokens, -1), sequences)


def _read_position(sequences, position):
    """`sequences[..., position]` for a Python int or scalar tensor position."""
    return ops.take(sequences, position, axis=-1)


def _start_sequences(model, shape):
    """Int32 zeros of `shape` (`[..., L]`) with the start id at position 0."""
    length = shape[-1]
    row = ops.where(ops.equal(ops.arange(length, dtype="int32"), 0), model.start_id, model.pad_id)
    return ops.broadcast_to(ops.cast(row, "int32"), shape)


class _Search:
    """The functions of one search (see the comment above `_initial_state`)."""

    def __init__(self, name, tokens, update, keep_going, result):
        self.name, self.tokens, self.update, self.keep_going, self.result = name, tokens, update, keep_going, result


# Greedy search ------------------------------------------------------------ #
def _greedy_initial_state(model, batch, length, index):
    return {
        "index": index,
        "sequences": _start_sequences(model, (batch, length)),  # [B, L]
        "log_probs": ops.zeros((batch,), "float32"),  # [B], sum so far
        "scores": ops.zeros((batch,), "float32"),  # [B], set when a row ends
        "finished": ops.zeros((batch,), "bool"),  # [B]
    }


def _greedy_tokens(state):
    return _read_position(state["sequences"], state["index"])  # [B]


def _greedy_update(model, state, logits, max_lengths, alpha):
    index = state["index"]
    log_probs = _token_log_probs(model, logits, index + 1, max_lengths)  # [B, V]
    # top_k rather than argmax: the same token (the first of equal maxima),
    # and it exports to ONNX (Keras' TensorFlow argmax tests the sign bit of
    # zeros with a Bitcast, which tf2onnx cannot convert).
    best_log_probs, next_tokens = ops.top_k(log_probs, 1)
    best_log_probs, next_tokens = best_log_probs[:, 0], ops.cast(next_tokens[:, 0], "int32")  # [B]
    finished = state["finished"]
    # Rows that already ended are fed pad ids from now on (never read).
    next_tokens = ops.where(finished, model.pad_id, next_tokens)
    total = ops.where(finished, state["log_probs"], state["log_probs"] + best_log_probs)
    ended = ops.logical_and(ops.logical_not(finished), ops.equal(next_tokens, model.end_id))
    scores = ops.where(ended, total / length_penalty_factor(index + 1, alpha), state["scores"])
    state = {
        "index": index + 1,
        "sequences": _write_position(state["sequences"], index + 1, next_tokens),
        "log_probs": total,
        "scores": scores,
        "finished": ops.logical_or(finished, ended),
    }
    return state, None  # no reordering


def _greedy_keep_going(state, max_lengths, alpha, length):
    return ops.logical_and(state["index"] < length - 1, ops.logical_not(ops.all(state["finished"])))


def _greedy_result(state):
    return state["sequences"], state["scores"]


GREEDY = _Search("greedy", _greedy_tokens, _greedy_update, _greedy_keep_going, _greedy_result)


# Beam search -------------------------------------------------------------- #
def gather_beams(x, beam_indices):
    """Selects beams: `[B, K_old, ...]` and `[B, K_new]` -> `[B, K_new, ...]`.

    One `ops.take` on the flattened beams:
    `[B, K_old, ...] -> [B * K_old, ...] -> [B * K_new, ...] -> [B, K_new, ...]`.
    """
    batch, old_beams, *rest = (_dim(x, axis) for axis in range(len(x.shape)))
    flat = ops.reshape(x, (batch * old_beams, *rest))
    indices = ops.reshape(_flat_beam_indices(beam_indices, old_beams), (-1,))
    # K_new rather than -1: the beam axis stays static when the batch is not.
    return ops.reshape(ops.take(flat, indices, axis=0), (batch, _dim(beam_indices, 1), *rest))


def _flat_beam_indices(beam_indices, beam_size):
    """`[B, K_new]` beam numbers -> `[B, K_new]` rows of the `[B * K, ...]` layout."""
    batch = _dim(beam_indices, 0)
    offsets = ops.expand_dims(ops.arange(batch, dtype="int32") * beam_size, 1)  # [B, 1]
    return ops.cast(beam_indices, "int32") + offsets


def tile_cache(cache, beam_size):
    """Repeats every cache entry per beam: `[B, ...] -> [B * K, ...]`.

    Row b of the input becomes rows `b * K ... b * K + K - 1`; one
    `ops.take(x, indices, axis=0)` per entry.
    """
    batch = _dim(next(iter(cache.values())), 0)
    indices = ops.repeat(ops.arange(batch, dtype="int32"), beam_size)  # [B * K]
    return {name: ops.take(value, indices, axis=0) for name, value in cache.items()}


def reorder_cache(cache, beam_indices):
    """Gives each new beam its parent's cache: `[B * K, ...] -> [B * K, ...]`.

    Args:
        cache: dict of `[B * K, ...]` entries.
        beam_indices: int `[B, K]`, the parent beam (in `0..K-1`) of each
            new beam.
    """
    indices = ops.reshape(_flat_beam_indices(beam_indices, _dim(beam_indices, 1)), (-1,))  # [B * K]
    return {name: ops.take(value, indices, axis=0) for name, value in cache.items()}


def _beam_initial_state(model, batch, beam_size, length, index):
    # All beams start as the same start id; only beam 0 is live, so the first
    # step does not pick K copies of the same extension.
    first = ops.where(ops.equal(ops.arange(beam_size, dtype="int32"), 0), 0.0, NEG_INF)
    return {
        "index": index,
        "live_sequences": _start_sequences(model, (batch, beam_size, length)),  # [B, K, L]
        "live_log_probs": ops.broadcast_to(ops.cast(first, "float32"), (batch, beam_size)),  # [B, K]
        "finished_sequences": ops.zeros((batch, beam_size, length), "int32"),  # [B, K, L]
        "finished_scores": ops.full((batch, beam_size), NEG_INF, "float32"),  # [B, K]
    }


def _beam_tokens(state):
    live = state["live_sequences"]
    batch, beam_size = _dim(live, 0), _dim(live, 1)
    return ops.reshape(_read_position(live, state["index"]), (batch * beam_size,))  # [B * K]


def _beam_update(model, state, logits, max_lengths, alpha):
    index = state["index"]
    live = state["live_sequences"]
    batch, beam_size = _dim(live, 0), _dim(live, 1)
    vocabulary_size = model.vocabulary_size

    # [B * K, V] -> [B, K, V]
    logits = ops.reshape(ops.convert_to_tensor(logits), (batch, beam_size, vocabulary_size))
    log_probs = _token_log_probs(model, logits, index + 1, max_lengths)

    # The best 2K extensions of the live beams: at most K of them end, so at
    # least K stay live.
    candidates = ops.expand_dims(state["live_log_probs"], 2) + log_probs  # [B, K, V]
    candidates = ops.reshape(candidates, (batch, beam_size * vocabulary_size))  # [B, K * V]
    top_log_probs, top_indices = ops.top_k(candidates, 2 * beam_size)  # [B, 2K]
    top_indices = ops.cast(top_indices, "int32")
    top_parents = ops.floor_divide(top_indices, vocabulary_size)  # [B, 2K], beam in 0..K-1
    top_tokens = ops.mod(top_indices, vocabulary_size)  # [B, 2K]
    top_sequences = _write_position(gather_beams(live, top_parents), index + 1, top_tokens)  # [B, 2K, L]
    top_ended = ops.equal(top_tokens, model.end_id)

    # Live: the best K extensions that did not end.
    live_log_probs, live_choice = ops.top_k(ops.where(top_ended, NEG_INF, top_log_probs), beam_size)  # [B, K]
    live_sequences = gather_beams(top_sequences, live_choice)  # [B, K, L]
    parents = gather_beams(top_parents, live_choice)  # [B, K]

    # Finished: merge the extensions that ended, scored with the length
    # penalty, into the best K finished so far.
    ended_scores = top_log_probs / length_penalty_factor(index + 1, alpha)
    ended_scores = ops.where(top_ended, ended_scores, NEG_INF)  # [B, 2K]
    all_scores = ops.concatenate([state["finished_scores"], ended_scores], axis=1)  # [B, 3K]
    all_sequences = ops.concatenate([state["finished_sequences"], top_sequences], axis=1)  # [B, 3K, L]
    finished_scores, finished_choice = ops.top_k(all_scores, beam_size)  # [B, K]

    state = {
        "index": index + 1,
        "live_sequences": live_sequences,
        "live_log_probs": live_log_probs,
        "finished_sequences": gather_beams(all_sequences, finished_choice),
        "finished_scores": finished_scores,
    }
    return state, parents


def _beam_keep_going(state, max_lengths, alpha, length):
    # Beams are sorted best first (top_k), so column 0 is each row's best.
    best_live_bound = state["live_log_probs"][:, 0] / length_penalty_factor(max_lengths, alpha)  # [B]
    best_finished = state["finished_scores"][:, 0]  # [B]
    # -inf >= -inf: a row with neither finished nor live beams has stopped.
    stopped = ops.greater_equal(best_finished, best_live_bound)
    return ops.logical_and(state["index"] < length - 1, ops.logical_not(ops.all(stopped)))


def _beam_result(state):
    # Every row has a finished hypothesis: the end id is forced at its
    # maximum length.
    return state["finished_sequences"][:, 0], state["finished_scores"][:, 0]


BEAM = _Search("beam", _beam_tokens, _beam_update, _beam_keep_going, _beam_result)
_SEARCHES = {search.name: search for search in (GREEDY, BEAM)}


# ---------------------------------------------------------------------- #
# Drivers: which one runs, and compilation
# ---------------------------------------------------------------------- #
def _select_search(model, compile):
    """The driver for `model`: its own, compiled, hybrid or eager (see `generate`)."""
    backend = keras.backend.backend()
    if compile and callable(getattr(model, "run_search", None)):
        return _model_search
    has_variables = isinstance(getattr(model, "variables", None), (list, tuple))
    if compile and backend == "torch" and TORCH_COMPILE_BACKEND is not None and has_variables:
        return _torch_step_search
    if not compile or backend not in ("jax", "tensorflow"):
        return _eager_search
    if has_variables:
        return _compiled_search(model)
    return _hybrid_search


def _model_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
    return model.run_search(encoder_token_ids, max_lengths, alpha, beam_size, length)


def _eager_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            return _search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=False)
    return _search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=False)


def _cache_for(model, key, build):
    """`_COMPILED[model][key]`, built once; models that cannot be weakly referenced are not cached."""
    try:
        per_model = _COMPILED.setdefault(model, {})
    except TypeError:
        logger.debug("%s is not weak-referenceable; compiled functions are not cached", type(model).__name__)
        return build()
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def _compiled_search(model):
    """The whole search compiled for `model`, which exposes Keras `variables`.

    `jax.jit` on JAX (the variables are arguments, through
    `keras.StatelessScope`, so they are not baked in as constants and later
    weight updates are seen) and `tf.function(jit_compile=True)` on
    TensorFlow (XLA: much faster on CPU than a plain graph, see
    benchmarks/README.md).
    """
    model_ref = weakref.ref(model)  # The cache must not keep the model alive.

    def build_jax():
        import jax

        variables = list(model.variables)

        def stateless_search(values, encoder_token_ids, max_lengths, alpha, beam_size, length):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return _search(model_ref(), encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=True)

        jitted = jax.jit(stateless_search, static_argnames=("beam_size", "length"))

        def search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
            values = [v.value for v in variables]
            return jitted(values, encoder_token_ids, max_lengths, alpha, beam_size=beam_size, length=length)

        return search

    def build_tensorflow():
        import tensorflow as tf

        @tf.function(jit_compile=TF_JIT_COMPILE)
        def traced(encoder_token_ids, max_lengths, alpha, beam_size, length):
            return _search(model_ref(), encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=True)

        def search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
            # Traced once per (batch, source bucket, beam size, L) by design,
            # and the bucket's concrete function is called directly: calling
            # `traced` itself, TensorFlow would count each new bucket as a
            # retrace and warn "N out of the last N calls ... triggered
            # tf.function retracing" from the fifth on.
            args = (encoder_token_ids, max_lengths, alpha, beam_size, length)
            return traced.get_concrete_function(*args)(*args)

        return search

    backend = keras.backend.backend()
    return _cache_for(model, "search", build_jax if backend == "jax" else build_tensorflow)


def _torch_step_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
    """PyTorch: a Python loop over one compiled step (`_torch_compiled_step`).

    The encoder and the cache run eagerly once; the loop's only host sync
    per step is the stopping test.
    """
    import torch

    with torch.no_grad():
        index = ops.convert_to_tensor(0, "int32")
        search, state, cache = _initial_state(model, encoder_token_ids, beam_size, length, index)
        # Contiguous, as the step's outputs: torch.compile guards on strides,
        # and the broadcast start state would make it compile twice.
        state, cache = ({name: x.contiguous() for name, x in entries.items()} for entries in (state, cache))
        step = _torch_compiled_step(model, search, state, cache, max_lengths, alpha, length)
        values = [variable.value for variable in model.variables]
        keep_going = search.keep_going(state, max_lengths, alpha, length)
        while bool(ops.convert_to_numpy(keep_going)):
            state, cache, keep_going = step(values, state, cache, max_lengths, alpha)
        return search.result(state)


def _torch_compiled_step(model, search, state, cache, max_lengths, alpha, length):
    """`_step` and the stopping test as one `torch.compile`d graph, cached per model and shape.

    The step is captured with `torch.export` (non-strict: Python runs once,
    so Keras' per-call overhead is gone, and no TorchDynamo tracing of
    Keras), with the variables as inputs (`keras.StatelessScope`, as for
    JAX, so later weight updates are seen), and the captured graph is run
    as it is (`TORCH_COMPILE_BACKEND = "export"`) or compiled with
    `torch.compile(backend=TORCH_COMPILE_BACKEND)`. Shapes are static: one
    graph per (search, batch, beam, source bucket, L).
    """
    import torch

    backend = TORCH_COMPILE_BACKEND
    shapes = tuple(
        tuple((name, tuple(x.shape), str(x.dtype)) for name, x in sorted(entries.items())) for entries in (state, cache)
    )
    key = ("torch_step", backend, search.name, length, shapes)
    model_ref = weakref.ref(model)  # The cache must not keep the model alive.
    variables = list(model.variables)

    class Step(torch.nn.Module):
        def forward(self, values, state, cache, max_lengths, alpha):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                state, cache = _step(model_ref(), search, state, cache, max_lengths, alpha)
                return state, cache, search.keep_going(state, max_lengths, alpha, length)

    def build():
        logger.info(
            "Capturing the PyTorch %s search step (%d rows, L=%d) for TORCH_COMPILE_BACKEND=%r",
            search.name, _dim(next(iter(cache.values())), 0), length, backend,
        )
        # Traced once with the current index; it is a tensor input, so the graph serves every step.
        example = ([variable.value for variable in variables], state, cache, max_lengths, alpha)
        captured = torch.export.export(Step(), example, strict=False).module()
        if backend == "export":
            return captured
        # Compiled on the first call.
        return torch.compile(captured, backend=backend, fullgraph=True, dynamic=False)

    return _cache_for(model, key, build)


# The state of each search, in the order `search_step` documents it.
SEARCH_STATE_KEYS = {
    "greedy": ("index", "sequences", "log_probs", "scores", "finished"),
    "beam": ("index", "live_sequences", "live_log_probs", "finished_sequences", "finished_scores"),
}


def search_step(search_name, model):
    """The search's own work between two decoder steps, as one function.

    For drivers that run the decoder step elsewhere: the hybrid driver
    compiles it, and `export/onnx.py` exports it as a graph that ONNX Runtime
    runs between two `decoder_step` calls, so the exported search is this
    module's code.

    Args:
        search_name: "greedy" or "beam".
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
    search = _SEARCHES[search_name]
    constants = _ModelConstants(model)

    def step(state, logits, max_lengths, alpha, length, cache):
        state, parents = search.update(constants, state, logits, max_lengths, alpha)
        if parents is not None:
            cache = reorder_cache(cache, parents)
        return state, cache, search.tokens(state), search.keep_going(state, max_lengths, alpha, length)

    return step


def _compiled_update(search, model):
    """`search_step` compiled (hybrid driver), shared by models with the same ids.

    Only the model's ids and vocabulary size are read from `model`, so models
    that share them share the compiled function (traced once per shape).
    """
    constants = _ModelConstants(model)

    def build():
        step = search_step(search.name, constants)
        if keras.backend.backend() == "jax":
            import jax

            return jax.jit(step, static_argnames=("length",))
        import tensorflow as tf

        return tf.function(step, jit_compile=TF_JIT_COMPILE)

    key = (keras.backend.backend(), search.name, constants.key())
    if key not in _COMPILED_UPDATES:
        _COMPILED_UPDATES[key] = build()
    return _COMPILED_UPDATES[key]


class _ModelConstants:
    """The ids and vocabulary size of a model: all that a search update reads."""

    def __init__(self, model):
        self.vocabulary_size = int(model.vocabulary_size)
        self.pad_id, self.start_id, self.end_id = int(model.pad_id), int(model.start_id), int(model.end_id)

    def key(self):
        return (self.vocabulary_size, self.pad_id, self.start_id, self.end_id)
