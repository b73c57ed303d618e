"""One encoder layer of the Transformer (paper section 3.1)."""

import keras

from keras_transformer.layers.attention import MultiHeadAttention, check_attention_window, clone_initializer
from keras_transformer.utils import is_real


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)  # JSON `true` is not a size.


def check_layer_args(intermediate_dim, num_heads, dropout, key_dim, value_dim, attention_window):
    if not _is_int(intermediate_dim) or intermediate_dim < 1:
        raise ValueError(f"intermediate_dim={intermediate_dim!r} must be a positive integer")
    if not _is_int(num_heads) or num_heads < 1:
        raise ValueError(f"num_heads={num_heads!r} must be a positive integer")
    if not is_real(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must be a number in [0, 1)")
    for name, value in (("key_dim", key_dim), ("value_dim", value_dim)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer or None")
    check_attention_window(attention_window)


def head_dims(hidden_dim, num_heads, key_dim, value_dim):
    """Per-head (d_k, d_v); each defaults to hidden_dim // num_heads, independently of the other."""
    if (key_dim is None or value_dim is None) and hidden_dim % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide hidden_dim={hidden_dim} "
            "(or pass key_dim and value_dim explicitly)"
        )
    default = hidden_dim // num_heads
    return (key_dim or default), (value_dim or default)


class _SublayerMixin:
    """Shared pieces of the encoder and decoder layers."""

    def _init_common(
        self,
        intermediate_dim,
        num_heads,
        dropout,
        attention_dropout,
        activation,
        layer_norm_epsilon,
        key_dim,
        value_dim,
        normalize_first,
        attention_window,
        use_fused_attention,
        kernel_initializer,
        bias_initializer,
    ):
        check_layer_args(intermediate_dim, num_heads, dropout, key_dim, value_dim, attention_window)
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation = keras.activations.get(activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.normalize_first = normalize_first
        self.attention_window = attention_window
        self.use_fused_attention = use_fused_attention
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _attention(self, hidden_dim, name, attention_window=None):
        key_dim, value_dim = head_dims(hidden_dim, self.num_heads, self.key_dim, self.value_dim)
        return MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            dropout=self.attention_dropout,
            attention_window=attention_window,
            use_fused_attention=self.use_fused_attention,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )

    def _norm(self, name):
        return keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )

    def _dropout(self, name):
        return keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name=name)

    def _build_feedforward(self, sequence_shape):
        hidden_dim = sequence_shape[-1]
        # FFN(x) = max(0, x W1 + b1) W2 + b2 (paper equation 2).
        self.feedforward_intermediate = keras.layers.Dense(
            self.intermediate_dim,
            activation=self.activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_intermediate_dense",
        )
        self.feedforward_intermediate.build(sequence_shape)
        self.feedforward_output = keras.layers.Dense(
            hidden_dim,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_output_dense",
        )
        self.feedforward_output.build(tuple(sequence_shape[:-1]) + (self.intermediate_dim,))
        self.feedforward_norm = self._norm("feedforward_layer_norm")
        self.feedforward_norm.build(sequence_shape)
        self.feedforward_dropout = self._dropout("feedforward_dropout")

    def _residual(self, x, sublayer, norm, dropout, training):
        """Post-LN: LayerNorm(x + Dropout(Sublayer(x))) (paper section 5.4).

        Pre-LN (`normalize_first=True`, not the paper): x + Dropout(Sublayer(LayerNorm(x))).
        `sublayer` returns the sub-layer output and any extra results.
        """
        y = norm(x) if self.normalize_first else x
        out = sublayer(y)
        out, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        x = x + dropout(out, training=training)
        if not self.normalize_first:
            x = norm(x)
        return (x,) + tuple(extra)

    def _common_config(self):
        return {
            "intermediate_dim": self.intermediate_dim,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "activation": keras.activations.serialize(self.activation),
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "normalize_first": self.normalize_first,
            "attention_window": self.attention_window,
            "use_fused_attention": self.use_fused_attention,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerEncoderLayer(_SublayerMixin, keras.layers.Layer):
    """Self-attention and a position-wise feed-forward network.

    With the paper's post-layer-normalisation (the default):

        x = LayerNorm(x + Dropout(SelfAttention(x)))
        x = LayerNorm(x + Dropout(FFN(x)))

    `normalize_first=True` gives the pre-LN variant (not in the paper; the
    model then adds a final LayerNorm after the stack).

    Args:
        intermediate_dim: int, d_ff.
        num_heads: int, h.
        dropout: float, P_drop on each sub-layer output.
        attention_dropout: float, dropout on attention weights (0 in the paper).
        activation: FFN activation, "relu" in the paper.
        layer_norm_epsilon: float.
        key_dim, value_dim: per-head d_k and d_v; each defaults to
            hidden_dim // num_heads, independently of the other.
        normalize_first: bool, pre-LN instead of the paper's post-LN.
        attention_window: optional odd int r, restricted self-attention
            (Table 1): each position sees the r positions centered on it,
            |i - j| <= (r - 1) / 2 (see `MultiHeadAttention`).
        use_fused_attention: bool, see `MultiHeadAttention`.
        kernel_initializer, bias_initializer: for all dense layers.

    Call args:
        inputs: `[B, S, D]`.
        padding_mask: optional `[B, S]`, True for real tokens.
        return_attention_scores: also return the weights `[B, N, S, S]`.

    Example:
    >>> layer = TransformerEncoderLayer(intermediate_dim=2048, num_heads=8)
    >>> layer(keras.random.normal((2, 10, 512))).shape
    (2, 10, 512)
    """

    def __init__(
        self,
        intermediate_dim,
        num_heads,
        dropout=0.1,
        attention_dropout=0.0,
        activation="relu",
        layer_norm_epsilon=1e-5,
        key_dim=None,
        value_dim=None,
        normalize_first=False,
        attention_window=None,
        use_fused_attention=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._init_common(
            intermediate_dim, num_heads, dropout, attention_dropout, activation,
            layer_norm_epsilon, key_dim, value_dim, normalize_first, attention_window,
            use_fused_attention, kernel_initializer, bias_initializer,
        )

    def build(self, inputs_shape):
        self.self_attention = self._attention(inputs_shape[-1], "self_attention", self.attention_window)
        self.self_attention.build(inputs_shape, inputs_shape)
        self.self_attention_norm = self._norm("self_attention_layer_norm")
        self.self_attention_norm.build(inputs_shape)
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self._build_feedforward(inputs_shape)

    def call(self, inputs, padding_mask=None, return_attention_scores=False, training=None):
        # The attention layer builds the padding and window masks itself (a
        # restricted window is then computed blockwise, see `local_attention`).
        x, *scores = self._residual(
            inputs,
            lambda y: self.self_attention(
                y, y, padding_mask=padding_mask,
                return_attention_scores=return_attention_scores, training=training,
            ),
            self.self_attention_norm,
            self.self_attention_dropout,
            training,
        )
        (x,) = self._residual(
            x,
            lambda y: self.feedforward_output(self.feedforward_intermediate(y)),
            self.feedforward_norm,
            self.feedforward_dropout,
            training,
        )
        return (x, scores[0]) if return_attention_scores else x

    def get_config(self):
        config = super().get_config()
        config.update(self._common_config())
        return config
