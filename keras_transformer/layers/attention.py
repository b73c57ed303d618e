"""Multi-head scaled dot-product attention (paper section 3.2).

Shape legend used in the comments: B batch, T query length, S key/value
length, N heads, K per-head key size (d_k), V per-head value size (d_v),
D model size (d_model, `hidden_dim`).
"""

import math
import numbers

import keras
from keras import ops


def check_attention_window(attention_window):
    """Refuses an `attention_window` that is not None or an odd integer >= 1.

    The window is the paper's r (Table 1): the r positions centered on the
    query, (r - 1) / 2 on each side, so r must be odd; an even width has no
    center.
    """
    if attention_window is None:
        return
    if not isinstance(attention_window, numbers.Integral) or isinstance(attention_window, bool) or attention_window < 1:
        raise ValueError(f"attention_window={attention_window!r} must be None or an odd positive integer")
    if attention_window % 2 == 0:
        raise ValueError(
            f"attention_window={attention_window} must be odd: the window is the r positions centered "
            f"on the query, (r - 1) / 2 on each side; use {attention_window - 1} or {attention_window + 1}"
        )


def window_radius(attention_window):
    """How far each side of the query a window of `attention_window` positions reaches: (r - 1) // 2."""
    return (attention_window - 1) // 2


def clone_initializer(initializer):
    """A fresh copy, so that no two weights share one seeded initializer."""
    return initializer.__class__.from_config(initializer.get_config())


def masked_fill_value(dtype):
    """The logit given to masked positions before the softmax.

    A large finite negative rather than -inf, so that a row with no visible
    key gives a uniform distribution instead of NaN (as Keras' own softmax
    masking does); smaller in half precision so that it stays finite.
    """
    return -3e4 if keras.backend.standardize_dtype(dtype) == "float16" else -1e9


def scaled_dot_product_attention(query, key, value, mask=None, dropout=None, training=None):
    """softmax(Q K^T / sqrt(d_k)) V, the paper's equation (1), written out.

    Args:
        query: `[B, T, N, K]`.
        key: `[B, S, N, K]`.
        value: `[B, S, N, V]`.
        mask: optional boolean, broadcastable to `[B, N, T, S]`; True = attend.
        dropout: optional dropout layer applied to the attention weights.
        training: passed to `dropout`.

    Returns:
        `(outputs [B, T, N, V], weights [B, N, T, S])`.
    """
    scale = 1.0 / math.sqrt(ops.shape(query)[-1])
    scores = ops.einsum("btnk,bsnk->bnts", query, key) * ops.cast(scale, query.dtype)
    weights = _attention_weights(scores, mask, query.dtype, dropout, training)
    outputs = ops.einsum("bnts,bsnv->btnv", weights, value)
    return outputs, weights


def _attention_weights(scores, mask, dtype, dropout, training):
    """Masked softmax of the scaled scores `[B, N, T, S]`, then dropout; in `dtype`."""
    if mask is not None:
        scores = ops.where(mask, scores, ops.cast(masked_fill_value(scores.dtype), scores.dtype))
    # The softmax runs in float32 even under mixed precision.
    weights = ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), dtype)
    if dropout is not None:
        weights = dropout(weights, training=training)
    return weights


def heads_first_attention(query, key, value, mask=None, dropout=None, training=None):
    """Equation (1) over keys and values stored heads first (the decoding caches).

    The same function as `scaled_dot_product_attention`, written as two
    batched matrix products over `[B, N, S, H]` keys and values, so that
    nothing of the size of the cache is transposed or copied.

    Args:
        query: `[B, T, N, K]`.
        key: `[B, N, S, K]`.
        value: `[B, N, S, V]`.
        mask: optional boolean, broadcastable to `[B, N, T, S]`; True = attend.
        dropout: optional dropout layer applied to the attention weights.
        training: passed to `dropout`.

    Returns:
        `(outputs [B, T, N, V], weights [B, N, T, S])`.
    """
    scale = 1.0 / math.sqrt(ops.shape(query)[-1])
    q = ops.transpose(query, (0, 2, 1, 3))  # [B, N, T, K]
    scores = ops.matmul(q, ops.swapaxes(key, -1, -2)) * ops.cast(scale, query.dtype)  # [B, N, T, S]
    weights = _attention_weights(scores, mask, query.dtype, dropout, training)
    outputs = ops.matmul(weights, value)  # [B, N, T, V]
    return ops.transpose(outputs, (0, 2, 1, 3)), weights


def local_attention(
    query, key, value, window, key_padding_mask=None, causal=False, dropout=None, training=None
):
    """Equation (1) restricted to a window of r positions, in O(n * r).

    The paper's Table 1 "self-attention (restricted)": query i only attends
    to the r keys centered on it, the keys j with |i - j| <= (r - 1) / 2
    (`window_radius`), which costs O(r * n * d) instead of O(n^2 * d) when
    computed blockwise. The sequence is cut into blocks of
    `w = max((r - 1) / 2, 1)` positions; the queries of a block can only see
    keys in the same block and its two neighbours, so each block attends
    over `3 * w` keys (masked to the exact window) and the cost grows
    linearly with n. It computes the same function as
    `scaled_dot_product_attention` with `attention_masks(...,
    attention_window=r)` (tested), for every row that has at least one
    visible key.

    Args:
        query: `[B, n, N, K]`, key: `[B, n, N, K]`, value: `[B, n, N, V]`
            (self-attention: the same length n).
        window: odd int r >= 1, the window's width.
        key_padding_mask: optional `[B, n]`, True (or 1) for real tokens.
        causal: bool, query i only sees keys j <= i (then the (r + 1) / 2
            keys i - (r - 1) / 2, ..., i).
        dropout, training: dropout on the attention weights.

    Returns:
        outputs `[B, n, N, V]`.
    """
    check_attention_window(window)
    radius = window_radius(window)
    w = max(radius, 1)
    batch, length = ops.shape(query)[0], ops.shape(query)[1]
    heads, key_size, value_size = query.shape[2], query.shape[3], value.shape[3]
    blocks = (length + w - 1) // w
    padded = blocks * w
    extra = padded - length

    def blocked(x, size):  # [B, padded, N, H] -> [B, blocks, w, N, H]
        return ops.reshape(x, (batch, blocks, w, heads, size))

    def neighbours(x, size):
        # Keys of the previous, same and next block: [B, blocks, 3w, ...].
        x = ops.pad(x, [[0, 0], [w, extra + w]] + [[0, 0]] * (len(x.shape) - 2))
        parts = [ops.slice(x, [0, start] + [0] * (len(x.shape) - 2),
                           [batch, padded] + list(x.shape[2:])) for start in (0, w, 2 * w)]
        if size is None:  # the padding mask [B, padded] -> [B, blocks, w]
            parts = [ops.reshape(part, (batch, blocks, w)) for part in parts]
        else:
            parts = [blocked(part, size) for part in parts]
        return ops.concatenate(parts, axis=2)

    q = blocked(ops.pad(query, [[0, 0], [0, extra], [0, 0], [0, 0]]), key_size)
    k = neighbours(key, key_size)  # [B, blocks, 3w, N, K]
    v = neighbours(value, value_size)  # [B, blocks, 3w, N, V]
    valid = ops.ones((batch, length), "bool") if key_padding_mask is None else ops.cast(key_padding_mask, "bool")
    valid = neighbours(valid, None)  # [B, blocks, 3w]; False outside [0, n)

    # Query a and key s of a block are at distance i - j = a + w - s.
    distance = ops.expand_dims(ops.arange(w) + w, 1) - ops.expand_dims(ops.arange(3 * w), 0)  # [w, 3w]
    allowed = ops.abs(distance) <= radius
    if causal:
        allowed = ops.logical_and(allowed, distance >= 0)
    mask = ops.logical_and(allowed[None, None, None], valid[:, :, None, None, :])  # [B, blocks, 1, w, 3w]

    scale = 1.0 / math.sqrt(key_size)
    scores = ops.einsum("bcqnk,bcsnk->bcnqs", q, k) * ops.cast(scale, q.dtype)
    scores = ops.where(mask, scores, ops.cast(masked_fill_value(scores.dtype), scores.dtype))
    weights = ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), q.dtype)
    if dropout is not None:
        weights = dropout(weights, training=training)
    outputs = ops.einsum("bcnqs,bcsnv->bcqnv", weights, v)
    outputs = ops.reshape(outputs, (batch, padded, heads, value_size))
    return ops.slice(outputs, [0, 0, 0, 0], [batch, length, heads, value_size])


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with an incremental-decoding cache.

    `MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O` with
    `head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)` (paper section 3.2.2).
    The per-head key size `key_dim` (d_k) and value size `value_dim` (d_v)
    are independent, as in the paper's Table 3 rows (A) and (B).

    Masks are boolean, True = attend, broadcastable to `[B, T, S]` (or
    `[B, N, T, S]`). Padding, causal and restricted-window masks are combined
    by the caller (see `attention_masks`).

    Incremental decoding (as keras-hub's `CachedMultiHeadAttention`, with
    the caches heads first, `[B, N, S, H]`, as fairseq and Hugging Face
    keep them):
    - `cache=(key_cache, value_cache)` with `cache_update_index=i`: the
      keys/values of `value` are written into the fixed-size caches
      `[B, N, S_max, K]` / `[B, N, S_max, V]` at position `i`, attention runs
      over the whole cache (the mask hides positions not yet written) and the
      updated cache is returned. This is decoder self-attention.
    - `cache=(key_cache, value_cache)` without an index: the cache is used as
      the keys/values and `value` is ignored. This is cross-attention, whose
      keys/values are computed once per source with `compute_cache`.
    Heads first, a step's attention is two batched matrix products straight
    on the cache (`Q K^T` with the transpose folded into the product); with
    the time axis second, exported graphs transposed the whole cache of every
    layer at every step (about 40% of ONNX Runtime's time in a 32-row
    decoder step, see benchmarks/README.md).

    Args:
        num_heads: int, h in the paper.
        key_dim: int, per-head size of queries and keys (d_k).
        value_dim: int, per-head size of values (d_v). Defaults to `key_dim`,
            as in `keras.layers.MultiHeadAttention` (the encoder and decoder
            layers and `TransformerModel` pass it explicitly: their d_v
            defaults to hidden_dim // num_heads, independently of d_k).
        dropout: float, dropout on the attention weights. The paper does not
            use it (it drops sub-layer outputs instead), so 0.0 by default.
        attention_window: optional odd int r, the paper's Table 1
            "self-attention (restricted)": each query i only sees the r keys
            centered on it, j with |i - j| <= (r - 1) / 2 (r = 1: itself
            only; even r is refused, as it has no center); with a causal
            mask, the (r + 1) / 2 keys i - (r - 1) / 2, ..., i.
            Self-attention called with `padding_mask=` / `use_causal_mask=`
            (as the encoder and decoder layers do in training) computes it
            blockwise in O(n * r) (`local_attention`); an explicit
            `attention_mask` (built with `attention_masks`), a cache, or
            `return_attention_scores=True` take the dense O(n^2) path.
        use_fused_attention: bool, use `keras.ops.dot_product_attention`
            (fused/flash kernels where the backend has them) when it computes
            the same function: key_dim == value_dim, no attention dropout in
            training, and no attention weights requested.
        kernel_initializer, bias_initializer: for the four projections.

    Example:
    >>> layer = MultiHeadAttention(num_heads=8, key_dim=64)
    >>> x = keras.random.normal((2, 10, 512))
    >>> layer(x, x).shape
    (2, 10, 512)

    References:
    - Vaswani et al., "Attention Is All You Need", 2017, section 3.2.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        attention_window=None,
        use_fused_attention=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads={num_heads!r} must be a positive integer")
        if not isinstance(key_dim, int) or key_dim < 1:
            raise ValueError(f"key_dim={key_dim!r} must be a positive integer")
        if value_dim is not None and (not isinstance(value_dim, int) or value_dim < 1):
            raise ValueError(f"value_dim={value_dim!r} must be a positive integer or None")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
        check_attention_window(attention_window)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim if value_dim is not None else key_dim
        self.dropout = dropout
        self.attention_window = attention_window
        self.use_fused_attention = use_fused_attention
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = False

    def _dense(self, units, name):
        return keras.layers.Dense(
            units,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, query_shape, value_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        self._output_dim = query_shape[-1]
        self.query_dense = self._dense(self.num_heads * self.key_dim, "query")
        self.query_dense.build(query_shape)
        self.key_dense = self._dense(self.num_heads * self.key_dim, "key")
        self.key_dense.build(value_shape)
        self.value_dense = self._dense(self.num_heads * self.value_dim, "value")
        self.value_dense.build(value_shape)
        self.output_dense = self._dense(self._output_dim, "attention_output")
        self.output_dense.build(tuple(query_shape[:-1]) + (self.num_heads * self.value_dim,))
        self.weights_dropout = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def _split_heads(self, x, head_dim):
        # [B, T, N * H] -> [B, T, N, H]
        shape = ops.shape(x)
        return ops.reshape(x, (shape[0], shape[1], self.num_heads, head_dim))

    def _keys_values(self, value):
        """Keys `[B, S, N, K]` and values `[B, S, N, V]` of `value` `[B, S, D]`."""
        keys = self._split_heads(self.key_dense(value), self.key_dim)
        values = self._split_heads(self.value_dense(value), self.value_dim)
        return keys, values

    def compute_cache(self, value):
        """Keys and values of `value` `[B, S, D]` in the cache layout (heads first).

        For a cross-attention cache, or the rows that a decoding step writes
        into the self-attention cache.

        Returns `(keys [B, N, S, K], values [B, N, S, V])`.
        """
        keys, values = self._keys_values(value)
        return ops.transpose(keys, (0, 2, 1, 3)), ops.transpose(values, (0, 2, 1, 3))

    def call(
        self,
        query,
        value=None,
        attention_mask=None,
        cache=None,
        cache_update_index=None,
        return_attention_scores=False,
        training=None,
        padding_mask=None,
        use_causal_mask=False,
    ):
        """Attention of `query` `[B, T, D]` over `value` `[B, S, D]` (default: `query`).

        Masks: either `attention_mask` (boolean `[B, T, S]`, see
        `attention_masks`) or, for self-attention, `padding_mask` (`[B, S]`,
        True for real tokens) and `use_causal_mask`, combined here with the
        layer's `attention_window`.
        """
        if (padding_mask is not None or use_causal_mask) and attention_mask is not None:
            raise ValueError("Pass attention_mask, or padding_mask/use_causal_mask, not both")
        self_attention = padding_mask is not None or use_causal_mask or value is None or value is query
        local = (
            self.attention_window is not None
            and self_attention
            and attention_mask is None
            and cache is None
            and not return_attention_scores
        )
        if not local and (padding_mask is not None or use_causal_mask):
            length = ops.shape(query)[1]
            key_length = length if cache is None else ops.shape(cache[0])[2]
            offset = 0 if cache_update_index is None else cache_update_index
            attention_mask = attention_masks(
                length, key_length, key_padding_mask=padding_mask, causal=use_causal_mask,
                attention_window=self.attention_window, query_offset=offset,
            )
        value = query if value is None else value
        q = self._split_heads(self.query_dense(query), self.key_dim)  # [B, T, N, K]
        if local:
            k, v = self._keys_values(value)
            outputs = local_attention(
                q, k, v, self.attention_window, key_padding_mask=padding_mask, causal=use_causal_mask,
                dropout=self.weights_dropout if self.dropout > 0 else None, training=training,
            )
            shape = ops.shape(outputs)
            outputs = ops.reshape(outputs, (shape[0], shape[1], self.num_heads * self.value_dim))
            return self.output_dense(outputs)
        mask = None
        if attention_mask is not None:
            mask = ops.cast(attention_mask, "bool")
            if len(mask.shape) == 3:
                mask = ops.expand_dims(mask, 1)  # [B, T, S] -> [B, 1, T, S]

        if cache is not None:
            if cache_update_index is None:
                k, v = cache  # [B, N, S, K], [B, N, S, V]
            else:
                key_cache, value_cache = cache
                new_k, new_v = self.compute_cache(value)  # [B, N, T, K], [B, N, T, V]
                start = [0, 0, cache_update_index, 0]
                k = ops.slice_update(key_cache, start, ops.cast(new_k, key_cache.dtype))
                v = ops.slice_update(value_cache, start, ops.cast(new_v, value_cache.dtype))
                cache = (k, v)
            outputs, scores = heads_first_attention(
                q, k, v, mask=mask, dropout=self.weights_dropout, training=training
            )
        else:
            k, v = self._keys_values(value)  # [B, S, N, K], [B, S, N, V]
            fused = (
                self.use_fused_attention
                and not return_attention_scores
                and self.key_dim == self.value_dim
                and not (training and self.dropout > 0)
            )
            if fused:
                scores = None
                outputs = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(self.key_dim))
            else:
                outputs, scores = scaled_dot_product_attention(
                    q, k, v, mask=mask, dropout=self.weights_dropout, training=training
                )
        shape = ops.shape(outputs)
        outputs = ops.reshape(outputs, (shape[0], shape[1], self.num_heads * self.value_dim))
        outputs = self.output_dense(outputs)  # [B, T, D]

        results = (outputs,)
        if return_attention_scores:
            results += (scores,)
        if cache is not None and cache_update_index is not None:
            results += (cache,)
        return results[0] if len(results) == 1 else results

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "attention_window": self.attention_window,
                "use_fused_attention": self.use_fused_attention,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config


def attention_masks(
    query_length,
    key_length,
    key_padding_mask=None,
    causal=False,
    attention_window=None,
    query_offset=0,
):
    """Boolean attention mask `[B or 1, T, S]`, True = attend.

    Combines (with AND) the key padding mask, the causal mask and the
    restricted-window mask of the paper's Table 1: the r positions centered
    on query i, `|i - j| <= (r - 1) / 2` (`window_radius`).

    Args:
        query_length: int or scalar tensor T.
        key_length: int or scalar tensor S.
        key_padding_mask: optional `[B, S]`, True (or 1) for real tokens.
        causal: bool, query i only sees keys j <= i.
        attention_window: optional odd int r >= 1, the window's width.
        query_offset: int or scalar tensor, the position of the first query
            (the cache index in incremental decoding).

    Rows in which no key is visible (an all-padding source) are left fully
    masked; the attention then averages uniformly over padding, which is
    finite and never read.
    """
    check_attention_window(attention_window)
    mask = None
    if causal or attention_window is not None:
        i = ops.expand_dims(ops.arange(query_length, dtype="int32") + ops.cast(query_offset, "int32"), 1)
        j = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
        mask = ops.ones((query_length, key_length), dtype="bool")
        if causal:
            mask = ops.logical_and(mask, j <= i)
        if attention_window is not None:
            mask = ops.logical_and(mask, ops.abs(i - j) <= window_radius(attention_window))
        mask = ops.expand_dims(mask, 0)  # [1, T, S]
    if key_padding_mask is not None:
        padding = ops.expand_dims(ops.cast(key_padding_mask, "bool"), 1)  # [B, 1, S]
        mask = padding if mask is None else ops.logical_and(mask, padding)
    return mask
