"""One encoder layer of the Transformer (paper section 3.1)."""

import keras

from keras_transformer.layers.base import TransformerLayerBase


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerEncoderLayer(TransformerLayerBase):
    """Self-attention and a position-wise feed-forward network.

    With the paper's post-layer-normalisation (the default; see
    `residual_connection`):

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

    Call args (`call`, and `call_with_scores`, which also returns the
    self-attention weights `[B, N, S, S]`):
        inputs: `[B, S, D]`.
        padding_mask: optional `[B, S]`, True for real tokens.
        training: bool.

    Example:
    >>> layer = TransformerEncoderLayer(intermediate_dim=2048, num_heads=8)
    >>> layer(keras.random.normal((2, 10, 512))).shape
    (2, 10, 512)
    """

    def build(self, inputs_shape):
        self._build_attention("self_attention", inputs_shape, inputs_shape, self.attention_window)
        self._build_feedforward(inputs_shape)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)  # [B, S, D] -> [B, S, D]

    def _forward(self, x, self_attend, training):
        x = self._sublayer("self_attention", x, self_attend, training)
        return self._feedforward(x, training)

    def call(self, inputs, padding_mask=None, training=None):
        """`[B, S, D]` -> `[B, S, D]`."""
        # The attention layer masks padding and the window itself (a
        # restricted window is then computed blockwise, see `local_attention`).
        return self._forward(
            inputs, lambda y: self.self_attention(y, padding_mask=padding_mask, training=training), training
        )

    def call_with_scores(self, inputs, padding_mask=None, training=None):
        """`(outputs [B, S, D], self-attention weights [B, N, S, S])`."""
        if not self.built:
            self.build(inputs.shape)
        scores = {}

        def self_attend(y):
            outputs, scores["self"] = self.self_attention.call_with_scores(
                y, padding_mask=padding_mask, training=training
            )
            return outputs

        return self._forward(inputs, self_attend, training), scores["self"]
