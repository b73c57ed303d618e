"""`TransformerModel`'s attention weights for plots and word alignments, as a mixin."""

import numpy as np
from keras import ops

from keras_transformer.checks import check_batch_sizes, check_token_ids


class AttentionWeights:
    """`attention_scores` (every layer's and head's weights) and `alignment_attention` of `TransformerModel`."""

    def attention_scores(self, encoder_token_ids, decoder_token_ids):
        """Every layer's and head's attention weights, for plots like the paper's Figures 3-5.

        Runs the model once (inference mode) with unfused attention so that
        the softmax weights are available. Rows of padding queries are
        meaningless; padding keys get (close to) zero weight.

        Args:
            encoder_token_ids: int `[B, S]` source ids.
            decoder_token_ids: int `[B, T]` target ids starting with the start id.

        Returns:
            dict of lists of NumPy float arrays, one per layer:
            `"encoder_self_attention"` `[B, N, S, S]`,
            `"decoder_self_attention"` `[B, N, T, T]` and
            `"cross_attention"` `[B, N, T, S]` (query axis first, then key).

        Example:
        >>> model = TransformerModel.from_preset("tiny")
        >>> scores = model.attention_scores(np.array([[5, 6, 3]]), np.array([[2, 7]]))
        >>> scores["cross_attention"][0].shape
        (1, 4, 2, 3)
        """
        encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", self.encoder_vocabulary_size)
        decoder_token_ids = check_token_ids(decoder_token_ids, "decoder_token_ids", self.vocabulary_size)
        check_batch_sizes(encoder_token_ids=encoder_token_ids, decoder_token_ids=decoder_token_ids)
        encoder_padding_mask = ops.not_equal(encoder_token_ids, self.pad_id)  # [B, S]
        decoder_padding_mask = ops.not_equal(decoder_token_ids, self.pad_id)  # [B, T]
        scores = {"encoder_self_attention": [], "decoder_self_attention": [], "cross_attention": []}
        x = self._embed(encoder_token_ids, self.encoder_position, self.encoder_embedding_dropout, training=False,
                        embedding=self.source_token_embedding)
        for layer in self.encoder_layers:
            x, weights = layer.call_with_scores(x, padding_mask=encoder_padding_mask, training=False)
            scores["encoder_self_attention"].append(weights)  # [B, N, S, S]
        if self.normalize_first:
            x = self.encoder_final_norm(x)
        y = self._embed(decoder_token_ids, self.decoder_position, self.decoder_embedding_dropout, training=False)
        for layer in self.decoder_layers:
            y, self_weights, cross_weights = layer.call_with_scores(
                y,
                x,
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                training=False,
            )
            scores["decoder_self_attention"].append(self_weights)  # [B, N, T, T]
            scores["cross_attention"].append(cross_weights)  # [B, N, T, S]
        return {
            name: [np.asarray(ops.convert_to_numpy(w)).astype("float32") for w in weights]
            for name, weights in scores.items()
        }

    def alignment_attention(self, encoder_token_ids, decoder_token_ids):
        """The cross-attention that aligns (`keras_transformer.documents.alignment`), teacher forced: float32 `[B, T, S]`.

        Row t of a batch row is the weights with which decoder position t
        (the start id at 0) attended to the source, in layer
        `alignment.ALIGNMENT_LAYER`, averaged over its heads: the weights
        the search used to choose target token t + 1. Optional in the
        decoding protocol (`Translator.translate_hypotheses(return_alignment=True)`).
        """
        from keras_transformer.documents.alignment import ALIGNMENT_LAYER, mean_heads

        scores = self.attention_scores(encoder_token_ids, decoder_token_ids)
        return mean_heads(scores["cross_attention"][ALIGNMENT_LAYER])
