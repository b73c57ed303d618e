"""`TransformerModel`'s incremental decoding: the key/value cache and one cached decoder step.

The decoding protocol's model side (`init_cache`, `grow_cache`, `split_cache`,
`decode_step`, `transposed_output_kernel`), as a mixin of `TransformerModel`.
Shape legend as `model.py`: B batch, S source, T target positions, L decoder
layers, N heads, H (K, Vh) per-head size, V vocabulary, D hidden_dim.
"""

import contextlib
import contextvars

import numpy as np
from keras import ops

from keras_transformer.checks import check_batch_sizes, check_cache_index, check_token_ids

# `(model, E^T)` while `model.transposed_output_kernel()` is entered in this
# thread (or task): a search traced in one thread never hands its traced
# tensor to another thread's call of the same model.
_OUTPUT_KERNEL = contextvars.ContextVar("keras_transformer_output_kernel", default=None)


class CachedDecoding:
    """The cached decoder step of `TransformerModel` (a mixin: it uses the model's layers and `_embed`, `_logits`)."""

    # The cache entries that are functions of the source only: the same for
    # every beam of a row, so beam search never reorders them (decoding protocol).
    beam_invariant_cache_keys = ("cross_key", "cross_value", "encoder_padding_mask")
    # The cache entries with one tensor per decoder layer (stacked on axis 1, or apart: `split_cache`).
    per_layer_cache_keys = ("self_key", "self_value", "cross_key", "cross_value")

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        """The decoding cache for `max_length` target positions.

        Cross-attention keys/values are computed here, once per source;
        self-attention keys/values start as zeros and are filled one position
        per `decode_step`. Every entry has the batch on axis 0, so beam search
        can reorder or tile the whole cache with one gather.

        Returns:
            dict with `self_key [B, L, N, T_max, K]`, `self_value
            [B, L, N, T_max, Vh]`, `cross_key [B, L, N, S, K]`, `cross_value
            [B, L, N, S, Vh]` and `encoder_padding_mask [B, S]` (bool); heads
            before positions (see `layers.MultiHeadAttention`).
        """
        encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", self.encoder_vocabulary_size)
        check_batch_sizes(encoder_token_ids=encoder_token_ids, encoder_outputs=encoder_outputs)
        batch = ops.shape(encoder_outputs)[0]
        layers = len(self.decoder_layers)
        dtype = self.compute_dtype
        cross = [layer.compute_cross_attention_cache(encoder_outputs) for layer in self.decoder_layers]
        return {
            "self_key": ops.zeros((batch, layers, self.num_heads, max_length, self.head_key_dim), dtype),
            "self_value": ops.zeros((batch, layers, self.num_heads, max_length, self.head_value_dim), dtype),
            "cross_key": ops.stack([k for k, _ in cross], axis=1),
            "cross_value": ops.stack([v for _, v in cross], axis=1),
            "encoder_padding_mask": ops.not_equal(encoder_token_ids, self.pad_id),
        }

    def grow_cache(self, cache, max_length):
        """The cache of `init_cache` with room for `max_length` target positions (>= its length).

        The positions written so far stay; the new ones are zeros, as
        `init_cache` makes them. A search driver that starts with a short
        cache grows it with the output (`search/segments.py`). Either form
        of the cache (stacked, or split per layer: `split_cache`).
        """
        split = self._is_split(cache)
        axis = 2 if split else 3  # T in [B, N, T, H] or [B, L, N, T, H]
        length = (cache["self_key"][0] if split else cache["self_key"]).shape[axis]
        if max_length < length:
            raise ValueError(f"max_length={max_length} is shorter than the cache's {length} positions")
        padding = [[0, 0]] * (axis + 2)
        padding[axis] = [0, max_length - length]

        def grow(x):
            return ops.pad(x, padding)

        return dict(
            cache,
            self_key=tuple(map(grow, cache["self_key"])) if split else grow(cache["self_key"]),
            self_value=tuple(map(grow, cache["self_value"])) if split else grow(cache["self_value"]),
        )

    def split_cache(self, cache):
        """The cache with each decoder layer's entries apart: tuples of one `[B, N, T, H]` tensor per layer.

        `decode_step` and `grow_cache` take either form and return the one
        they were given. A compiled search loop carries the
        split form (`search/loop.py`): there each layer reads and writes its
        own keys and values in place, where the stacked `[B, L, N, T, H]`
        entries are sliced per layer at every step, and a slice on axis 1 is
        a copy (XLA on CPU, `small`, batch 64 x beam 4: the slices took about
        as long as the step's matrix products).
        """
        layers = len(self.decoder_layers)
        split = {name: tuple(cache[name][:, i] for i in range(layers)) for name in self.per_layer_cache_keys}
        return dict(cache, **split)

    @contextlib.contextmanager
    def transposed_output_kernel(self):
        """Within: the pre-softmax projection reads a transposed copy of the embedding matrix, made here.

        Optional in the decoding protocol; for a search compiled at a few
        rows (`search/compiled.py`), entered inside the traced function, so
        that the copy is made once, before the search loop, and each
        `decode_step` multiplies by `E^T` `[D, V]` laid out as it is read.
        The product is the same (the shared matrix, section 3.4); its speed
        is not: XLA on CPU multiplies by the `[V, D]` matrix transposed at
        about half the speed at a few rows (`small`, 4 x 256 by 256 x 8000,
        one thread: 0.47 ms against 0.22 ms; the same at 64 rows and more),
        and at batch 1, beam 4 that product was 39% of the search's time
        (benchmarks/README.md). A quantized embedding (`quantize`) keeps
        its own product.
        """
        embedding = self.token_embedding
        if any(x is not None for x in (embedding.quantization_mode, embedding.logit_soft_cap, embedding.reverse_dtype)):
            yield  # the layer's own product
            return
        kernel = ops.cast(ops.transpose(embedding.embeddings), embedding.compute_dtype)
        token = _OUTPUT_KERNEL.set((self, kernel))
        try:
            yield
        finally:
            _OUTPUT_KERNEL.reset(token)

    @staticmethod
    def _is_split(cache):
        """Whether `cache` is split per layer (`split_cache`) rather than stacked."""
        return isinstance(cache["self_key"], (list, tuple))

    def decode_step(self, token_ids, index, cache):
        """One cached decoder step.

        Args:
            token_ids: `[B]` or `[B, 1]`, the target token at position `index`.
            index: int or scalar int tensor, its position (0 for the start id).
            cache: from `init_cache` or the previous step, stacked or split
                per layer (`split_cache`).

        Returns:
            `(logits [B, V] for position index + 1, updated cache)`, the
            cache in the form it was given.

        Raises:
            ValueError: when concrete (outside a traced search), ids outside
                the vocabulary, a batch other than the cache's, or an `index`
                outside the cache.
        """
        if isinstance(token_ids, (list, tuple)):
            token_ids = np.asarray(token_ids)
        if len(token_ids.shape) == 1:
            token_ids = token_ids[:, None]  # [B] -> [B, 1]
        token_ids = check_token_ids(token_ids, "token_ids", self.vocabulary_size)
        split = self._is_split(cache)

        def entry(name, i):  # [B, N, T, H], from a split or a stacked [B, L, N, T, H] entry
            return cache[name][i] if split else cache[name][:, i]

        keys = cache["self_key"][0] if split else cache["self_key"]  # no slice copy for the checks
        check_batch_sizes(token_ids=token_ids, cache=keys)
        check_cache_index(index, keys.shape[2 if split else 3])
        x = self._embed(token_ids, self.decoder_position, self.decoder_embedding_dropout, start_index=index, training=False)
        keys, values = [], []
        for i, layer in enumerate(self.decoder_layers):
            x, (key, value) = layer.call_cached(
                x,
                self_attention_cache=(entry("self_key", i), entry("self_value", i)),
                self_attention_cache_update_index=index,
                cross_attention_cache=(entry("cross_key", i), entry("cross_value", i)),
                encoder_padding_mask=cache["encoder_padding_mask"],
                training=False,
            )
            keys.append(key)
            values.append(value)
        if split:
            cache = dict(cache, self_key=tuple(keys), self_value=tuple(values))
        else:
            cache = dict(cache, self_key=ops.stack(keys, axis=1), self_value=ops.stack(values, axis=1))
        logits = self._logits(x)[:, 0, :]  # [B, V]
        if self.exclude_start_logit:
            logits = ops.where(ops.arange(self.vocabulary_size) == self.start_id, float("-inf"), logits)
        return logits, cache
