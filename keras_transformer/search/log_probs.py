"""The search's next-token log-probabilities: one rule, in `keras.ops` and in NumPy.

The rule, applied to the logits of every step:

1. the log-softmax over the model's whole vocabulary, so that a hypothesis'
   score is its true log-probability;
2. the pad and start ids are excluded (-inf): the search never generates them;
3. at a row's maximum length every id but the end id is excluded, and the
   end id gets at least `FORCED_END_LOG_PROB` (a model that gives it
   probability 0 still ends the row);
4. inside a row's target prefix (`target_prefix`, `[B, P]` ids, pad-filled;
   a pad id forces nothing) every id but the prefix's is excluded: the
   forced id keeps its log-probability, so a hypothesis' score is the
   model's log-probability of the whole output, prefix included.

`token_log_probs` (`keras.ops`) is what beam search and sampling apply
(`search/beam.py`, `search/sample.py`), `best_token` its best id for greedy
search (`search/greedy.py`); `token_log_probs_numpy` is its twin
for teacher-forced scoring (`search/scoring.py`), which must run in the ONNX
Runtime server without Keras. `tests/test_scoring.py` checks the twins against
each other on every backend. Keras is imported inside `token_log_probs` only,
so that importing this module does not import it.

Shape legend: B batch, V vocabulary size ("..." any axes between them).
"""

import functools

import numpy as np

# The least log-probability the forced end id gets at the maximum length.
FORCED_END_LOG_PROB = -1e9


def token_log_probs(model, logits, generated_length, max_lengths, target_prefix=None):
    """Log-probabilities of the next token under the search's rule (`keras.ops`).

    Args:
        model: read for `vocabulary_size`, `pad_id`, `start_id`, `end_id`.
        logits: `[B, ..., V]`.
        generated_length: int or scalar tensor, |Y| once this token is added.
        max_lengths: int32 `[B]`, each row's maximum |Y|.
        target_prefix: None, or int32 `[B, P]` (P >= 1): token |Y| of row b
            must be `target_prefix[b, |Y| - 1]` unless that is the pad id
            (or |Y| > P).

    Returns:
        float32 `[B, ..., V]`, -inf where an id is excluded.
    """
    from keras import ops

    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    vocabulary = ops.arange(model.vocabulary_size, dtype="int32")
    allowed = ops.logical_and(
        ops.not_equal(vocabulary, model.pad_id), ops.not_equal(vocabulary, model.start_id)
    )  # [V]
    at_max = ops.equal(max_lengths, generated_length)  # [B]
    at_max = ops.reshape(at_max, (-1,) + (1,) * (len(log_probs.shape) - 1))  # [B, 1, ..., 1]
    is_end = ops.equal(vocabulary, model.end_id)  # [V]
    allowed = ops.logical_and(allowed, ops.logical_or(ops.logical_not(at_max), is_end))
    forced = ops.logical_and(at_max, is_end)  # [B, 1, ..., V]
    if target_prefix is not None:
        prefix_ids, in_prefix = _prefix_position(model, target_prefix, generated_length)  # [B]
        trailing = (1,) * (len(log_probs.shape) - 1)
        in_prefix = ops.reshape(in_prefix, (-1,) + trailing)  # [B, 1, ..., 1]
        is_prefix_id = ops.equal(vocabulary, ops.reshape(prefix_ids, (-1,) + trailing))  # [B, 1, ..., V]
        allowed = ops.logical_and(allowed, ops.logical_or(ops.logical_not(in_prefix), is_prefix_id))
    # The rule as a floor and a mask, each `[B, 1, ..., V]` (no beam axis),
    # applied with one broadcasting maximum and one add: two passes over the
    # `[B, ..., V]` log-probabilities instead of two selects with a
    # broadcast condition (ONNX Runtime's `Where` took 3 of the 8 ms of a
    # beam update at batch 16 x beam 4, vocabulary 8000).
    floor = ops.where(forced, FORCED_END_LOG_PROB, float("-inf"))  # [B, 1, ..., V]
    mask = ops.where(allowed, 0.0, float("-inf"))  # [B, 1, ..., V]
    return ops.maximum(log_probs, floor) + mask


def best_token(model, logits, generated_length, max_lengths, target_prefix=None):
    """The best id under the search's rule and its log-probability: `top_k(token_log_probs(...), 1)`, exactly.

    Greedy search's choice (`search/greedy.py`), without the rule's `[B, V]`
    masks: the log-softmax (one pass), the ids excluded for every row
    (pad, start) as one `[V]` constant added (one pass), and the best id.
    A row at its maximum length or inside its target prefix has one allowed
    id: it is read from the log-softmax at `[B]` instead. The values are
    those of `token_log_probs` bitwise (`x + 0 == max(x, -inf) + 0`), so
    the ids are too; a row the rule leaves no finite id gets id 0 and -inf,
    as `top_k` gives the first of equal values (TensorFlow, JAX, ONNX
    Runtime; `torch.topk` leaves ties unordered). (ONNX Runtime, greedy update
    at batch 16, vocabulary 8000: the rule's `[B, V]` selects, maximum, add
    and comparisons took about half of the graph's node time.)

    Args: as `token_log_probs`, with `logits` `[B, V]`.

    Returns:
        `(log_probs, ids)`: float32 `[B]` and int32 `[B]`.
    """
    from keras import ops

    from keras_transformer.search.common import dim, row_offsets, top_k

    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)  # [B, V]
    excluded = ops.convert_to_tensor(_excluded_ids(model.vocabulary_size, model.pad_id, model.start_id))  # [V]
    best, best_ids = top_k(log_probs + excluded, 1)  # [B, 1]
    # The rows with one allowed id: at the maximum length the end id, inside a prefix the prefix's.
    at_max = ops.equal(max_lengths, generated_length)  # [B]
    forced_ids = ops.full_like(max_lengths, model.end_id)  # [B]
    one_id, possible = at_max, ops.ones_like(at_max)  # [B]
    if target_prefix is not None:
        prefix_ids, in_prefix = _prefix_position(model, target_prefix, generated_length)  # [B]
        forced_ids = ops.where(at_max, forced_ids, prefix_ids)
        one_id = ops.logical_or(at_max, in_prefix)
        # Both: the prefix's id must be the end id, or no id is allowed.
        possible = ops.logical_or(ops.logical_not(ops.logical_and(at_max, in_prefix)),
                                  ops.equal(prefix_ids, model.end_id))
    # A gather from the flat `[B * V]` log-probabilities (`take_along_axis` copies them in tf2onnx's graph).
    flat_ids = forced_ids + row_offsets(dim(log_probs, 0), model.vocabulary_size)[:, 0]  # [B]
    forced = ops.take(ops.reshape(log_probs, (-1,)), flat_ids, axis=0)  # [B]
    forced = ops.where(at_max, ops.maximum(forced, FORCED_END_LOG_PROB), forced)
    forced = ops.where(possible, forced + ops.take(excluded, forced_ids), float("-inf"))
    forced_ids = ops.where(ops.equal(forced, float("-inf")), 0, forced_ids)  # top_k's first of equal values
    return (ops.where(one_id, forced, best[:, 0]),
            ops.where(one_id, forced_ids, ops.cast(best_ids[:, 0], "int32")))


def _prefix_position(model, target_prefix, generated_length):
    """`(prefix_ids [B], in_prefix [B] bool)`: each row's forced id for |Y| = `generated_length`, and whether it forces.

    The id is column |Y| - 1 of `target_prefix` (its last column past the
    prefix's end); it forces nothing past the end or where it is the pad id.
    """
    from keras import ops

    width = ops.shape(target_prefix)[1]
    column = ops.convert_to_tensor(generated_length, "int32") - 1
    prefix_ids = ops.take(target_prefix, ops.minimum(column, width - 1), axis=1)  # [B]
    return prefix_ids, ops.logical_and(ops.less(column, width), ops.not_equal(prefix_ids, model.pad_id))


@functools.lru_cache(maxsize=None)  # eager searches call it every step
def _excluded_ids(vocabulary_size, pad_id, start_id):
    """float32 `[V]`: -inf at the ids the search never generates (pad, start), 0 elsewhere (NumPy; shared, not written)."""
    vocabulary = np.arange(vocabulary_size)
    return np.where((vocabulary == pad_id) | (vocabulary == start_id), -np.inf, 0.0).astype(np.float32)


def token_log_probs_numpy(model, logits, generated_length, max_lengths, target_prefix=None):
    """`token_log_probs` in NumPy: the same rule, the same arguments, float32 `[B, ..., V]`."""
    logits = np.asarray(logits, np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    vocabulary = np.arange(model.vocabulary_size)
    allowed = (vocabulary != model.pad_id) & (vocabulary != model.start_id)  # [V]
    at_max = np.asarray(max_lengths) == generated_length  # [B]
    at_max = at_max.reshape((-1,) + (1,) * (log_probs.ndim - 1))  # [B, 1, ..., 1]
    is_end = vocabulary == model.end_id  # [V]
    allowed = allowed & (~at_max | is_end)
    forced = at_max & is_end
    log_probs = np.where(forced, np.maximum(log_probs, np.float32(FORCED_END_LOG_PROB)), log_probs)
    if target_prefix is not None:
        target_prefix = np.asarray(target_prefix)
        column = generated_length - 1
        prefix_ids = target_prefix[:, min(column, target_prefix.shape[1] - 1)]  # [B]
        in_prefix = (column < target_prefix.shape[1]) & (prefix_ids != model.pad_id)  # [B]
        trailing = (1,) * (log_probs.ndim - 1)
        is_prefix_id = vocabulary == prefix_ids.reshape((-1,) + trailing)  # [B, 1, ..., V]
        allowed = allowed & (~in_prefix.reshape((-1,) + trailing) | is_prefix_id)
    return np.where(allowed, log_probs, np.float32(-np.inf)).astype(np.float32)
