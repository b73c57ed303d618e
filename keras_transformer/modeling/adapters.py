"""`TransformerModel`'s LoRA adapters and int8 quantization, as a mixin (`keras_transformer.lora`, `.quantization`)."""


class Adapters:
    """LoRA (`enable_lora`, `merge_lora`, `save_weights` merged) and `quantize` of `TransformerModel`."""

    @property
    def lora_enabled(self):
        """Whether `enable_lora` was called: only the adapters train."""
        return self.lora_rank is not None

    def enable_lora(self, rank, targets=None, lora_alpha=None):
        """Low-rank adapters (LoRA) on the target projections; every other weight is frozen.

        Each target `Dense` computes `x (W + (lora_alpha / rank) A B) + b`
        with Keras' `Dense.enable_lora`: `A [in, rank]` (He-uniform) and
        `B [rank, out]` (zeros, so the outputs are unchanged until trained)
        are the only trainable weights; `W`, the biases, the embedding, the
        positions, the layer norms and the logits bias are frozen. Call it
        before `compile`. `save_to_preset`, `export` and the project's
        exporters write the merged model (`merge_lora`): the same shapes and
        speed as before.

        Args:
            rank: int >= 1, the adapters' rank r.
            targets: None (default: "attention"), or one or more names of
                `lora.LORA_TARGET_NAMES`: "attention" (W^Q, W^K, W^V, W^O of
                every self- and cross-attention), "feedforward" (W_1 and W_2
                of the feed-forward networks), or single projections by layer
                name ("query", "key", "value", "attention_output",
                "feedforward_intermediate_dense", "feedforward_output_dense").
            lora_alpha: optional number, the scale's numerator; default
                `rank` (a scale of 1), as in Keras.

        Example:
        >>> model = TransformerModel.from_preset("tiny")
        >>> model.enable_lora(4)
        >>> sorted({w.name for w in model.trainable_weights})
        ['lora_kernel_a', 'lora_kernel_b']

        Raises:
            ValueError: a rank that is not a positive integer, an unknown
                target, a bad `lora_alpha`, a model that has LoRA already or
                is quantized.

        References:
        - Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
        """
        from keras_transformer import lora

        lora.enable_lora(self, rank, targets=targets, lora_alpha=lora_alpha)

    def save_weights(self, filepath, *args, **kwargs):
        """Keras' `save_weights`; with LoRA, the file holds the merged kernels, in float32 under mixed precision.

        Keras' LoRA `Dense` writes `W + (alpha / r) A B` in place of `W`
        and no adapters (an ordinary model's file), merged in the compute
        dtype; here in the variables' dtype (`lora.kernels_merged_in_float32`).
        """
        from keras_transformer import lora

        with lora.kernels_merged_in_float32(self):
            return super().save_weights(filepath, *args, **kwargs)

    def merge_lora(self):
        """A new `TransformerModel` with each adapter merged into its kernel: `W + (alpha / r) A B`.

        The same config (no LoRA), outputs and tokenizer; this model is
        unchanged. What `save_to_preset` and the exporters write for a LoRA
        model.

        Raises:
            ValueError: the model has no LoRA (`enable_lora`).
        """
        from keras_transformer import lora

        if not self.lora_enabled:
            raise ValueError("merge_lora: this model has no LoRA adapters; call enable_lora(rank) first")
        merged = type(self).from_config(self.get_config())
        merged.set_weights(lora.merged_weights(self))
        merged.tokenizer = self.tokenizer
        return merged

    @property
    def quantization(self):
        """None for a float model, or the mode of `quantize` ("int8"), as a preset's config.json records it."""
        from keras_transformer.quantization import quantization_of

        return quantization_of(self)

    def quantize(self, mode=None, config=None, **kwargs):
        """Keras' int8 quantization, in place: the projections and the shared embedding get int8 weights.

        Keras' `Model.quantize` on every `Dense` (W^Q, W^K, W^V, W^O, W_1,
        W_2: an int8 kernel, one scale per output column) and on the shared
        embedding matrix (int8 `[V, D]`, one scale per token), whose tie with
        the pre-softmax projection is kept (`keras_transformer.quantization`
        says why); inputs are quantized per row at run time. The layer norms,
        biases, positions and the logits bias stay float32; one log line says
        what was quantized and what was not (a warning when a layer of weight
        matrices was left float32). `generate`, `Translator` and
        `save_to_preset` take the quantized model on every backend; the
        exporters refuse it (they quantize float32 weights themselves).

        Args:
            mode: "int8" (the one mode supported here).
            config: optional `keras.quantizers.QuantizationConfig`.

        Example:
        >>> model = TransformerModel.from_preset("tiny")
        >>> model.quantize("int8")
        >>> model.quantization, model.token_embedding.embeddings.dtype
        ('int8', 'int8')

        Raises:
            ValueError: another mode, a model with LoRA adapters (quantize
                `merge_lora()`'s model), or one already quantized.
        """
        from keras_transformer import quantization

        if kwargs:
            raise ValueError(f"quantize: unknown argument(s) {sorted(kwargs)}; it takes mode and config")
        quantization.quantize(self, mode, config=config)
