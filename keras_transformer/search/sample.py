"""Sampling: greedy search with a random draw instead of the most probable token.

Each step draws the next token from the model's distribution, tempered
(`sampling_temperature`) and cut to the `sampling_topk` most probable ids
(0: all) and to the smallest set of most probable ids whose probability
reaches `sampling_topp`. `sampling_topk=1` is greedy search.

The draw is a Gumbel-max draw (Gumbel, 1954; Maddison et al., "A* Sampling",
2014): the kept id with the largest `log_p / temperature + g`, where `g` is
Gumbel noise made from a counter-based hash of (seed, step, row key, token
id) computed with int32 `keras.ops` (`random_integers`): no random state,
nothing but integer multiply, add, divide and compare, so the same seed
draws the same noise on TensorFlow, JAX, PyTorch and in the exported ONNX
graph. A row's key (`decoding.sample_keys`) is a hash of its source's
tokens and the number of the sample, not of its place in the batch: a text
gets the same samples in any batch, and different texts or samples get
independent noise.

The recorded log-probability of a drawn token is the model's (untempered,
under the token rule of `log_probs.py`), so a sample's score is its
log-probability as `score` computes it.

Pure functions of a state (a dict declared by `STATE_SPEC`), driven by
`search/loop.py`; everything but the choice of the token is greedy
search's (`search/greedy.py`).
Shape legend: B batch, V vocabulary size.
"""

from keras import ops

from keras_transformer.search import greedy
from keras_transformer.search.common import NEG_INF, Field, constant_field

NAME = "sample"
REORDERS_CACHE = False
STATE_SPEC = greedy.STATE_SPEC + (
    Field("sample_key", "int32", ("B",), constant=True),  # each row's key in [0, MODULUS): source and sample number
    Field("seed", "int32", (), constant=True),
    Field("sampling_topk", "int32", (), constant=True),  # 0: every id
    Field("sampling_topp", "float32", (), constant=True),  # in (0, 1]
    Field("sampling_temperature", "float32", (), constant=True),  # > 0
)
# The modulus of the hash (the Park-Miller prime 2^31 - 1): every value of the hash is in [0, MODULUS).
MODULUS = 2147483647
# Seeds are in [0, MAX_SEED].
MAX_SEED = MODULUS - 1

tokens = greedy.tokens
rows_done = greedy.rows_done
keep_going = greedy.keep_going
result = greedy.result
hypotheses = greedy.hypotheses


def init(model, batch, beam_size, length, index, cache, options=None):
    """Greedy search's start state and the sampling options (`options`, a dict of tensors)."""
    state, cache = greedy.init(model, batch, beam_size, length, index, cache, options)
    state.update(
        sample_key=constant_field(options, "sample_key", ops.zeros((batch,), "int32"), "int32"),
        seed=constant_field(options, "seed", 0, "int32"),
        sampling_topk=constant_field(options, "sampling_topk", 1, "int32"),
        sampling_topp=constant_field(options, "sampling_topp", 1.0, "float32"),
        sampling_temperature=constant_field(options, "sampling_temperature", 1.0, "float32"),
    )
    return state, cache


def update(model, state, logits, max_lengths, alpha):
    """Appends a token drawn from `logits` `[B, V]`; returns `(state, None)`."""
    log_probs = greedy.step_log_probs(model, state, logits, max_lengths)  # [B, V]
    next_tokens, next_log_probs = draw(
        log_probs, state["seed"], state["index"], state["sample_key"],
        state["sampling_topk"], state["sampling_topp"], state["sampling_temperature"],
    )
    return greedy.extend(model, state, next_tokens, next_log_probs, alpha), None


def draw(log_probs, seed, step, sample_key, topk, topp, temperature):
    """One id per row drawn from `log_probs` `[B, V]` (-inf: excluded).

    Args:
        log_probs: float32 `[B, V]`.
        seed, step: int32 scalars.
        sample_key: int32 `[B]`, each row's key in `[0, MODULUS)`.
        topk: int32 scalar, keep the `topk` most probable ids (0: all).
        topp: float32 scalar, keep the most probable ids until their
            tempered probability reaches `topp` (the first is always kept).
        temperature: float32 scalar > 0.

    Returns:
        `(token_ids [B] int32, their log_probs [B] float32)`.
    """
    vocabulary_size = log_probs.shape[-1]
    # Every id, most probable first: the cuts below are on ranks.
    sorted_log_probs, order = ops.top_k(log_probs, vocabulary_size)  # [B, V]
    order = ops.cast(order, "int32")
    rank = ops.arange(vocabulary_size, dtype="int32")  # [V]
    tempered = sorted_log_probs / temperature
    probs = ops.softmax(tempered, axis=-1)
    mass_before = ops.cumsum(probs, axis=-1) - probs  # [B, V]
    keep = ops.greater(sorted_log_probs, NEG_INF)
    keep = ops.logical_and(keep, ops.logical_or(ops.less_equal(topk, 0), ops.less(rank, topk)))
    keep = ops.logical_and(keep, ops.logical_or(ops.greater_equal(topp, 1.0), ops.less(mass_before, topp)))
    noise = gumbel_noise(random_integers(seed, step, sample_key, order))  # [B, V], by token id
    candidates = ops.where(keep, tempered + noise, NEG_INF)
    # top_k rather than argmax (see greedy.update).
    _, pick = ops.top_k(candidates, 1)  # [B, 1]
    chosen = ops.equal(ops.expand_dims(rank, 0), ops.cast(pick, "int32"))  # [B, V], one True per row
    next_tokens = ops.sum(ops.where(chosen, order, 0), axis=-1)
    # The chosen log-probability is finite; the others are made finite first,
    # as the ONNX conversion may turn this `where` into a product (-inf * 0).
    finite = ops.maximum(sorted_log_probs, -3.0e38)
    next_log_probs = ops.sum(ops.where(chosen, finite, 0.0), axis=-1)
    return ops.cast(next_tokens, "int32"), next_log_probs


def random_integers(seed, step, sample_key, token_ids):
    """Pseudo-random integers in `[0, MODULUS)`, a function of (seed, step, sample, token).

    Args:
        seed, step: int32 scalars in `[0, MODULUS)`.
        sample_key: int32 `[B]` in `[0, MODULUS)`.
        token_ids: int32 `[B, V]`.

    Returns:
        int32 `[B, V]`.
    """
    row = _mix(_add(_mix(_add(_mix(ops.convert_to_tensor(seed, "int32")), step)), sample_key))  # [B]
    return _mix(_mix(_add(ops.expand_dims(row, -1), token_ids)))


def gumbel_noise(integers):
    """Standard Gumbel noise `-log(-log(u))` from `random_integers`' values.

    Their top 23 bits make `u = (2k + 1) / 2^24`, exact in float32 and
    strictly inside (0, 1).
    """
    k = ops.floor_divide(integers, 256)  # [0, 2^23)
    uniform = ops.cast(2 * k + 1, "float32") / float(2**24)
    return -ops.log(-ops.log(uniform))


def _minstd(x):
    """`48271 * x mod (2^31 - 1)` (Park and Miller) without leaving int32 (Schrage's method)."""
    high = ops.floor_divide(x, 44488)  # 44488 = MODULUS // 48271
    t = 48271 * (x - high * 44488) - 3399 * high  # 3399 = MODULUS % 48271; |t| < MODULUS
    return t + ops.where(ops.less(t, 0), MODULUS, 0)


def _add(x, y):
    """`(x + y) mod MODULUS` for x, y in `[0, MODULUS)`, without overflow."""
    d = x - (MODULUS - y)
    return d + ops.where(ops.less(d, 0), MODULUS, 0)


def _mix(x):
    """A scramble of `[0, MODULUS)`: Park-Miller, a square (the non-linear part), Park-Miller."""
    x = _minstd(x)
    low = x - ops.floor_divide(x, 46337) * 46337  # low ** 2 < MODULUS
    x = _add(_add(x, low * low), 1013904223)
    return _minstd(x)
