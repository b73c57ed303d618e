"""Tensor helpers shared by the greedy and beam searches: `keras.ops` only.

Shape legend: B batch, K beam size, L output buffer length, V vocabulary size.
"""

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
