"""The framework-free parts of the search: its arguments and its output rows.

NumPy and the standard library only: `keras_transformer.generation` (the
search in `keras.ops`) and the ONNX Runtime server `export.runtime` (which
must run without Keras, TensorFlow, JAX or PyTorch) both use these, so the
two check the same arguments and return the same rows.
"""

import math

import numpy as np

# Source and output buffer lengths are rounded up to a multiple of this, so
# that a compiled search is traced once per bucket rather than once per
# length. Extra source positions are padding (masked); extra buffer
# positions are never fed to the decoder.
LENGTH_BUCKET = 8


def check_search_args(beam_size, length_penalty, max_extra_length):
    """Raises `ValueError` naming the argument unless all three are valid."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
        raise ValueError(f"beam_size={beam_size!r} must be an integer >= 1 (1 is greedy search)")
    if (
        isinstance(length_penalty, bool)
        or not isinstance(length_penalty, (int, float, np.integer, np.floating))
        or not math.isfinite(length_penalty)
        or length_penalty < 0
    ):
        raise ValueError(f"length_penalty={length_penalty!r} must be a finite number >= 0 (the paper uses 0.6)")
    if (
        isinstance(max_extra_length, bool)
        or not isinstance(max_extra_length, (int, np.integer))
        or max_extra_length < 0
    ):
        raise ValueError(f"max_extra_length={max_extra_length!r} must be an integer >= 0")


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
