"""One decoder layer of the Transformer (paper section 3.1)."""

import keras

from keras_transformer.layers.base import TransformerLayerBase


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerDecoderLayer(TransformerLayerBase):
    """Causal self-attention, cross-attention over the encoder, and an FFN.

    With the paper's post-layer-normalisation (the default; see
    `residual_connection`):

        x = LayerNorm(x + Dropout(MaskedSelfAttention(x)))
        x = LayerNorm(x + Dropout(CrossAttention(x, encoder_outputs)))
        x = LayerNorm(x + Dropout(FFN(x)))

    `normalize_first=True` gives the pre-LN variant (not in the paper).

    Args: as `TransformerEncoderLayer`; `attention_window` (odd r) restricts
    the self-attention only (cross-attention always sees the whole source):
    being causal too, position i sees the (r + 1) / 2 positions
    i - (r - 1) / 2, ..., i, the past half of the paper's centered window,
    in training and in cached decoding alike.

    Three methods, each with a fixed result (as the attention layer):
    - `call(decoder_sequence, encoder_sequence, decoder_padding_mask=None,
      encoder_padding_mask=None)` -> `[B, T, D]` (training, full decoding);
    - `call_with_scores(...)`, the same arguments -> `(outputs, self-attention
      weights [B, N, T, T], cross-attention weights [B, N, T, S])`;
    - `call_cached(decoder_sequence, self_attention_cache,
      self_attention_cache_update_index, cross_attention_cache,
      encoder_padding_mask=None)` -> `(outputs, self_attention_cache)`:
      incremental decoding with the self-attention cache `(keys [B, N,
      T_max, K], values [B, N, T_max, V])` (heads first), written at the
      index (the position of the first token of `decoder_sequence`), and
      the cross-attention cache `(keys [B, N, S, K], values [B, N, S, V])`
      from `compute_cross_attention_cache`.

    Call args:
        decoder_sequence: `[B, T, D]`.
        encoder_sequence: `[B, S, D]`.
        decoder_padding_mask: optional `[B, T]`, True for real tokens.
        encoder_padding_mask: optional `[B, S]`, True for real tokens.
        training: bool.

    Example:
    >>> layer = TransformerDecoderLayer(intermediate_dim=2048, num_heads=8)
    >>> x, enc = keras.random.normal((2, 7, 512)), keras.random.normal((2, 10, 512))
    >>> layer(x, enc).shape
    (2, 7, 512)
    """

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        encoder_sequence_shape = encoder_sequence_shape or decoder_sequence_shape
        self._build_attention(
            "self_attention", decoder_sequence_shape, decoder_sequence_shape, self.attention_window
        )
        self._build_attention("cross_attention", decoder_sequence_shape, encoder_sequence_shape)
        self._build_feedforward(decoder_sequence_shape)

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)  # [B, T, D] -> [B, T, D]

    def compute_cross_attention_cache(self, encoder_sequence):
        """Cross-attention keys/values `([B, N, S, K], [B, N, S, V])`, once per source."""
        return self.cross_attention.compute_cache(encoder_sequence)

    def _forward(self, x, self_attend, cross_attend, training):
        x = self._sublayer("self_attention", x, self_attend, training)
        x = self._sublayer("cross_attention", x, cross_attend, training)
        return self._feedforward(x, training)

    def call(
        self, decoder_sequence, encoder_sequence, decoder_padding_mask=None, encoder_padding_mask=None, training=None
    ):
        # The attention layers build their masks (and choose the blockwise
        # path for a restricted window, see `local_attention`).
        return self._forward(
            decoder_sequence,
            lambda y: self.self_attention(
                y, padding_mask=decoder_padding_mask, use_causal_mask=True, training=training
            ),
            lambda y: self.cross_attention(
                y, encoder_sequence, padding_mask=encoder_padding_mask, training=training
            ),
            training,
        )

    def call_with_scores(
        self, decoder_sequence, encoder_sequence, decoder_padding_mask=None, encoder_padding_mask=None, training=None
    ):
        if not self.built:
            self.build(decoder_sequence.shape, encoder_sequence.shape)
        scores = {}

        def self_attend(y):
            outputs, scores["self"] = self.self_attention.call_with_scores(
                y, padding_mask=decoder_padding_mask, use_causal_mask=True, training=training
            )
            return outputs

        def cross_attend(y):
            outputs, scores["cross"] = self.cross_attention.call_with_scores(
                y, encoder_sequence, padding_mask=encoder_padding_mask, training=training
            )
            return outputs

        outputs = self._forward(decoder_sequence, self_attend, cross_attend, training)
        return outputs, scores["self"], scores["cross"]

    def call_cached(
        self,
        decoder_sequence,
        self_attention_cache,
        self_attention_cache_update_index,
        cross_attention_cache,
        encoder_padding_mask=None,
        training=None,
    ):
        caches = {}

        def self_attend(y):
            outputs, caches["self"] = self.self_attention.call_cached(
                y, self_attention_cache, cache_update_index=self_attention_cache_update_index,
                use_causal_mask=True, training=training,
            )
            return outputs

        def cross_attend(y):
            outputs, _ = self.cross_attention.call_cached(
                y, cross_attention_cache, padding_mask=encoder_padding_mask, training=training
            )
            return outputs

        outputs = self._forward(decoder_sequence, self_attend, cross_attend, training)
        return outputs, caches["self"]
