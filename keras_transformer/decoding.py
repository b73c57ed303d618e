"""The framework-free parts of the search: its arguments and its output rows.

NumPy and the standard library only: `keras_transformer.generation` (the
search in `keras.ops`) and the ONNX Runtime server `export.runtime` (which
must run without Keras, TensorFlow, JAX or PyTorch) both use these, so the
two check the same arguments and return the same rows.

`generate_hypotheses` (n-best, target prefixes, sampling) is planned here
for both engines: `hypotheses_plan` chooses the search and builds its
option arrays (named as the exported graphs' inputs), each engine runs it,
and `collect_hypotheses` makes the `Hypotheses` of its outputs.
"""

import math
import zlib
from typing import NamedTuple

import numpy as np

from keras_transformer.token_ids import check_id_range
from keras_transformer.utils import is_integer, is_real

# Source and output buffer lengths are rounded up to a multiple of this, so
# that a compiled search is traced once per bucket rather than once per
# length. Extra source positions are padding (masked); extra buffer
# positions are never fed to the decoder.
LENGTH_BUCKET = 8
# Beam search's `ended_to_stop` without `patience`: a count no row reaches,
# so the exact rule alone stops it (one comparison in the exported update
# graph, no separate "is there a patience" test).
NO_PATIENCE = int(np.iinfo(np.int32).max)


def check_search_args(beam_size, length_penalty, max_extra_length, patience=None):
    """Raises `ValueError` naming the argument unless all are valid."""
    if not is_integer(beam_size) or beam_size < 1:
        raise ValueError(f"beam_size={beam_size!r} must be an integer >= 1 (1 is greedy search)")
    if not is_real(length_penalty) or not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty={length_penalty!r} must be a finite number >= 0 (the paper uses 0.6)")
    if not is_integer(max_extra_length) or max_extra_length < 0:
        raise ValueError(f"max_extra_length={max_extra_length!r} must be an integer >= 0")
    if patience is not None and (not is_real(patience) or not math.isfinite(patience) or patience <= 0):
        raise ValueError(
            f"patience={patience!r} must be None (stop when no live beam can win: the exact search) or a finite "
            "number > 0 (CTranslate2's patience: stop a row once round(beam_size * patience) hypotheses ended)"
        )


def ended_to_stop(beam_size, patience):
    """Beam search's `ended_to_stop` option for `patience`: `NO_PATIENCE` for None, else round(K * patience), >= 1.

    `patience` as CTranslate2's (`translate_batch(patience=...)`, from
    Kasai et al. 2022, arXiv:2204.05424): a row of beam search also stops
    once `round(beam_size * patience)` of its extensions have ended among
    the K best of their step (`search/beam.py` `rows_done`). Rounded half
    away from zero, as CTranslate2 does.
    """
    if patience is None:
        return NO_PATIENCE
    return int(min(max(math.floor(beam_size * patience + 0.5), 1), NO_PATIENCE))


def finish_rows(sequences, end_id, pad_id):
    """Pads every row after its first end id and trims to the longest row.

    The search always ends a hypothesis with the end id (it is forced at the
    maximum length); a row without one (not produced by this package's
    search) gets the end id appended after its last token.

    Args:
        sequences: int `[B, L]`, each row starting with the start id.

    Returns:
        int32 `[B, L']`, C-contiguous.
    """
    sequences = np.asarray(sequences).astype("int32", copy=True)
    is_end = sequences[:, 1:] == end_id
    ends = np.where(is_end.any(axis=1), is_end.argmax(axis=1) + 1, -1)
    missing = ends < 0
    if missing.any():
        sequences = np.pad(sequences, ((0, 0), (0, 1)), constant_values=pad_id)
        for row in np.flatnonzero(missing):
            tokens = np.flatnonzero(sequences[row] != pad_id)
            ends[row] = tokens[-1] + 1
            sequences[row, ends[row]] = end_id
    positions = np.arange(sequences.shape[1])[None, :]
    sequences = np.where(positions > ends[:, None], pad_id, sequences)
    return np.ascontiguousarray(sequences[:, : int(ends.max()) + 1])


# Sampling seeds and row keys are in [0, MAX_SEED] (`search/sample.py`: its hash is modulo 2^31 - 1).
MAX_SEED = 2**31 - 2


class Hypotheses(NamedTuple):
    """The n best outputs of each source row (`generate_hypotheses`), best first.

    Attributes:
        sequences: int32 `[B, n, L]`: each the start id, the tokens, the end
            id, then pad ids (trimmed to the longest).
        scores: float32 `[B, n]`, `log_probs / length_penalty_factor(|Y|, alpha)`
            (-inf for a slot the search could not fill).
        log_probs: float32 `[B, n]`, log P(Y | X) under the search's token
            rule (`search/log_probs.py`), as `score_targets` computes it.
    """

    sequences: np.ndarray
    scores: np.ndarray
    log_probs: np.ndarray


def check_hypotheses_args(beam_size, num_hypotheses, sampling_topk, sampling_topp, sampling_temperature, seed):
    """Raises `ValueError` naming the first bad argument of `generate_hypotheses` (and `translate`).

    `sampling_topk=1` is no sampling (the usual search); any other value
    samples, with `beam_size=1`, `num_hypotheses` samples per source.
    """
    if not is_integer(num_hypotheses) or num_hypotheses < 1:
        raise ValueError(f"num_hypotheses={num_hypotheses!r} must be an integer >= 1")
    if not is_integer(sampling_topk) or sampling_topk < 0:
        raise ValueError(
            f"sampling_topk={sampling_topk!r} must be an integer >= 0 (1: no sampling, 0: the whole vocabulary)"
        )
    if not is_real(sampling_topp) or not 0 < sampling_topp <= 1:
        raise ValueError(f"sampling_topp={sampling_topp!r} must be a number in (0, 1]")
    if not is_real(sampling_temperature) or not math.isfinite(sampling_temperature) or sampling_temperature <= 0:
        raise ValueError(f"sampling_temperature={sampling_temperature!r} must be a finite number > 0")
    if not is_integer(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} must be an integer in [0, {MAX_SEED}]")
    if sampling_topk != 1 and beam_size != 1:
        raise ValueError(
            f"sampling_topk={sampling_topk} samples one token at a time and needs beam_size=1, "
            f"received beam_size={beam_size}"
        )
    if sampling_topk == 1 and num_hypotheses > beam_size:
        raise ValueError(
            f"num_hypotheses={num_hypotheses} must be <= beam_size={beam_size} (the search keeps beam_size "
            "hypotheses; sample with sampling_topk != 1 for more)"
        )


def check_prefix_length(index, length, max_sequence_length, name="target_prefix"):
    """Refuses a prefix of `length` tokens that leaves no room for the end id under the model's limit."""
    if max_sequence_length is not None and length > int(max_sequence_length) - 2:
        raise ValueError(
            f"{name}[{index}] has {length} tokens; at most {int(max_sequence_length) - 2} are allowed "
            f"(max_sequence_length={max_sequence_length} holds the start token, the prefix and the end token)"
        )


def target_prefix_ids(target_prefix, batch, model):
    """The target prefixes of a batch as the search's `[B, P]` int32 array, or None when there are none.

    Args:
        target_prefix: None; or per source row None or a sequence of token
            ids (no start or end id); or an int array `[B, P]`, each row its
            ids then pad ids. A row without tokens has no prefix.
        batch: B.
        model: read for `vocabulary_size`, `pad_id`, `start_id`, `end_id`,
            `max_sequence_length` (optional).

    Returns:
        int32 `[B, P]`, P a multiple of `LENGTH_BUCKET` (a compiled search
        is traced once per bucket), pad-filled; None if no row has tokens.

    Raises:
        ValueError: naming the row, for a prefix that is not a list of ids,
            holds the start or end id or an id outside the vocabulary, has a
            pad id before a token, or is longer than the model allows
            (`check_prefix_length`).
    """
    if target_prefix is None:
        return None
    rows = list(target_prefix)
    if len(rows) != batch:
        raise ValueError(f"target_prefix has {len(rows)} rows; expected one per source row ({batch}), or None")
    prefixes = []
    for i, row in enumerate(rows):
        ids = np.zeros((0,), np.int64) if row is None else np.asarray(row)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"target_prefix[{i}] must be None or a list of token ids, received {row!r}")
        check_id_range(ids, f"target_prefix[{i}]", model.vocabulary_size)
        tokens = np.flatnonzero(ids != model.pad_id)
        length = int(tokens[-1]) + 1 if tokens.size else 0
        if tokens.size != length:
            raise ValueError(f"target_prefix[{i}] has a pad id ({model.pad_id}) before its last token")
        special = [int(x) for x in ids[:length] if x in (model.start_id, model.end_id)]
        if special:
            raise ValueError(
                f"target_prefix[{i}] holds id {special[0]}; a prefix holds tokens only, not the start id "
                f"{model.start_id} or the end id {model.end_id}"
            )
        check_prefix_length(i, length, getattr(model, "max_sequence_length", None))
        prefixes.append(ids[:length])
    longest = max((len(ids) for ids in prefixes), default=0)
    if longest == 0:
        return None
    width = -(-longest // LENGTH_BUCKET) * LENGTH_BUCKET
    array = np.full((batch, width), model.pad_id, np.int32)
    for i, ids in enumerate(prefixes):
        array[i, : len(ids)] = ids
    return array


class HypothesesPlan(NamedTuple):
    """How `generate_hypotheses` runs a batch (`hypotheses_plan`).

    Attributes:
        search_name: "greedy", "beam" or "sample".
        beam_size: the search's beam size (1 unless beam search).
        source: int32 `[B', S]` source ids (each row repeated per sample).
        options: `{name: NumPy array}` of the search's options, named as the
            exported graphs' inputs (`target_prefix`, `num_hypotheses`,
            `ended_to_stop`, `sample_key`, `seed`, `sampling_*`).
    """

    search_name: str
    beam_size: int
    source: np.ndarray
    options: dict


def hypotheses_plan(source, prefix, beam_size, num_hypotheses, sampling_topk, sampling_topp, sampling_temperature,
                    seed, patience=None):
    """The search that gives `num_hypotheses` per source row, with checked arguments.

    Beam search (`beam_size > 1`) keeps its `num_hypotheses` best finished
    hypotheses; sampling (`sampling_topk != 1`) repeats each row
    `num_hypotheses` times, each with its own `sample_keys`; otherwise
    greedy search (one hypothesis).

    Args:
        source: int32 `[B, S]`.
        prefix: None or int32 `[B, P]` (`target_prefix_ids`).
        patience: None or a number > 0 (`ended_to_stop`; beam search only).
    """
    options = {}
    if sampling_topk != 1:
        repeats = num_hypotheses
        source = np.repeat(source, repeats, axis=0)
        prefix = None if prefix is None else np.repeat(prefix, repeats, axis=0)
        options.update(
            sample_key=sample_keys(source, repeats),
            seed=np.int32(seed),
            sampling_topk=np.int32(sampling_topk),
            sampling_topp=np.float32(sampling_topp),
            sampling_temperature=np.float32(sampling_temperature),
        )
        search_name, beam_size = "sample", 1
    elif beam_size == 1:
        search_name = "greedy"
    else:
        search_name = "beam"
        options["num_hypotheses"] = np.int32(num_hypotheses)
        options["ended_to_stop"] = np.int32(ended_to_stop(beam_size, patience))
    if prefix is not None:
        options["target_prefix"] = prefix
    return HypothesesPlan(search_name, int(beam_size), np.ascontiguousarray(source, np.int32), options)


def sample_keys(source, num_samples):
    """The key of each sampled row: a hash of its source tokens and its sample number.

    Args:
        source: int `[B * num_samples, S]`, each source row repeated
            `num_samples` times; padding is ignored (so a text gets the same
            key in any batch).

    Returns:
        int32 `[B * num_samples]` in `[0, MAX_SEED]` (CRC-32 of the tokens
        and the sample number, reduced).
    """
    keys = np.zeros((len(source),), np.int32)
    for row, ids in enumerate(np.asarray(source)):
        tokens = ids[ids != 0].astype("<i4").tobytes() + np.int32(row % num_samples).astype("<i4").tobytes()
        keys[row] = zlib.crc32(tokens) % (MAX_SEED + 1)
    return keys


def collect_hypotheses(plan, sequences, scores, log_probs, num_hypotheses, model):
    """The `Hypotheses` of a plan's search outputs.

    Args:
        plan: the `HypothesesPlan` that was run.
        sequences: int `[B', K, L]`; scores, log_probs: float `[B', K]`,
            each row's hypotheses best first (K = 1 but for beam search;
            `[B', L]` and `[B']` for K = 1 too).
        model: read for `pad_id`, `start_id`, `end_id`.

    Returns:
        `Hypotheses` with `num_hypotheses` per source row, best first:
        beam search's first `num_hypotheses`, or the samples of each row
        sorted by score (samples may repeat).
    """
    sequences, scores, log_probs = (np.asarray(x) for x in (sequences, scores, log_probs))
    if sequences.ndim == 2:
        sequences, scores, log_probs = sequences[:, None], scores[:, None], log_probs[:, None]
    if plan.search_name == "sample":
        batch = sequences.shape[0] // num_hypotheses
        sequences = sequences.reshape((batch, num_hypotheses, sequences.shape[-1]))
        scores, log_probs = (x.reshape((batch, num_hypotheses)) for x in (scores, log_probs))
        order = np.argsort(-scores, axis=1, kind="stable")
        sequences = np.take_along_axis(sequences, order[:, :, None], axis=1)
        scores, log_probs = (np.take_along_axis(x, order, axis=1) for x in (scores, log_probs))
    else:
        sequences, scores, log_probs = (x[:, :num_hypotheses] for x in (sequences, scores, log_probs))
    batch, count, length = sequences.shape
    rows = sequences.reshape((batch * count, length)).astype(np.int32)
    # A slot the search could not fill (-inf) holds no hypothesis: an empty one.
    unfilled = ~np.isfinite(scores.reshape(-1))
    rows[unfilled] = model.pad_id
    rows[unfilled, 0] = model.start_id
    rows[unfilled, 1 % length] = model.end_id
    rows = finish_rows(rows, model.end_id, model.pad_id)
    return Hypotheses(
        rows.reshape((batch, count, rows.shape[-1])), scores.astype(np.float32), log_probs.astype(np.float32)
    )


def no_hypotheses(num_hypotheses):
    """The `Hypotheses` of an empty batch."""
    return Hypotheses(
        np.zeros((0, num_hypotheses, 0), np.int32), np.zeros((0, num_hypotheses), np.float32),
        np.zeros((0, num_hypotheses), np.float32),
    )
