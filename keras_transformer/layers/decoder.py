"""One decoder layer of the Transformer (paper section 3.1)."""

import keras
from keras import ops

from keras_transformer.layers.attention import attention_masks
from keras_transformer.layers.encoder import _SublayerMixin


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerDecoderLayer(_SublayerMixin, keras.layers.Layer):
    """Causal self-attention, cross-attention over the encoder, and an FFN.

    With the paper's post-layer-normalisation (the default):

        x = LayerNorm(x + Dropout(MaskedSelfAttention(x)))
        x = LayerNorm(x + Dropout(CrossAttention(x, encoder_outputs)))
        x = LayerNorm(x + Dropout(FFN(x)))

    `normalize_first=True` gives the pre-LN variant (not in the paper).

    Args: as `TransformerEncoderLayer`; `attention_window` (odd r) restricts
    the self-attention only (cross-attention always sees the whole source):
    being causal too, position i sees the (r + 1) / 2 positions
    i - (r - 1) / 2, ..., i, the past half of the paper's centered window,
    in training and in cached decoding alike.

    Call args:
        decoder_sequence: `[B, T, D]`.
        encoder_sequence: `[B, S, D]`; may be None when `cross_attention_cache`
            is given.
        decoder_padding_mask: optional `[B, T]`, True for real tokens.
        encoder_padding_mask: optional `[B, S]`, True for real tokens.
        self_attention_cache: optional `(keys [B, N, T_max, K], values
            [B, N, T_max, V])` (heads first) for incremental decoding; then
            `self_attention_cache_update_index` is the position of the first
            token of `decoder_sequence` and the updated cache is returned.
        self_attention_cache_update_index: int or scalar tensor.
        cross_attention_cache: optional `(keys [B, N, S, K], values [B, N, S, V])`
            computed once per source by `compute_cross_attention_cache`.
        return_attention_scores: also return the self- and cross-attention
            weights `[B, N, T, T]` and `[B, N, T, S]`.

    Returns:
        `[B, T, D]`; with a self-attention cache, `(outputs, cache)`; with
        `return_attention_scores`, the two weight tensors follow the outputs.

    Example:
    >>> layer = TransformerDecoderLayer(intermediate_dim=2048, num_heads=8)
    >>> x, enc = keras.random.normal((2, 7, 512)), keras.random.normal((2, 10, 512))
    >>> layer(x, enc).shape
    (2, 7, 512)
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

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        encoder_sequence_shape = encoder_sequence_shape or decoder_sequence_shape
        hidden_dim = decoder_sequence_shape[-1]
        self.self_attention = self._attention(hidden_dim, "self_attention", self.attention_window)
        self.self_attention.build(decoder_sequence_shape, decoder_sequence_shape)
        self.self_attention_norm = self._norm("self_attention_layer_norm")
        self.self_attention_norm.build(decoder_sequence_shape)
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.cross_attention = self._attention(hidden_dim, "cross_attention")
        self.cross_attention.build(decoder_sequence_shape, encoder_sequence_shape)
        self.cross_attention_norm = self._norm("cross_attention_layer_norm")
        self.cross_attention_norm.build(decoder_sequence_shape)
        self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feedforward(decoder_sequence_shape)

    def compute_cross_attention_cache(self, encoder_sequence):
        """Cross-attention keys/values `([B, N, S, K], [B, N, S, V])`, once per source."""
        return self.cross_attention.compute_cache(encoder_sequence)

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        return_attention_scores=False,
        training=None,
    ):
        query_length = ops.shape(decoder_sequence)[1]
        if self_attention_cache is not None:
            # Keys are the fixed-size cache; queries start at the update index.
            key_length = ops.shape(self_attention_cache[0])[2]
            query_offset = self_attention_cache_update_index
        else:
            key_length, query_offset = query_length, 0
        self_mask = None
        if self_attention_cache is not None or return_attention_scores or self.attention_window is None:
            self_mask = attention_masks(
                query_length,
                key_length,
                key_padding_mask=decoder_padding_mask,
                causal=True,
                attention_window=self.attention_window,
                query_offset=query_offset,
            )
        # else: training with a restricted window; the attention layer masks
        # itself and computes the window blockwise (see `local_attention`).
        cross_mask = None
        if encoder_padding_mask is not None:
            source_length = ops.shape(encoder_padding_mask)[1]
            cross_mask = attention_masks(query_length, source_length, key_padding_mask=encoder_padding_mask)

        x, *self_extra = self._residual(
            decoder_sequence,
            lambda y: self.self_attention(
                y, y,
                attention_mask=self_mask,
                padding_mask=None if self_mask is not None else decoder_padding_mask,
                use_causal_mask=self_mask is None,
                cache=self_attention_cache,
                cache_update_index=self_attention_cache_update_index,
                return_attention_scores=return_attention_scores,
                training=training,
            ),
            self.self_attention_norm,
            self.self_attention_dropout,
            training,
        )
        x, *cross_extra = self._residual(
            x,
            lambda y: self.cross_attention(
                y, encoder_sequence,
                attention_mask=cross_mask,
                cache=cross_attention_cache,
                return_attention_scores=return_attention_scores,
                training=training,
            ),
            self.cross_attention_norm,
            self.cross_attention_dropout,
            training,
        )
        (x,) = self._residual(
            x,
            lambda y: self.feedforward_output(self.feedforward_intermediate(y)),
            self.feedforward_norm,
            self.feedforward_dropout,
            training,
        )

        results = (x,)
        if return_attention_scores:
            results += (self_extra[0], cross_extra[0])
        if self_attention_cache is not None:
            results += (self_extra[-1],)
        return results[0] if len(results) == 1 else results

    def get_config(self):
        config = super().get_config()
        config.update(self._common_config())
        return config
