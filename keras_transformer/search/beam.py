"""Beam search with the GNMT length penalty, as the paper (section 6.1).

Pure functions of a state (a dict declared by `STATE_SPEC`), driven by
`search/loop.py`: `init`, `tokens`, `update`, `rows_done`, `keep_going`,
`result`, `hypotheses` (the n best); and the
beam gathers (`gather_beams`, `tile_cache`, `reorder_cache`), vectorised as
in tensor2tensor's `beam_search.py` and the Flax WMT example's `decode.py`
(live and finished beams).
Shape legend: B batch, K beam size, P target prefix length, L output buffer
length, V vocabulary size.

A target prefix needs nothing of its own here: the token rule
(`log_probs.py`) leaves one finite extension per live beam inside a row's
prefix, and beam 0, the only live beam at the start, follows it.
"""

import keras
from keras import ops

from keras_transformer.decoding import NO_PATIENCE
from keras_transformer.search.common import (
    NEG_INF,
    Field,
    constant_field,
    dim,
    read_position,
    row_offsets,
    start_sequences,
    target_prefix,
    top_k,
    write_position,
)
from keras_transformer.search.lengths import length_penalty_factor
from keras_transformer.search.log_probs import token_log_probs

NAME = "beam"
# `update` returns each new beam's parent, by which the driver reorders the cache.
REORDERS_CACHE = True
STATE_SPEC = (
    Field("index", "int32", ()),  # the position last written
    Field("live_sequences", "int32", ("B", "K", "L")),
    Field("live_log_probs", "float32", ("B", "K")),  # best first
    Field("finished_sequences", "int32", ("B", "K", "L")),
    Field("finished_scores", "float32", ("B", "K")),  # best first, -inf where none
    Field("finished_log_probs", "float32", ("B", "K")),  # their log-probabilities
    Field("ended", "int32", ("B",)),  # extensions that ended among each step's K best (`patience`)
    Field("target_prefix", "int32", ("B", "P"), constant=True),  # forced first tokens, pad-filled
    Field("num_hypotheses", "int32", (), constant=True),  # finished hypotheses a row needs before it stops
    Field("ended_to_stop", "int32", (), constant=True),  # `patience`'s count of ended extensions, or NO_PATIENCE
)


def init(model, batch, beam_size, length, index, cache, options=None):
    """The start state and the cache tiled per beam (`[B, ...] -> [B * K, ...]`).

    `options`: a dict that may hold `target_prefix` (int32 `[B, P]`),
    `num_hypotheses` (int32 scalar in `1..K`, default 1) and
    `ended_to_stop` (int32 scalar, `decoding.ended_to_stop`; default
    `NO_PATIENCE`, a count no row reaches: the exact stopping rule only).
    """
    # All beams start as the same start id; only beam 0 is live, so the first
    # step does not pick K copies of the same extension.
    first = ops.where(ops.equal(ops.arange(beam_size, dtype="int32"), 0), 0.0, NEG_INF)
    state = {
        "index": index,
        "live_sequences": start_sequences(model, (batch, beam_size, length)),  # [B, K, L]
        "live_log_probs": ops.broadcast_to(ops.cast(first, "float32"), (batch, beam_size)),  # [B, K]
        "finished_sequences": ops.zeros((batch, beam_size, length), "int32"),  # [B, K, L]
        "finished_scores": ops.full((batch, beam_size), NEG_INF, "float32"),  # [B, K]
        "finished_log_probs": ops.full((batch, beam_size), NEG_INF, "float32"),  # [B, K]
        "ended": ops.zeros((batch,), "int32"),  # [B]
        "target_prefix": target_prefix(options, batch),  # [B, P]
        "num_hypotheses": constant_field(options, "num_hypotheses", 1, "int32"),
        "ended_to_stop": constant_field(options, "ended_to_stop", NO_PATIENCE, "int32"),
    }
    return state, tile_cache(cache, beam_size)


def tokens(state):
    """The ids to feed at the state's index, `[B * K]`."""
    return ops.reshape(read_position(state["live_sequences"], state["index"]), (-1,))  # [B * K]


def update(model, state, logits, max_lengths, alpha):
    """Extends the live beams by `logits` `[B * K, V]`; returns `(state, parents [B, K])`."""
    index = state["index"]
    live = state["live_sequences"]
    # Each dynamic size once (in an exported graph, each is a chain of shape nodes).
    batch, beam_size, length = dim(live, 0), dim(live, 1), dim(live, 2)
    vocabulary_size = model.vocabulary_size

    # [B * K, V] -> [B, K, V]
    logits = ops.reshape(ops.convert_to_tensor(logits), (batch, beam_size, vocabulary_size))
    log_probs = token_log_probs(model, logits, index + 1, max_lengths, state["target_prefix"])

    # The best 2K extensions of the live beams: at most K of them end, so at
    # least K stay live.
    candidates = ops.expand_dims(state["live_log_probs"], 2) + log_probs  # [B, K, V]
    candidates = ops.reshape(candidates, (batch, beam_size * vocabulary_size))  # [B, K * V]
    top_log_probs, top_indices = top_k(candidates, 2 * beam_size, unit=vocabulary_size)  # [B, 2K], in two stages
    top_parents = ops.floor_divide(top_indices, vocabulary_size)  # [B, 2K], beam in 0..K-1
    top_tokens = ops.mod(top_indices, vocabulary_size)  # [B, 2K]
    top_sequences = _take_beams(live, _flat_beam_indices(top_parents, beam_size, batch), (length,))  # [B, 2K, L]
    top_sequences = write_position(top_sequences, index + 1, top_tokens)
    top_ended = ops.equal(top_tokens, model.end_id)
    # `patience`'s count: CTranslate2 counts the hypotheses that end among the K best extensions,
    # read as column K - 1 of the running count over the 2K (in an exported graph
    # a gather at one index; a slice `[:, :K]` of a dynamic K is a chain of shape nodes).
    ended_in_top = ops.take(ops.cumsum(ops.cast(top_ended, "int32"), axis=1), beam_size - 1, axis=1)  # [B]
    ended = state["ended"] + ended_in_top

    # Live: the best K extensions that did not end.
    live_log_probs, live_choice = ops.top_k(ops.where(top_ended, NEG_INF, top_log_probs), beam_size)  # [B, K]
    live_choice = _flat_beam_indices(live_choice, 2 * beam_size, batch)
    live_sequences = _take_beams(top_sequences, live_choice, (length,))  # [B, K, L]
    parents = _take_beams(top_parents, live_choice, ())  # [B, K]

    # Finished: merge the extensions that ended, scored with the length
    # penalty, into the best K finished so far.
    ended_scores = top_log_probs / length_penalty_factor(index + 1, alpha)
    ended_scores = ops.where(top_ended, ended_scores, NEG_INF)  # [B, 2K]
    all_scores = ops.concatenate([state["finished_scores"], ended_scores], axis=1)  # [B, 3K]
    all_sequences = ops.concatenate([state["finished_sequences"], top_sequences], axis=1)  # [B, 3K, L]
    all_log_probs = ops.concatenate([state["finished_log_probs"], top_log_probs], axis=1)  # [B, 3K]
    finished_scores, finished_choice = ops.top_k(all_scores, beam_size)  # [B, K]
    finished_choice = _flat_beam_indices(finished_choice, 3 * beam_size, batch)
    finished_sequences = _take_beams(all_sequences, finished_choice, (length,))  # [B, K, L]
    finished_log_probs = _take_beams(all_log_probs, finished_choice, ())  # [B, K]

    # A row that `patience` stopped keeps the hypotheses it stopped with. In a batch it runs on with the
    # others (the lockstep drivers), and a later ended extension could still enter its n best: its answer
    # would depend on its batch. (A row the exact rule stopped needs no guard: its n best cannot change.)
    stopped = _stopped_by_patience(state)  # [B], before this step
    finished_scores = ops.where(ops.expand_dims(stopped, 1), state["finished_scores"], finished_scores)
    finished_log_probs = ops.where(ops.expand_dims(stopped, 1), state["finished_log_probs"], finished_log_probs)
    finished_sequences = ops.where(
        ops.expand_dims(stopped, (1, 2)), state["finished_sequences"], finished_sequences
    )

    state = dict(
        state,
        index=index + 1,
        live_sequences=live_sequences,
        live_log_probs=live_log_probs,
        finished_sequences=finished_sequences,
        finished_scores=finished_scores,
        finished_log_probs=finished_log_probs,
        ended=ended,
    )
    return state, parents


def _nth_finished(state):
    """`[B]`: each row's n-th best finished score (n = `num_hypotheses`; -inf while it has fewer)."""
    return ops.take(state["finished_scores"], state["num_hypotheses"] - 1, axis=1)


def _stopped_by_patience(state):
    """Bool `[B]`: rows `patience` has stopped: enough extensions ended, and n finished hypotheses held."""
    return ops.logical_and(state["ended"] >= state["ended_to_stop"], _nth_finished(state) > NEG_INF)


def rows_done(state, max_lengths, alpha):
    """Bool `[B]`: the rows whose readable hypotheses can no longer change.

    n is `num_hypotheses` (1 for `generate`): a row is done when no live
    beam can enter its n best finished hypotheses. A live beam's
    log-probability only decreases, and for alpha >= 0 the penalty is
    largest at the row's maximum length, so `live_log_prob / lp(max_length)`
    bounds its final score. A row that is done stays done, and its first n
    finished hypotheses stay as they are: a later ended extension scores at
    most the bound, and on a tie `top_k` keeps the earlier (finished) one
    first. A row with neither finished nor live beams (-inf >= -inf) is done.

    With `patience` (`ended_to_stop` below `NO_PATIENCE`), a row is also done once that
    many extensions have ended among its K best of a step, counted over
    the steps (CTranslate2's rule, and fairseq's for `patience=1`), and it
    holds its n finished hypotheses: fewer steps, and a later, better
    hypothesis may be missed. `update` keeps such a row's hypotheses as
    they are from then on, so that it answers the same in any batch.
    """
    # Beams are sorted best first (top_k), so column 0 is each row's best.
    best_live_bound = state["live_log_probs"][:, 0] / length_penalty_factor(max_lengths, alpha)  # [B]
    exact = ops.greater_equal(_nth_finished(state), best_live_bound)
    return ops.logical_or(exact, _stopped_by_patience(state))


def keep_going(state, max_lengths, alpha, length):
    """Scalar bool: the buffer has room and some row is not done (`rows_done`)."""
    return ops.logical_and(
        state["index"] < length - 1, ops.logical_not(ops.all(rows_done(state, max_lengths, alpha)))
    )


def result(state):
    """`(sequences [B, L], scores [B])`: each row's best finished hypothesis."""
    # Every row has a finished hypothesis: the end id is forced at its
    # maximum length.
    return state["finished_sequences"][:, 0], state["finished_scores"][:, 0]


def hypotheses(state):
    """`(sequences [B, K, L], scores [B, K], log_probs [B, K])`: every row's finished hypotheses, best first.

    A row holds at least `num_hypotheses` of them (finite scores) unless
    fewer than that were ever live (-inf scores, rows not to be read).
    """
    return state["finished_sequences"], state["finished_scores"], state["finished_log_probs"]


def gather_beams(x, beam_indices):
    """Selects beams: `[B, K_old, ...]` and `[B, K_new]` -> `[B, K_new, ...]`.

    One `ops.take` on the flattened beams with `[B, K_new]` indices:
    `[B, K_old, ...] -> [B * K_old, ...] -> [B, K_new, ...]`. (The flat
    rows' shape is `-1` and the axes after the beam's, and the output needs
    no reshape: in an exported graph each dynamic size is a chain of shape
    nodes.)
    """
    rest = tuple(dim(x, axis) for axis in range(2, len(x.shape)))
    return _take_beams(x, _flat_beam_indices(beam_indices, dim(x, 1)), rest)


def _take_beams(x, rows, rest):
    """`[B, K_old, *rest]` -> `[B, K_new, *rest]`: `rows` `[B, K_new]` of the `[B * K_old, *rest]` layout."""
    return ops.take(ops.reshape(x, (-1, *rest)), rows, axis=0)


def _flat_beam_indices(beam_indices, beam_size, batch=None):
    """`[B, K_new]` beam numbers -> `[B, K_new]` rows of the `[B * K, ...]` layout.

    `batch`: B, where the caller has it (in an exported graph each size read
    from a tensor is a chain of shape nodes).
    """
    batch = dim(beam_indices, 0) if batch is None else batch
    return ops.cast(beam_indices, "int32") + row_offsets(batch, beam_size)


def tile_cache(cache, beam_size):
    """Repeats every cache entry per beam: `[B, ...] -> [B * K, ...]`.

    Row b of the input becomes rows `b * K ... b * K + K - 1`; one
    `ops.take(x, indices, axis=0)` per entry.
    """
    if not cache:
        return {}
    batch = dim(next(iter(cache.values())), 0)
    indices = ops.repeat(ops.arange(batch, dtype="int32"), beam_size)  # [B * K]
    return {name: ops.take(value, indices, axis=0) for name, value in cache.items()}


def reorder_cache(cache, beam_indices, invariant=()):
    """Gives each new beam its parent's cache: `[B * K, ...] -> [B * K, ...]`.

    Args:
        cache: dict of `[B * K, ...]` entries (or tuples of them: a cache
            split per layer, `loop.split_cache`).
        beam_indices: int `[B, K]`, the parent beam (in `0..K-1`) of each
            new beam.
        invariant: names of entries equal for every beam of a row (tiled by
            `tile_cache`, never written per beam): returned as they are, as
            a parent is always a beam of the same row.
    """
    indices = ops.reshape(_flat_beam_indices(beam_indices, dim(beam_indices, 1)), (-1,))  # [B * K]
    return {
        name: value if name in invariant else keras.tree.map_structure(lambda x: ops.take(x, indices, axis=0), value)
        for name, value in cache.items()
    }
