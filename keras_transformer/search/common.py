"""Tensor helpers shared by the greedy and beam searches: `keras.ops` only.

Shape legend: B batch, K beam size, L output buffer length, V vocabulary size.
"""

import functools
from typing import NamedTuple

from keras import ops

NEG_INF = float("-inf")


class Field(NamedTuple):
    """One entry of a search state: its key, dtype and named axes.

    `constant`: an option the search only reads (set by `init`, never by
    `update`); a step-by-step driver feeds it and gets it back unchanged.
    """

    name: str
    dtype: str
    axes: tuple
    constant: bool = False


def state_keys(spec):
    """The keys of a state declared by `spec` (a tuple of `Field`), in order."""
    return tuple(field.name for field in spec)


class ModelConstants:
    """The ids and vocabulary size of a model: all that a search update reads."""

    def __init__(self, model):
        self.vocabulary_size = int(model.vocabulary_size)
        self.pad_id, self.start_id, self.end_id = int(model.pad_id), int(model.start_id), int(model.end_id)

    def key(self):
        return (self.vocabulary_size, self.pad_id, self.start_id, self.end_id)


def dim(x, axis):
    """`x.shape[axis]`, or a scalar tensor where it is unknown (a TensorFlow graph traced for any batch)."""
    size = x.shape[axis]
    return ops.shape(x)[axis] if size is None else size


def write_position(sequences, position, tokens):
    """`sequences[..., position] = tokens` for `[..., L]` ids and `[...]` tokens."""
    length = dim(sequences, -1)
    here = ops.equal(ops.arange(length, dtype="int32"), position)  # [L]
    return ops.where(here, ops.expand_dims(tokens, -1), sequences)


def read_position(sequences, position):
    """`sequences[..., position]` for a Python int or scalar tensor position."""
    return ops.take(sequences, position, axis=-1)


def constant_field(options, name, default, dtype):
    """`options[name]` (or `default`) as a `dtype` tensor: a search option carried in the state."""
    value = options.get(name, default) if options else default
    return ops.cast(ops.convert_to_tensor(value), dtype)


def target_prefix(options, batch):
    """The state's `target_prefix`: int32 `[B, P]` ids the output must start with, pad-filled.

    `options["target_prefix"]`, or one pad column (no prefix) when absent:
    P >= 1, so reading a prefix column never reads outside the tensor.
    """
    prefix = options.get("target_prefix") if options else None
    if prefix is None:
        return ops.zeros((batch, 1), "int32")
    return ops.cast(prefix, "int32")


def start_sequences(model, shape):
    """Int32 zeros of `shape` (`[..., L]`) with the start id at position 0."""
    length = shape[-1]
    row = ops.where(ops.equal(ops.arange(length, dtype="int32"), 0), model.start_id, model.pad_id)
    return ops.broadcast_to(ops.cast(row, "int32"), shape)


def top_k(x, k, unit=None):
    """`ops.top_k(x, k)` of a `[B, N]` tensor, in two stages when N is long: the same values and indices.

    ONNX Runtime's `TopK` reads every element through a heap (about 2.7 ns
    per element on one thread of the benchmark CPU, the largest op of a beam
    update over `[B, K * V]`). Cut into chunks of `c` elements, the k best
    lie in the k chunks of largest maximum, so a `max` over each chunk (one
    vectorized pass), a top-k of the chunk maxima and a top-k of the k
    chosen chunks give the same answer (at batch 16 x beam 4, vocabulary
    8000: 0.11-0.15 ms instead of 1.33 ms). Ties go to the lower index as
    in one `top_k`: the chosen chunks are put in index order before the
    second top-k, and of chunks whose maxima tie the lower is chosen (if an
    element of the k best sat in a chunk left out, the k chunks chosen
    before it would each hold an element that ranks before it).

    Args:
        x: `[B, N]`.
        k: `1 <= k <= N`, a Python int, or a scalar tensor with `unit`
            (k = 2K <= 2N / unit then).
        unit: a static size that N is a multiple of, where N is unknown
            when traced (a beam search's `K * V` with K a graph input: V);
            the chunk then divides it, and N is taken as `unit * k / 2`
            (K = k / 2) to choose it.

    Returns:
        `(values [B, k], indices [B, k] int32)`, best first.
    """
    length = x.shape[-1]
    # k is a tensor where the beam size is a graph input: the chunk is chosen for the paper's beam 4.
    k_known = k if isinstance(k, int) else 8
    if length is not None:
        chunk = _chunk_size(length, k_known)
    else:
        chunk = _chunk_size(unit, k_known, max(k_known // 2, 1)) if unit else None
    if chunk is None:
        values, indices = ops.top_k(x, k)
        return values, ops.cast(indices, "int32")
    batch = dim(x, 0)
    rows = ops.reshape(x, (-1, chunk))  # chunk j of row b is row b * count + j
    count = dim(rows, 0) // batch if length is None else length // chunk
    _, best = ops.top_k(ops.reshape(ops.max(rows, axis=-1), (batch, -1)), k)  # [B, k]
    best = ops.cast(best, "int32")
    if k_known != 1:  # one chunk needs no order
        # Index order: ties go to the lower index. The chunk numbers are
        # distinct and >= 0, so a top-k of their negatives sorts them (in
        # ONNX 3 nodes; `ops.sort` converts to a dozen).
        best = -ops.top_k(-best, k)[0]
    # Indices `[B, k]` take `[B, k, ...]` at once: no reshape of a dynamic shape (a chain of shape nodes in ONNX).
    picked = ops.take(rows, best + row_offsets(batch, count), axis=0)  # [B, k, c]
    values, positions = ops.top_k(ops.reshape(picked, (batch, -1)), k)  # [B, k]
    positions = ops.cast(positions, "int32")
    chosen = ops.take(ops.reshape(best, (-1,)), positions // chunk + row_offsets(batch, k), axis=0)  # [B, k]
    return values, chosen * chunk + positions % chunk  # chunk * c + place in it


def row_offsets(batch, width):
    """`[B, 1]` int32: `b * width`, the flat index of row b's first element in a `[B, width]` layout."""
    return ops.expand_dims(ops.arange(batch, dtype="int32") * ops.cast(width, "int32"), 1)


@functools.lru_cache(maxsize=None)  # eager backends call it every step; the search is in N / 2
def _chunk_size(length, k, repeats=1):
    """The chunk of `top_k` for N = `length * repeats`: a divisor c of `length` minimizing N / c + k * c.

    None (one top-k) when the two stages would not read at least 4x fewer
    elements than one top-k of N (short rows, or a length with no divisor
    near `sqrt(N / k)`).
    """
    total = length * repeats
    # c <= length / 2: a row of N = K * length holds at least 2K >= k chunks, whatever K is.
    sizes = (c for c in range(2, length // 2 + 1) if length % c == 0 and total // c >= k)
    best = min(sizes, key=lambda c: total // c + k * c, default=None)
    if best is None or 4 * (total // best + k * best) > total:
        return None
    return best
