"""Position information added to the token embeddings (paper section 3.5)."""

import math

import keras
from keras import ops


SINUSOID_LAYOUTS = ("interleaved", "halves", "fairseq")
# fairseq counts positions from padding_idx + 1, and its (and NLLB's, M2M-100's) padding_idx is 1.
FAIRSEQ_FIRST_POSITION = 2


def sinusoidal_table(positions, hidden_dim, dtype="float32", layout="interleaved"):
    """The paper's sinusoids for the given positions.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

    `layout="interleaved"` (the default) puts the sine on even and the cosine
    on odd dimensions, exactly as the paper writes it. `layout="halves"` puts
    the same sines in the first d_model / 2 dimensions and the cosines in the
    second half, the layout of Marian / OPUS-MT checkpoints (and of
    tensor2tensor and CTranslate2's built-in table): the same function up to a
    permutation of dimensions, but weights trained with one layout do not
    transfer to the other, so an imported checkpoint needs its own.

    `layout="fairseq"` is fairseq's table (NLLB-200 and M2M-100 checkpoints),
    which differs from the paper's in three ways: sin | cos halves, the
    frequencies 10000^(-i / (d_model/2 - 1)) (the paper: 10000^(-i / (d_model/2))),
    and positions counted from `FAIRSEQ_FIRST_POSITION` (fairseq's
    padding_idx + 1), so position 0 here is row 2 of fairseq's table.

    Args:
        positions: `[T]` positions (int or float tensor), counted from 0.
        hidden_dim: even int, d_model.
        dtype: dtype of the result.
        layout: "interleaved" (paper), "halves" (sin | cos) or "fairseq".

    Returns:
        `[T, hidden_dim]` table.
    """
    if layout not in SINUSOID_LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {SINUSOID_LAYOUTS}")
    positions = ops.cast(positions, "float32")
    if layout == "fairseq":
        # 1 / 10000^(i / (d/2 - 1)) for i = 0 .. d/2 - 1, at positions 2, 3, ...
        positions = positions + FAIRSEQ_FIRST_POSITION
        inverse_frequency = ops.exp(
            ops.arange(0, hidden_dim // 2, dtype="float32") * (-math.log(10000.0) / (hidden_dim // 2 - 1))
        )
    else:
        # 1 / 10000^(2i / d) for i = 0 .. d/2 - 1
        inverse_frequency = ops.exp(
            ops.arange(0, hidden_dim, 2, dtype="float32") * (-math.log(10000.0) / hidden_dim)
        )
    angles = ops.expand_dims(positions, 1) * ops.expand_dims(inverse_frequency, 0)  # [T, D/2]
    if layout in ("halves", "fairseq"):
        # [T, D/2] + [T, D/2] -> [T, D]: sines on dimensions i, cosines on D/2 + i.
        return ops.cast(ops.concatenate([ops.sin(angles), ops.cos(angles)], axis=-1), dtype)
    # [T, D/2, 2] -> [T, D]: (sin, cos) pairs land on dimensions (2i, 2i+1).
    table = ops.reshape(ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1), (-1, hidden_dim))
    return ops.cast(table, dtype)


def _check_length(layer, inputs, start_index):
    length = inputs.shape[1]
    if (
        layer.max_sequence_length is not None
        and isinstance(length, int)
        and isinstance(start_index, int)
        and start_index + length > layer.max_sequence_length
    ):
        raise ValueError(
            f"Sequence of length {start_index + length} is longer than "
            f"max_sequence_length={layer.max_sequence_length}. Build the model "
            "with a larger max_sequence_length or use shorter inputs."
        )


@keras.saving.register_keras_serializable(package="keras_transformer")
class SinusoidalPositionEncoding(keras.layers.Layer):
    """Fixed sinusoidal position encoding (paper section 3.5).

    Returns the encoding for the positions of `inputs` `[B, T, D]`, shaped
    like `inputs`; the caller adds it to the scaled embeddings.

    Args:
        max_sequence_length: optional int. The sinusoids are defined for any
            length; when set, longer inputs raise a ValueError (so that a
            sinusoidal and a learned model accept the same inputs).
        layout: "interleaved" (the paper, default), "halves" (sines, then
            cosines; imported Marian checkpoints) or "fairseq" (NLLB-200 and
            M2M-100 checkpoints), see `sinusoidal_table`.

    Example:
    >>> x = keras.ops.zeros((2, 10, 512))
    >>> SinusoidalPositionEncoding(1024)(x).shape
    (2, 10, 512)
    """

    def __init__(self, max_sequence_length=None, layout="interleaved", **kwargs):
        super().__init__(**kwargs)
        if layout not in SINUSOID_LAYOUTS:
            raise ValueError(f"layout={layout!r} must be one of {SINUSOID_LAYOUTS}")
        self.max_sequence_length = max_sequence_length
        self.layout = layout

    def build(self, inputs_shape):
        if inputs_shape[-1] is not None and inputs_shape[-1] % 2:
            raise ValueError(
                f"SinusoidalPositionEncoding needs an even hidden size, received {inputs_shape[-1]}"
            )

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)  # the positions' values for [B, T, D] inputs

    def call(self, inputs, start_index=0):
        _check_length(self, inputs, start_index)
        shape = ops.shape(inputs)
        positions = ops.arange(shape[1], dtype="int32") + ops.cast(start_index, "int32")
        table = sinusoidal_table(positions, shape[-1], self.compute_dtype, layout=self.layout)
        return ops.broadcast_to(ops.expand_dims(table, 0), shape)

    def get_config(self):
        config = super().get_config()
        config["max_sequence_length"] = self.max_sequence_length
        config["layout"] = self.layout
        return config


@keras.saving.register_keras_serializable(package="keras_transformer")
class LearnedPositionEmbedding(keras.layers.Layer):
    """Learned absolute position embeddings (paper's Table 3, row E).

    Args:
        max_sequence_length: int, number of positions.
        initializer: for the `[max_sequence_length, D]` table.

    Example:
    >>> x = keras.ops.zeros((2, 10, 512))
    >>> LearnedPositionEmbedding(1024)(x).shape
    (2, 10, 512)
    """

    def __init__(self, max_sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(
                f"max_sequence_length={max_sequence_length!r} must be a positive integer"
            )
        self.max_sequence_length = max_sequence_length
        self.initializer = keras.initializers.get(initializer)

    def build(self, inputs_shape):
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.max_sequence_length, inputs_shape[-1]),
            initializer=self.initializer,
            trainable=True,
        )

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)  # the positions' values for [B, T, D] inputs

    def call(self, inputs, start_index=0):
        _check_length(self, inputs, start_index)
        shape = ops.shape(inputs)
        table = ops.slice(
            ops.convert_to_tensor(self.position_embeddings),
            (ops.cast(start_index, "int32"), 0),
            (shape[1], shape[-1]),
        )
        return ops.broadcast_to(ops.expand_dims(ops.cast(table, self.compute_dtype), 0), shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_sequence_length": self.max_sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
