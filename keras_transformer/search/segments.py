"""The segmented driver: done rows leave the batch and the cache grows with the output.

`loop.run` compiles the whole search at fixed shapes: every row of a batch
runs until the batch's longest is done, and every step attends over (and
beam search reorders) a self-attention cache sized for the longest output
the batch may reach (its longest source + `max_extra_length`). This driver
runs the same search (`loop.start`, `loop.step`) in *segments*, each a
`keras.ops.while_loop` compiled at fixed shapes (`advance`), and between
segments, in Python (`run_segments`):

- rows that are done (`rows_done`: their hypotheses no longer change) hand
  out their hypotheses and, once at most half of the rows are live (in a
  segment of at least `MIN_LEAVING_ROWS` rows), leave:
  the live rows are gathered into a batch of the next power of two, filled
  up with copies of a done row (a done row stays done, so the copies never
  keep the search going). A batch then costs about its own rows' steps, not
  its size times its longest row's;
- the self-attention cache starts at `INITIAL_CACHE_LENGTH` positions and
  doubles (up to the buffer length L) when the output reaches its end
  (`model.grow_cache`), so a step attends over about the positions written.

The state's output buffers grow with the cache (C + 1 positions). A
segment stops when the search stops, when the cache is full, or when at
most half of its rows are live. Shapes are fixed within a segment, so XLA
compiles one segment per (rows, cache length, source bucket, beam size)
that a call meets (L is an input, not a shape); powers of two keep them
few. CTranslate2 (finished rows leave, the cache grows) and the ONNX
Runtime step driver (`export/steps.py`) do the same per step.

The tokens are `loop.run`'s: each row's search is the same function of the
row alone (the steps, the token rule and sampling's noise read nothing of
other rows), and a row's hypotheses are read once it is done, when they no
longer change.

Shape legend: B batch (sources), R rows of a segment (a power of two after
the first), K beam size, C cache length, L output buffer length.
"""

import keras
import numpy as np
from keras import ops

from keras_transformer.search import loop
from keras_transformer.search.common import dim

# The self-attention cache's first length; doubled (up to L) whenever the
# output reaches it. 16 holds most sentences' first segment.
INITIAL_CACHE_LENGTH = 16
# Rows leave a segment of at least this many rows only: each new number of
# rows is one more compiled segment (seconds), which a few rows do not win back.
MIN_LEAVING_ROWS = 8


def supports(model):
    """Whether `model` can be driven in segments: its cache grows (`grow_cache`)."""
    return callable(getattr(model, "grow_cache", None))


def pays(batch):
    """Whether segments pay on a batch of `batch` rows: only where rows may leave.

    A shorter cache alone did not: at batch 1 (beam 4, `small` trained, 32
    test sentences, one thread) the whole search and the segments both
    translated 3.6 sentences/s, and the segments compiled 1.6x as long
    (benchmarks/README.md). The whole search in one compiled loop does the
    same work with fewer compilations.
    """
    return batch >= MIN_LEAVING_ROWS


def start(model, encoder_token_ids, beam_size, cache_length, search_name, options=None):
    """Encodes the source; returns the search's start `(state, cache)` for `cache_length` positions.

    The cache holds C = `cache_length` positions and the state's output
    buffers C + 1 (the last step of a segment, at index C - 1, writes the
    token at position C), so that no compiled shape depends on L. It is
    split per layer where the model can (`loop.split_cache`) and stays so
    through the segments, the rows that leave and the cache's growth.
    """
    index = ops.convert_to_tensor(0, "int32")
    search, state, cache = loop.start(
        model, encoder_token_ids, beam_size, cache_length + 1, index, search_name, options, cache_length=cache_length
    )
    return state, loop.split_cache(model, cache)


def advance(model, search_name, state, cache, max_lengths, alpha, length, cache_length, leave_at):
    """Steps the search until it stops, the cache is full, or at most `leave_at` rows are live.

    Traced and compiled (`search/compiled.py`): one `keras.ops.while_loop`.

    Args:
        state, cache: the search's, R rows (R * K cache rows for beam search).
        max_lengths: int32 `[R]`.
        alpha: float32 scalar.
        length: int32 scalar L, the output buffer length of the search
            (`loop.run`'s; the state's buffers hold C + 1 positions).
        cache_length: Python int C, the cache's length: the step at index i
            writes position i, so the segment stops at index C.
        leave_at: int32 scalar: stop once at most this many rows are live.

    Returns:
        `(state, cache, rows_done [R] bool, keep_going scalar bool)`.
    """
    search = loop.SEARCHES[search_name]

    def live_rows(state):
        done = search.rows_done(state, max_lengths, alpha)
        return ops.sum(ops.cast(ops.logical_not(done), "int32"))

    def cond(carry):
        state = carry["state"]
        return ops.logical_and(
            ops.logical_and(search.keep_going(state, max_lengths, alpha, length), state["index"] < cache_length),
            live_rows(state) > leave_at,
        )

    def body(carry):
        state, cache = loop.step(model, search, carry["state"], carry["cache"], max_lengths, alpha)
        return {"state": state, "cache": cache}

    carry = ops.while_loop(cond, body, {"state": state, "cache": cache})
    state = carry["state"]
    return (
        state, carry["cache"], search.rows_done(state, max_lengths, alpha),
        search.keep_going(state, max_lengths, alpha, length),
    )


def run_segments(
    model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled, search_name=None, options=None,
    initial_cache_length=None,
):
    """Runs a search in compiled segments; done rows leave, the cache grows.

    Args:
        model: a decoding-protocol model with `grow_cache`.
        encoder_token_ids, max_lengths, alpha, beam_size, length,
            search_name, options: as `loop.run`.
        compiled: `(start, advance)`, this module's functions compiled, with
            the model bound: `start(encoder_token_ids, beam_size,
            cache_length, search_name, options)` and `advance(search_name,
            state, cache, max_lengths, alpha, length, cache_length, leave_at)`
            (`length` a scalar tensor, `cache_length` a Python int).
        initial_cache_length: the cache's first length (default
            `INITIAL_CACHE_LENGTH`).

    Returns:
        `loop.run`'s hypotheses, NumPy arrays: `(sequences [B, K, L], scores
        [B, K], log_probs [B, K])`.
    """
    compiled_start, compiled_advance = compiled
    search_name = search_name or ("greedy" if beam_size == 1 else "beam")
    search = loop.SEARCHES[search_name]
    cache_length = min(int(initial_cache_length or INITIAL_CACHE_LENGTH), length)
    state, cache = compiled_start(encoder_token_ids, beam_size, cache_length, search_name, options)
    buffer_length = ops.convert_to_tensor(length, "int32")
    batch = dim(encoder_token_ids, 0)
    places = np.arange(batch)  # each row's place in the batch; -1 for the copies that fill a bucket
    results = None
    while True:
        rows = len(places)
        leave_at = ops.convert_to_tensor(rows // 2 if rows >= MIN_LEAVING_ROWS else 0, "int32")
        state, cache, done, keep_going = compiled_advance(
            search_name, state, cache, max_lengths, alpha, buffer_length, cache_length, leave_at
        )
        keep_going = bool(ops.convert_to_numpy(keep_going))
        done = np.asarray(ops.convert_to_numpy(done), bool) if keep_going else np.ones(rows, bool)
        live = ~done
        leaving = not keep_going or (rows >= MIN_LEAVING_ROWS and live.sum() <= rows // 2)
        if leaving:
            hypotheses = [np.asarray(ops.convert_to_numpy(x)) for x in search.hypotheses(state)]
            sequences = hypotheses[0][..., :length]  # [R, K, C + 1] -> at most L positions
            hypotheses[0] = np.pad(sequences, ((0, 0), (0, 0), (0, length - sequences.shape[-1])))
            if results is None:
                results = [np.zeros((batch, *x.shape[1:]), x.dtype) for x in hypotheses]
            out = done & (places >= 0)
            for result, x in zip(results, hypotheses):
                result[places[out]] = x[out]
        if not keep_going:
            return tuple(results)
        if leaving:
            kept = np.flatnonzero(live)
            bucket = 1 << int(len(kept) - 1).bit_length()  # the next power of two
            filler = np.full(bucket - len(kept), np.flatnonzero(done)[0])
            taken = np.concatenate([kept, filler]).astype("int32")
            places = np.concatenate([places[kept], np.full(len(filler), -1)])
            state, cache, max_lengths = _take_rows(search, state, cache, max_lengths, taken, rows)
        index = int(ops.convert_to_numpy(state["index"]))
        if index >= cache_length:
            cache_length = min(2 * cache_length, length)
            cache = model.grow_cache(cache, cache_length)
            state = _grow_buffers(search, state, cache_length + 1)


def _grow_buffers(search, state, length):
    """The state with its output buffers (the fields with an "L" axis) padded to `length` positions."""
    grown = dict(state)
    for field in search.STATE_SPEC:
        if "L" in field.axes:
            x = state[field.name]
            axis = field.axes.index("L")
            padding = [[0, 0]] * len(field.axes)
            padding[axis] = [0, length - dim(x, axis)]
            grown[field.name] = ops.pad(x, padding)  # pad ids: positions not yet written
    return grown


def _take_rows(search, state, cache, max_lengths, taken, rows):
    """The state's, the cache's and `max_lengths`' rows `taken` (int32 `[R']` of the R = `rows` rows)."""
    indices = ops.convert_to_tensor(taken, "int32")
    batch_fields = {field.name for field in search.STATE_SPEC if field.axes[:1] == ("B",)}
    state = {name: ops.take(x, indices, axis=0) if name in batch_fields else x for name, x in state.items()}
    if cache:
        per_row = dim(keras.tree.flatten(cache)[0], 0) // rows  # K for beam search's tiled cache, else 1
        cache_rows = ops.convert_to_tensor((taken[:, None] * per_row + np.arange(per_row)).reshape(-1), "int32")
        cache = keras.tree.map_structure(lambda x: ops.take(x, cache_rows, axis=0), cache)
    return state, cache, ops.take(max_lengths, indices, axis=0)
