"""Greedy search: the most probable token at every step, until the end id.

Pure functions of a state (a dict declared by `STATE_SPEC`), driven by
`search/loop.py`: `init`, `tokens`, `update`, `rows_done`, `keep_going`,
`result`, `hypotheses`. `extend` (append one chosen token per row) is shared with
sampling (`search/sample.py`), which chooses the token differently.
Shape legend: B batch, P target prefix length, L output buffer length,
V vocabulary size.
"""

from keras import ops

from keras_transformer.search.common import (
    Field,
    read_position,
    start_sequences,
    target_prefix,
    write_position,
)
from keras_transformer.search.lengths import length_penalty_factor
from keras_transformer.search.log_probs import best_token, token_log_probs

NAME = "greedy"
# Greedy search never reorders the decoder cache (`update` returns no parents).
REORDERS_CACHE = False
STATE_SPEC = (
    Field("index", "int32", ()),  # the position last written
    Field("sequences", "int32", ("B", "L")),
    Field("log_probs", "float32", ("B",)),  # sum so far
    Field("scores", "float32", ("B",)),  # set when a row ends
    Field("finished", "bool", ("B",)),
    Field("target_prefix", "int32", ("B", "P"), constant=True),  # forced first tokens, pad-filled
)


def init(model, batch, beam_size, length, index, cache, options=None):
    """The start state (every row the start id) and the cache as it is; `beam_size` is ignored.

    `options`: a dict that may hold `target_prefix` (int32 `[B, P]`).
    """
    state = {
        "index": index,
        "sequences": start_sequences(model, (batch, length)),  # [B, L]
        "log_probs": ops.zeros((batch,), "float32"),  # [B]
        "scores": ops.zeros((batch,), "float32"),  # [B]
        "finished": ops.zeros((batch,), "bool"),  # [B]
        "target_prefix": target_prefix(options, batch),  # [B, P]
    }
    return state, cache


def tokens(state):
    """The ids to feed at the state's index, `[B]`."""
    return read_position(state["sequences"], state["index"])  # [B]


def step_log_probs(model, state, logits, max_lengths):
    """The token rule (`log_probs.py`) for the state's next position: `[B, V]`."""
    return token_log_probs(model, logits, state["index"] + 1, max_lengths, state["target_prefix"])


def update(model, state, logits, max_lengths, alpha):
    """Appends the best token of `logits` `[B, V]`; returns `(state, None)` (no reordering)."""
    # The rule's best id by a top-k, not argmax: the first of equal maxima (on
    # TensorFlow and JAX; torch.topk leaves ties unordered), and it exports to
    # ONNX (Keras' TensorFlow argmax tests the sign bit of zeros with a
    # Bitcast, which tf2onnx cannot convert).
    best_log_probs, next_tokens = best_token(model, logits, state["index"] + 1, max_lengths, state["target_prefix"])
    return extend(model, state, next_tokens, best_log_probs, alpha), None


def extend(model, state, next_tokens, next_log_probs, alpha):
    """The state with `next_tokens` `[B]` (of log-probability `next_log_probs` `[B]`) appended."""
    index = state["index"]
    finished = state["finished"]
    # Rows that already ended are fed pad ids from now on (never read).
    next_tokens = ops.where(finished, model.pad_id, next_tokens)
    total = ops.where(finished, state["log_probs"], state["log_probs"] + next_log_probs)
    ended = ops.logical_and(ops.logical_not(finished), ops.equal(next_tokens, model.end_id))
    scores = ops.where(ended, total / length_penalty_factor(index + 1, alpha), state["scores"])
    return dict(
        state,
        index=index + 1,
        sequences=write_position(state["sequences"], index + 1, next_tokens),
        log_probs=total,
        scores=scores,
        finished=ops.logical_or(finished, ended),
    )


def rows_done(state, max_lengths, alpha):
    """Bool `[B]`: the rows that have ended; their hypothesis no longer changes."""
    return state["finished"]


def keep_going(state, max_lengths, alpha, length):
    """Scalar bool: some row is not done (`rows_done`) and the buffer has room."""
    return ops.logical_and(
        state["index"] < length - 1, ops.logical_not(ops.all(rows_done(state, max_lengths, alpha)))
    )


def result(state):
    """`(sequences [B, L], scores [B])`."""
    return state["sequences"], state["scores"]


def hypotheses(state):
    """`(sequences [B, 1, L], scores [B, 1], log_probs [B, 1])`: each row's one hypothesis."""
    return (
        ops.expand_dims(state["sequences"], 1),
        ops.expand_dims(state["scores"], 1),
        ops.expand_dims(state["log_probs"], 1),
    )
