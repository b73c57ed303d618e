"""Multi-head scaled dot-product attention (paper section 3.2).

Shape legend used in the comments: B batch, T query length, S key/value
length, N heads, K per-head key size (d_k), V per-head value size (d_v),
D model size (d_model, `hidden_dim`).
"""

import math

import keras
from keras import ops

from keras_transformer.layers.arguments import check_attention_window, check_positive_int, check_rate
from keras_transformer.layers.dense import Dense
from keras_transformer.layers.dropout import Dropout


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


def scaled_dot_product_attention(
    query, key, value, mask=None, dropout=None, training=None, heads_first=False
):
    """softmax(Q K^T / sqrt(d_k)) V, the paper's equation (1), written out.

    The one implementation of equation (1) in the package: the training
    path, the decoding caches and the blockwise `local_attention` all call
    it (only `keras.ops.dot_product_attention`, a fused kernel for the same
    function, is used beside it).

    Args:
        query: `[B, T, N, K]`.
        key: `[B, S, N, K]`, or `[B, N, S, K]` with `heads_first`.
        value: `[B, S, N, V]`, or `[B, N, S, V]` with `heads_first`.
        mask: optional boolean, broadcastable to `[B, N, T, S]`; True = attend.
        dropout: optional dropout layer applied to the attention weights.
        training: passed to `dropout`.
        heads_first: keys and values stored heads first, as the decoding
            caches keep them; equation (1) is then two batched matrix
            products straight on them, so that nothing of the size of the
            cache is transposed or copied.

    Returns:
        `(outputs [B, T, N, V], weights [B, N, T, S])`.
    """
    scale = ops.cast(1.0 / math.sqrt(ops.shape(query)[-1]), query.dtype)
    if heads_first:
        q = ops.transpose(query, (0, 2, 1, 3))  # [B, N, T, K]
        scores = ops.matmul(q, ops.swapaxes(key, -1, -2)) * scale  # [B, N, T, S]
    else:
        scores = ops.einsum("btnk,bsnk->bnts", query, key) * scale  # [B, N, T, S]
    if mask is not None:
        scores = ops.where(mask, scores, ops.cast(masked_fill_value(scores.dtype), scores.dtype))
    # The softmax runs in float32 even under mixed precision.
    weights = ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), query.dtype)
    if dropout is not None:
        weights = dropout(weights, training=training)
    if heads_first:
        outputs = ops.transpose(ops.matmul(weights, value), (0, 2, 1, 3))  # [B, N, T, V] -> [B, T, N, V]
    else:
        outputs = ops.einsum("bnts,bsnv->btnv", weights, value)  # [B, T, N, V]
    return outputs, weights


def fused_attention_pays():
    """Whether `keras.ops.dot_product_attention` is used where it computes the same function.

    Not on JAX's CPU backend: there it is `jax.nn.dot_product_attention`'s
    XLA implementation, whose forward and backward pass took 10.1 ms against
    8.2 ms for `scaled_dot_product_attention` on the `small` shape's `[54, 36,
    4, 64]` heads (2-core CPU, 2026-12-06): it transposes the heads more.
    Elsewhere (cuDNN, PyTorch's SDPA, TensorFlow) the fused kernel is kept.
    """
    if keras.backend.backend() != "jax":
        return True
    import jax

    return jax.default_backend() != "cpu"


def window_radius(attention_window):
    """How far each side of the query a window of `attention_window` positions reaches: (r - 1) // 2."""
    return (attention_window - 1) // 2


def position_mask(query_positions, key_positions, causal=False, attention_window=None):
    """Which key positions each query position may see: boolean `[T, S]`, True = attend.

    The one statement of the position rules: causal, j <= i; restricted
    to a window of r positions centered on the query (paper Table 1),
    |i - j| <= (r - 1) / 2. Both `attention_masks` and the blockwise
    `local_attention` build their masks with it.

    Args:
        query_positions: int `[T]`, the positions i of the queries.
        key_positions: int `[S]`, the positions j of the keys.
        causal: bool.
        attention_window: optional odd int r.

    Returns:
        `[T, S]` boolean, or None when neither rule applies.
    """
    i = ops.expand_dims(ops.cast(query_positions, "int32"), 1)  # [T, 1]
    j = ops.expand_dims(ops.cast(key_positions, "int32"), 0)  # [1, S]
    rules = []
    if causal:
        rules.append(j <= i)
    if attention_window is not None:
        rules.append(ops.abs(i - j) <= window_radius(attention_window))
    if not rules:
        return None
    return rules[0] if len(rules) == 1 else ops.logical_and(*rules)


def attention_masks(
    query_length,
    key_length,
    key_padding_mask=None,
    causal=False,
    attention_window=None,
    query_offset=0,
):
    """Boolean attention mask `[B or 1, T, S]`, True = attend.

    Combines (with AND) the key padding mask and the `position_mask` rules:
    causal, and the restricted window of the paper's Table 1 (the r
    positions centered on query i, `|i - j| <= (r - 1) / 2`).

    Args:
        query_length: int or scalar tensor T.
        key_length: int or scalar tensor S.
        key_padding_mask: optional `[B, S]`, True (or 1) for real tokens.
        causal: bool, query i only sees keys j <= i.
        attention_window: optional odd int r >= 1, the window's width.
        query_offset: int or scalar tensor, the position of the first query
            (the cache index in incremental decoding).

    Returns:
        the mask, or None when nothing is masked.

    Rows in which no key is visible (an all-padding source) are left fully
    masked; the attention then averages uniformly over padding, which is
    finite and never read.
    """
    check_attention_window(attention_window)
    mask = None
    if causal or attention_window is not None:
        i = ops.arange(query_length, dtype="int32") + ops.cast(query_offset, "int32")
        j = ops.arange(key_length, dtype="int32")
        mask = ops.expand_dims(position_mask(i, j, causal, attention_window), 0)  # [1, T, S]
    if key_padding_mask is not None:
        padding = ops.expand_dims(ops.cast(key_padding_mask, "bool"), 1)  # [B, 1, S]
        mask = padding if mask is None else ops.logical_and(mask, padding)
    return mask


def local_attention(
    query, key, value, window, key_padding_mask=None, causal=False, dropout=None, training=None
):
    """Equation (1) restricted to a window of r positions, in O(n * r).

    The paper's Table 1 "self-attention (restricted)": query i only attends
    to the r keys centered on it, the keys j with |i - j| <= (r - 1) / 2
    (`position_mask`), which costs O(r * n * d) instead of O(n^2 * d) when
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
    w = max(window_radius(window), 1)
    batch, length = ops.shape(query)[0], ops.shape(query)[1]
    heads, key_size, value_size = query.shape[2], query.shape[3], value.shape[3]
    blocks = (length + w - 1) // w
    padded = blocks * w
    extra = padded - length

    def neighbours(x):
        # Keys of the previous, same and next block: [B, padded, ...] -> [B * blocks, 3w, ...].
        rest = list(x.shape[2:])
        x = ops.pad(x, [[0, 0], [w, extra + w]] + [[0, 0]] * len(rest))
        parts = [
            ops.reshape(ops.slice(x, [0, start] + [0] * len(rest), [batch, padded] + rest), [-1, w] + rest)
            for start in (0, w, 2 * w)
        ]
        return ops.concatenate(parts, axis=1)

    q = ops.reshape(ops.pad(query, [[0, 0], [0, extra], [0, 0], [0, 0]]), (-1, w, heads, key_size))  # [B * blocks, w, N, K]
    k = neighbours(key)  # [B * blocks, 3w, N, K]
    v = neighbours(value)  # [B * blocks, 3w, N, V]
    valid = ops.ones((batch, length), "bool") if key_padding_mask is None else ops.cast(key_padding_mask, "bool")
    valid = neighbours(valid)  # [B * blocks, 3w]; False outside [0, n)

    # Within a block, query a is at position a + w and key s at position s.
    allowed = position_mask(ops.arange(w) + w, ops.arange(3 * w), causal, window)  # [w, 3w]
    mask = ops.logical_and(allowed[None, None], valid[:, None, None, :])  # [B * blocks, 1, w, 3w]
    outputs, _ = scaled_dot_product_attention(q, k, v, mask=mask, dropout=dropout, training=training)
    outputs = ops.reshape(outputs, (batch, padded, heads, value_size))
    return ops.slice(outputs, [0, 0, 0, 0], [batch, length, heads, value_size])


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with an incremental-decoding cache.

    `MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O` with
    `head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)` (paper section 3.2.2).
    The per-head key size `key_dim` (d_k) and value size `value_dim` (d_v)
    are independent, as in the paper's Table 3 rows (A) and (B).

    Three methods, each with one path and a fixed result:
    - `call(query, value=None, ...)` (training, encoding): the outputs
      `[B, T, D]`. Masks come from `padding_mask` (the keys' padding) and
      `use_causal_mask`, combined with the layer's `attention_window`
      (see `attention_masks`), or from an explicit `attention_mask`.
    - `call_with_scores(...)`: the same arguments; `(outputs, weights
      [B, N, T, S])`, the softmax weights (dense, unfused).
    - `call_cached(query, cache, cache_update_index=None, ...)`:
      `(outputs, cache)` for incremental decoding (as keras-hub's
      `CachedMultiHeadAttention`, with the caches heads first,
      `[B, N, S, H]`, as fairseq and Hugging Face keep them). With
      `cache_update_index=i`, the keys/values of `query` are written into
      the fixed-size caches `[B, N, S_max, K]` / `[B, N, S_max, V]` at
      position i, attention runs over the whole cache (the causal mask hides
      positions not yet written) and the updated cache is returned: decoder
      self-attention. Without an index, the cache holds the keys/values
      (computed once per source with `compute_cache`) and is returned as
      it is: cross-attention.
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
            Self-attention through `call` without an explicit
            `attention_mask` (as the encoder and decoder layers train)
            computes it blockwise in O(n * r) (`local_attention`);
            `call_with_scores`, `call_cached` and an explicit
            `attention_mask` take the dense O(n^2) path.
        use_fused_attention: bool, use `keras.ops.dot_product_attention`
            (fused/flash kernels where the backend has them) when it computes
            the same function: key_dim == value_dim and no attention dropout
            in training (in `call` only), and not on JAX's CPU backend, where
            it was slower (`fused_attention_pays`).
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
        check_positive_int("num_heads", num_heads)
        check_positive_int("key_dim", key_dim)
        check_positive_int("value_dim", value_dim, optional=True)
        check_rate("dropout", dropout)
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
        return Dense(
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
        self.weights_dropout = Dropout(self.dropout, dtype=self.dtype_policy)

    def _split_heads(self, x, head_dim):
        # [B, T, N * H] -> [B, T, N, H]
        shape = ops.shape(x)
        return ops.reshape(x, (shape[0], shape[1], self.num_heads, head_dim))

    def _queries(self, query):
        return self._split_heads(self.query_dense(query), self.key_dim)  # [B, T, N, K]

    def _keys_values(self, value):
        """Keys `[B, S, N, K]` and values `[B, S, N, V]` of `value` `[B, S, D]`."""
        keys = self._split_heads(self.key_dense(value), self.key_dim)
        values = self._split_heads(self.value_dense(value), self.value_dim)
        return keys, values

    def _output(self, heads):
        # Concat(head_1, ..., head_h) W^O: [B, T, N, V] -> [B, T, N * V] -> [B, T, D]
        shape = ops.shape(heads)
        return self.output_dense(ops.reshape(heads, (shape[0], shape[1], self.num_heads * self.value_dim)))

    def _mask(self, query_length, key_length, padding_mask, use_causal_mask, attention_mask, query_offset=0):
        """The dense boolean mask `[B or 1, 1, T, S]`, or None when nothing is masked."""
        if attention_mask is not None:
            if padding_mask is not None or use_causal_mask:
                raise ValueError("Pass attention_mask, or padding_mask/use_causal_mask, not both")
            mask = ops.cast(attention_mask, "bool")
        else:
            mask = attention_masks(
                query_length, key_length, key_padding_mask=padding_mask, causal=use_causal_mask,
                attention_window=self.attention_window, query_offset=query_offset,
            )
        if mask is not None and len(mask.shape) == 3:
            mask = ops.expand_dims(mask, 1)  # [B, T, S] -> [B, 1, T, S]
        return mask

    def compute_cache(self, value):
        """Keys and values of `value` `[B, S, D]` in the cache layout (heads first).

        For a cross-attention cache, or the rows that a decoding step writes
        into the self-attention cache.

        Returns `(keys [B, N, S, K], values [B, N, S, V])`.
        """
        keys, values = self._keys_values(value)
        return ops.transpose(keys, (0, 2, 1, 3)), ops.transpose(values, (0, 2, 1, 3))

    def call(self, query, value=None, padding_mask=None, use_causal_mask=False, attention_mask=None, training=None):
        """Attention of `query` `[B, T, D]` over `value` `[B, S, D]` (default: `query`).

        Args:
            query: `[B, T, D]`.
            value: optional `[B, S, D]`; None (or `query` itself) for
                self-attention.
            padding_mask: optional `[B, S]`, True for the real tokens of
                `value` (the keys).
            use_causal_mask: bool, query i only sees keys j <= i.
            attention_mask: optional boolean `[B, T, S]` or `[B, N, T, S]`
                (True = attend), instead of `padding_mask`/`use_causal_mask`;
                the layer's window is then not added.
            training: bool, attention dropout.

        Returns:
            `[B, T, D]`.
        """
        self_attention = value is None or value is query
        value = query if value is None else value
        q = self._queries(query)  # [B, T, N, K]
        k, v = self._keys_values(value)  # [B, S, N, K], [B, S, N, V]
        if self.attention_window is not None and self_attention and attention_mask is None:
            heads = local_attention(  # restricted self-attention, blockwise in O(n * r)
                q, k, v, self.attention_window, key_padding_mask=padding_mask, causal=use_causal_mask,
                dropout=self.weights_dropout if self.dropout > 0 else None, training=training,
            )
            return self._output(heads)
        mask = self._mask(ops.shape(query)[1], ops.shape(value)[1], padding_mask, use_causal_mask, attention_mask)
        fused = (self.use_fused_attention and self.key_dim == self.value_dim and not (training and self.dropout > 0)
                 and fused_attention_pays())
        if fused:
            heads = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(self.key_dim))
        else:
            heads, _ = scaled_dot_product_attention(q, k, v, mask=mask, dropout=self.weights_dropout, training=training)
        return self._output(heads)

    def call_with_scores(
        self, query, value=None, padding_mask=None, use_causal_mask=False, attention_mask=None, training=None
    ):
        """As `call`, through the dense path; returns `(outputs [B, T, D], weights [B, N, T, S])`."""
        value = query if value is None else value
        if not self.built:
            self.build(query.shape, value.shape)
        mask = self._mask(ops.shape(query)[1], ops.shape(value)[1], padding_mask, use_causal_mask, attention_mask)
        heads, weights = scaled_dot_product_attention(
            self._queries(query), *self._keys_values(value), mask=mask, dropout=self.weights_dropout, training=training
        )
        return self._output(heads), weights

    def call_cached(
        self, query, cache, cache_update_index=None, padding_mask=None, use_causal_mask=False, training=None
    ):
        """Attention of `query` `[B, T, D]` over a heads-first cache; returns `(outputs [B, T, D], cache)`.

        Args:
            query: `[B, T, D]`, the tokens at positions `cache_update_index`,
                ..., `cache_update_index + T - 1` for self-attention.
            cache: `(keys [B, N, S, K], values [B, N, S, V])`.
            cache_update_index: int or scalar tensor: write the keys/values
                of `query` there (self-attention). None: the cache is the
                keys/values (cross-attention) and is returned unchanged.
            padding_mask: optional `[B, S]`, True for real keys.
            use_causal_mask: bool, query at position i only sees keys j <= i.
            training: bool, attention dropout.
        """
        if cache_update_index is None:
            keys, values = cache  # [B, N, S, K], [B, N, S, V]
            query_offset = 0
        else:
            key_cache, value_cache = cache
            new_keys, new_values = self.compute_cache(query)  # [B, N, T, K], [B, N, T, V]
            start = [0, 0, cache_update_index, 0]
            keys = ops.slice_update(key_cache, start, ops.cast(new_keys, key_cache.dtype))
            values = ops.slice_update(value_cache, start, ops.cast(new_values, value_cache.dtype))
            cache, query_offset = (keys, values), cache_update_index
        mask = self._mask(
            ops.shape(query)[1], ops.shape(keys)[2], padding_mask, use_causal_mask, None, query_offset
        )
        heads, _ = scaled_dot_product_attention(
            self._queries(query), keys, values, mask=mask, dropout=self.weights_dropout, training=training,
            heads_first=True,
        )
        return self._output(heads), cache

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
