"""The length rules of the search, in one place.

- the length penalty lp(Y) of Wu et al. (2016), by which hypotheses are scored;
- how long each row may grow (`n_b + max_extra_length`, capped by the
  model's `max_sequence_length`) and the bucketed buffer and source lengths.

The token rule at each step (pad and start ids are never generated; at a
row's maximum length only the end id may be) is `search/log_probs.py`.
"""

from keras import ops

from keras_transformer.decoding import LENGTH_BUCKET
from keras_transformer.search.common import dim


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


def search_lengths(encoder_token_ids, max_extra_length, limit, target_prefix=None):
    """The lengths of a search over int `[B, S]` source ids (B >= 1).

    `keras.ops` only: `generate` calls it on concrete ids, `generate_in_graph`
    on symbolic ones, where the results are tensors.

    Args:
        target_prefix: None or int `[B, P]` ids each output must start
            with, pad-filled: row b may then generate at least its prefix
            and the end id (callers refuse prefixes of `limit - 1` tokens or
            more).

    Returns:
        `(max_lengths, length, padded_length)`: int32 `[B]`, the most
        tokens row b may generate (`n_b + max_extra_length`, at least 1 and
        at least its prefix's tokens + 1, at
        most `limit - 1`); the output buffer length L (the start id and the
        longest row, rounded up to `LENGTH_BUCKET`); and the length S_bucket
        to pad the source to (rounded up to `LENGTH_BUCKET`, not beyond
        `limit` unless the source is already longer).
    """
    source_length = dim(encoder_token_ids, 1)
    source_lengths = ops.sum(ops.cast(ops.not_equal(encoder_token_ids, 0), "int32"), axis=1)  # n_b, [B]
    max_lengths = ops.maximum(source_lengths + max_extra_length, 1)
    if target_prefix is not None:
        prefix_lengths = ops.sum(ops.cast(ops.not_equal(target_prefix, 0), "int32"), axis=1)  # [B]
        max_lengths = ops.maximum(max_lengths, prefix_lengths + 1)
    if limit is not None:
        max_lengths = ops.minimum(max_lengths, int(limit) - 1)
    length = round_up(ops.max(max_lengths) + 1, LENGTH_BUCKET)
    padded_length = round_up(ops.maximum(source_length, 1), LENGTH_BUCKET)
    if limit is not None:
        padded_length = ops.minimum(padded_length, ops.maximum(source_length, int(limit)))
    return ops.cast(max_lengths, "int32"), length, padded_length


def padded_search_inputs(encoder_token_ids, max_extra_length, limit, target_prefix=None):
    """`search_lengths` of symbolic ids, and the ids padded to S_bucket.

    Returns:
        `(source [B, S_bucket] int32, max_lengths [B] int32, length)`.
    """
    encoder_token_ids = ops.cast(encoder_token_ids, "int32")
    max_lengths, length, padded_length = search_lengths(encoder_token_ids, max_extra_length, limit, target_prefix)
    source_length = dim(encoder_token_ids, 1)
    source = ops.pad(encoder_token_ids, [[0, 0], [0, padded_length - source_length]])  # [B, S_bucket]
    return source, max_lengths, length


def round_up(value, multiple):
    """`value` rounded up to a multiple of `multiple`, for `value >= 0` (lengths)."""
    # Not `-(-value // multiple)`: tf2onnx exports an integer FloorDiv as
    # ONNX Div, which truncates negative quotients.
    return (value + multiple - 1) // multiple * multiple
