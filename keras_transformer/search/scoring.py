"""Teacher-forced scoring: the log-probability the search gives a target, over the decoding protocol.

`score_targets(model, encoder_token_ids, decoder_token_ids)` feeds each
target row to `model.decode_step` one position at a time (teacher forcing,
batched) and applies the search's own token rule (`log_probs.py`) to every
step's logits, so that scoring what greedy search generated gives back the
search's log-probability. One implementation for every engine: a Keras
`TransformerModel` on any backend, and `export.runtime.OnnxSeq2Seq`.

NumPy only: the ONNX Runtime server scores without Keras. Keras is imported
only to convert a Keras model's tensors, when that model has imported it.

Shape legend: B batch, S source length, T target buffer length (the start
id, the tokens, the end id, then padding), V vocabulary size.
"""

import contextlib
import sys

import numpy as np

from keras_transformer.decoding import LENGTH_BUCKET
from keras_transformer.search.log_probs import token_log_probs_numpy
from keras_transformer.token_ids import check_id_range, encoder_vocabulary_size


def score_targets(model, encoder_token_ids, decoder_token_ids):
    """Log-probabilities of target rows given source rows, teacher forced.

    Token t of a row (after its start id) gets `log P(y_t | y_<t, x)` as the
    search computes it (`token_log_probs`): the log-softmax of the model's
    logits, with the pad and start ids excluded, and with the row's own
    length as its maximum length (so its end id is the only token allowed
    last, as when the search ends a row at its maximum length). Scoring the
    output of `generate(model, ids, beam_size=1)` gives greedy search's
    log-probability: its score with `length_penalty=0`, or its score times
    `length_penalty_factor(|Y|, alpha)`.

    Args:
        model: an object implementing the decoding protocol
            (`keras_transformer.search.api`).
        encoder_token_ids: int `[B, S]` source ids (tokens + end id, then
            pad id 0).
        decoder_token_ids: int `[B, T]`, as `generate` returns them: each
            row the start id, the target tokens, the end id, then pad ids.
            Rows hold no pad or start id before their end id, and at most
            `model.max_sequence_length` ids from the start id to just before
            the end id.

    Returns:
        `(log_probs, token_log_probs)`: float32 `[B]`, the sum over each
        row's tokens (the end id included); float32 `[B, T - 1]`, the
        log-probability of each token after the start id, 0 after the
        row's end id.

    Raises:
        ValueError: naming the argument, for ids of the wrong rank, dtype or
            range, different batch sizes, or a row that is not
            start id, tokens, end id, padding.

    Example:
    >>> ids = generate(model, src, beam_size=1, length_penalty=0.0, return_scores=True)
    >>> log_probs, _ = score_targets(model, src, ids[0])
    >>> np.allclose(log_probs, ids[1], atol=1e-5)
    True
    """
    source = _int_ids(encoder_token_ids, "encoder_token_ids", encoder_vocabulary_size(model))
    target = _int_ids(decoder_token_ids, "decoder_token_ids", model.vocabulary_size)
    if source.shape[0] != target.shape[0]:
        raise ValueError(
            f"encoder_token_ids has {source.shape[0]} rows but decoder_token_ids has {target.shape[0]}; "
            "score needs one target row per source row"
        )
    lengths = target_lengths(model, target)  # [B], tokens after the start id, end included
    batch = target.shape[0]
    token_log_probs = np.zeros((batch, max(target.shape[1] - 1, 0)), np.float32)
    if batch == 0:
        return np.zeros((0,), np.float32), token_log_probs
    steps = int(lengths.max())
    rows = np.arange(batch)
    # The source padded and the cache rounded up as the search's are
    # (`search/lengths.py`): fewer distinct shapes, each op compiled once.
    limit = getattr(model, "max_sequence_length", None)
    padded = _round_up(source.shape[1])
    if limit is not None:
        padded = min(padded, max(source.shape[1], int(limit)))
    source = np.pad(source, ((0, 0), (0, padded - source.shape[1])))
    cache_length = _round_up(steps)
    with _inference(model):
        cache = model.init_cache(model.encode(source), source, cache_length)
        for index in range(steps):
            # [B] ids at `index`; rows that have ended are fed their padding (never read).
            logits, cache = model.decode_step(np.ascontiguousarray(target[:, index]), index, cache)
            log_probs = token_log_probs_numpy(model, _numpy(logits), index + 1, lengths)  # [B, V]
            chosen = log_probs[rows, target[:, index + 1]]  # [B]
            token_log_probs[:, index] = np.where(index < lengths, chosen, np.float32(0.0))
    # Summed in order, as the search adds each step's log-probability.
    totals = np.zeros((batch,), np.float32)
    for index in range(steps):
        totals = totals + token_log_probs[:, index]
    return totals, token_log_probs


def target_lengths(model, decoder_token_ids):
    """The number of ids after the start id up to the end id (included) of each row, `[B]` int.

    Raises:
        ValueError: a row that does not start with the start id, has no end
            id, holds a pad or start id before its end id, or is longer than
            the model's `max_sequence_length`.
    """
    ids = np.asarray(decoder_token_ids)
    if ids.shape[0] and ids.shape[1] < 2:
        raise ValueError(
            f"decoder_token_ids has shape {ids.shape}; each row needs at least the start id and the end id"
        )
    lengths = np.zeros((ids.shape[0],), np.int64)
    limit = getattr(model, "max_sequence_length", None)
    for row, sequence in enumerate(ids):
        if sequence[0] != model.start_id:
            raise ValueError(
                f"decoder_token_ids row {row} starts with id {sequence[0]}, not the start id {model.start_id}; "
                "rows are the start id, the tokens, the end id, then pad ids (as generate returns them)"
            )
        ends = np.flatnonzero(sequence[1:] == model.end_id)
        if not len(ends):
            raise ValueError(f"decoder_token_ids row {row} has no end id ({model.end_id})")
        length = int(ends[0]) + 1
        tokens = sequence[1:length]
        bad = np.flatnonzero((tokens == model.pad_id) | (tokens == model.start_id))
        if len(bad):
            raise ValueError(
                f"decoder_token_ids row {row} holds id {tokens[bad[0]]} at position {bad[0] + 1}, before its end "
                f"id; the pad id {model.pad_id} and the start id {model.start_id} are never generated"
            )
        if limit is not None and length > limit:
            raise ValueError(
                f"decoder_token_ids row {row} has {length} tokens (its end id included); the model decodes at most "
                f"max_sequence_length={limit} positions"
            )
        lengths[row] = length
    return lengths


def _round_up(length):
    return -(-max(length, 1) // LENGTH_BUCKET) * LENGTH_BUCKET


def _int_ids(token_ids, name, vocabulary_size):
    """A rank-2 integer NumPy array of ids in range, as int32."""
    ids = _numpy(token_ids)
    if ids.ndim != 2:
        raise ValueError(f"{name} must have rank 2 [batch, length], received shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of token ids, received dtype {ids.dtype}")
    check_id_range(ids, name, vocabulary_size)
    return ids.astype(np.int32)


def _numpy(x):
    """A NumPy array from NumPy data, or from a tensor of the Keras backend that produced it."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple, int, float)) or "keras" not in sys.modules:
        return np.asarray(x)
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x))


def _inference(model):
    """`torch.no_grad()` for a Keras model on PyTorch (no autograd graph across the steps); else nothing."""
    if "keras" in sys.modules and isinstance(getattr(model, "variables", None), (list, tuple)):
        import keras

        if keras.backend.backend() == "torch":
            import torch

            return torch.no_grad()
    return contextlib.nullcontext()
