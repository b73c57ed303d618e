import math

import keras
import numpy as np
import pytest

from conftest import to_numpy
from keras_transformer.layers import MultiHeadAttention
from keras_transformer.layers.attention import (
    attention_masks,
    local_attention,
    scaled_dot_product_attention,
)


def numpy_multi_head_attention(query, value, weights, num_heads, key_dim, value_dim, mask=None):
    """The paper's equation (1) per head, concatenated and projected (section 3.2.2)."""
    wq, bq, wk, bk, wv, bv, wo, bo = weights
    heads = []
    for h in range(num_heads):
        q = query @ wq[:, h * key_dim:(h + 1) * key_dim] + bq[h * key_dim:(h + 1) * key_dim]
        k = value @ wk[:, h * key_dim:(h + 1) * key_dim] + bk[h * key_dim:(h + 1) * key_dim]
        v = value @ wv[:, h * value_dim:(h + 1) * value_dim] + bv[h * value_dim:(h + 1) * value_dim]
        logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(key_dim)  # [B, T, S]
        if mask is not None:
            logits = np.where(mask, logits, -np.inf)
        logits = logits - logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        probs = probs / probs.sum(-1, keepdims=True)
        heads.append(probs @ v)
    return np.concatenate(heads, -1) @ wo + bo


def hand_set_layer(rng, hidden, num_heads, key_dim, value_dim, fused=False):
    layer = MultiHeadAttention(num_heads, key_dim, value_dim, use_fused_attention=fused)
    layer.build((None, None, hidden), (None, None, hidden))
    weights = [
        rng.normal(size=(hidden, num_heads * key_dim)), rng.normal(size=num_heads * key_dim),
        rng.normal(size=(hidden, num_heads * key_dim)), rng.normal(size=num_heads * key_dim),
        rng.normal(size=(hidden, num_heads * value_dim)), rng.normal(size=num_heads * value_dim),
        rng.normal(size=(num_heads * value_dim, hidden)), rng.normal(size=hidden),
    ]
    weights = [(w * 0.3).astype("float32") for w in weights]
    for dense, (kernel, bias) in zip(
        [layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense],
        zip(weights[0::2], weights[1::2]),
    ):
        dense.set_weights([kernel, bias])
    return layer, weights


@pytest.mark.parametrize("num_heads,key_dim,value_dim", [(2, 4, 4), (4, 3, 5), (1, 8, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_numpy_equation_1(rng, num_heads, key_dim, value_dim, masked):
    hidden = 8
    layer, weights = hand_set_layer(rng, hidden, num_heads, key_dim, value_dim)
    query = rng.normal(size=(2, 5, hidden)).astype("float32")
    value = rng.normal(size=(2, 7, hidden)).astype("float32")
    mask = None
    if masked:
        mask = rng.random((2, 5, 7)) > 0.4
        mask[:, :, 0] = True  # every query sees at least one key
    expected = numpy_multi_head_attention(query, value, weights, num_heads, key_dim, value_dim, mask)
    actual = to_numpy(layer(query, value, attention_mask=mask))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("masked", [False, True])
def test_fused_path_equals_plain_path(rng, masked):
    hidden, num_heads, key_dim = 16, 4, 4
    plain, weights = hand_set_layer(np.random.default_rng(1), hidden, num_heads, key_dim, key_dim, fused=False)
    fused, _ = hand_set_layer(np.random.default_rng(1), hidden, num_heads, key_dim, key_dim, fused=True)
    query = rng.normal(size=(3, 6, hidden)).astype("float32")
    value = rng.normal(size=(3, 9, hidden)).astype("float32")
    mask = None
    if masked:
        mask = attention_masks(6, 9, key_padding_mask=np.arange(9)[None, :] < np.array([[9], [4], [1]]), causal=True)
    np.testing.assert_allclose(
        to_numpy(fused(query, value, attention_mask=mask)),
        to_numpy(plain(query, value, attention_mask=mask)),
        rtol=1e-5, atol=1e-5,
    )


def test_attention_scores_are_the_softmax_weights(rng):
    layer, _ = hand_set_layer(rng, 8, 2, 4, 4)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    mask = np.tril(np.ones((5, 5), bool))[None]
    outputs, scores = layer.call_with_scores(x, x, attention_mask=mask)
    np.testing.assert_allclose(to_numpy(outputs), to_numpy(layer(x, x, attention_mask=mask)), rtol=1e-5, atol=1e-5)
    scores = to_numpy(scores)
    assert scores.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(scores.sum(-1), 1.0, rtol=1e-5)
    assert np.all(scores[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] < 1e-6)


def test_cache_update_matches_full_attention(rng):
    """Writing keys/values one step at a time gives the full causal attention."""
    layer, _ = hand_set_layer(rng, 8, 2, 4, 4)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    full = to_numpy(layer(x, x, attention_mask=attention_masks(6, 6, causal=True)))
    cache = (np.zeros((2, 2, 6, 4), "float32"), np.zeros((2, 2, 6, 4), "float32"))  # [B, N, T_max, H]
    for t in range(6):
        out, cache = layer.call_cached(x[:, t:t + 1], cache, cache_update_index=t, use_causal_mask=True)
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    # The filled cache holds the keys/values of the whole sequence.
    keys, values = layer.compute_cache(x)
    np.testing.assert_allclose(to_numpy(cache[0]), to_numpy(keys), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(cache[1]), to_numpy(values), rtol=1e-5, atol=1e-5)


def test_cross_attention_cache_is_used_as_it_is(rng):
    """Without an index the cache is the keys/values: the same outputs as `call`, the cache unchanged."""
    layer, _ = hand_set_layer(rng, 8, 2, 4, 6)
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    source = rng.normal(size=(2, 5, 8)).astype("float32")
    padding = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)
    cache = layer.compute_cache(source)
    out, same = layer.call_cached(x, cache, padding_mask=padding)
    expected = to_numpy(layer(x, source, padding_mask=padding))
    np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-5, atol=1e-5)
    assert same[0] is cache[0] and same[1] is cache[1]


def test_explicit_and_derived_masks_together_are_refused(rng):
    layer, _ = hand_set_layer(rng, 8, 2, 4, 4)
    x = rng.normal(size=(1, 3, 8)).astype("float32")
    with pytest.raises(ValueError, match="Pass attention_mask, or padding_mask/use_causal_mask, not both"):
        layer(x, attention_mask=np.ones((1, 3, 3), bool), use_causal_mask=True)


def test_heads_first_attention_equals_equation_1(rng):
    """Keys/values heads first (the cache layout) give the same equation (1) as time first."""
    query = rng.normal(size=(2, 3, 4, 5)).astype("float32")  # [B, T, N, K]
    key = rng.normal(size=(2, 7, 4, 5)).astype("float32")  # [B, S, N, K]
    value = rng.normal(size=(2, 7, 4, 6)).astype("float32")  # [B, S, N, V]
    mask = attention_masks(3, 7, key_padding_mask=np.array([[1] * 7, [1] * 4 + [0] * 3]), causal=True, query_offset=4)
    mask = keras.ops.expand_dims(mask, 1)  # [B, 1, T, S]
    expected, expected_weights = scaled_dot_product_attention(query, key, value, mask=mask)
    outputs, weights = scaled_dot_product_attention(
        query, np.transpose(key, (0, 2, 1, 3)), np.transpose(value, (0, 2, 1, 3)), mask=mask, heads_first=True
    )
    np.testing.assert_allclose(to_numpy(outputs), to_numpy(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), to_numpy(expected_weights), rtol=1e-5, atol=1e-6)


def numpy_window(length, r, causal=False):
    """Which keys each query sees: the r positions centered on it (paper Table 1), clipped to the sequence."""
    visible = np.zeros((length, length), bool)
    for i in range(length):
        window = range(i - (r - 1) // 2, i - (r - 1) // 2 + r)  # r consecutive positions, i in the middle
        assert len(window) == r and window[r // 2] == i
        for j in window:
            if 0 <= j < length and (not causal or j <= i):
                visible[i, j] = True
    return visible


@pytest.mark.parametrize("r", [1, 3, 5, 9])
@pytest.mark.parametrize("causal", [False, True])
def test_restricted_window_mask_is_r_positions_centered(r, causal):
    mask = to_numpy(attention_masks(12, 12, causal=causal, attention_window=r))[0]
    np.testing.assert_array_equal(mask, numpy_window(12, r, causal))
    # Away from the edges a query sees r positions, or (r + 1) / 2 when causal.
    assert mask[6].sum() == ((r + 1) // 2 if causal else r)


def test_restricted_window_mask_with_an_offset_query():
    """A cached decoding step at position t sees the rows of the full mask."""
    full = numpy_window(10, 5, causal=True)
    for t in range(10):
        step = to_numpy(attention_masks(1, 10, causal=True, attention_window=5, query_offset=t))[0]
        np.testing.assert_array_equal(step[0], full[t])


@pytest.mark.parametrize(
    "window,match",
    [
        (4, r"attention_window=4 must be odd: .* use 3 or 5"),
        (0, r"attention_window=0 must be None or an odd positive integer"),
        (-3, r"attention_window=-3 must be None or an odd positive integer"),
        (True, r"attention_window=True must be None or an odd positive integer"),
    ],
)
def test_bad_attention_window_is_refused(window, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(2, 4, attention_window=window)
    with pytest.raises(ValueError, match=match):
        attention_masks(5, 5, attention_window=window)


def test_config_round_trip():
    layer = MultiHeadAttention(4, 8, 16, dropout=0.1, attention_window=3, name="mha")
    clone = MultiHeadAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_heads=0, key_dim=4), "num_heads=0"),
        (dict(num_heads=2, key_dim=-1), "key_dim=-1"),
        (dict(num_heads=2, key_dim=4, dropout=1.5), "dropout=1.5"),
        (dict(num_heads=2, key_dim=4, attention_window=-2), "attention_window=-2"),
        (dict(num_heads=2, key_dim=4, attention_window=2), "attention_window=2 must be odd"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


@pytest.mark.parametrize("window", [1, 3, 5, 7, 9])
@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_equals_dense_window_mask(window, causal):
    """The blockwise O(n * r) restricted attention is equation (1) under the dense window mask."""
    rng = np.random.default_rng(window + 10 * causal)
    batch, length, heads = 3, 11, 2  # 11 is not a multiple of any block size tested
    q = rng.standard_normal((batch, length, heads, 4)).astype("float32")
    k = rng.standard_normal((batch, length, heads, 4)).astype("float32")
    v = rng.standard_normal((batch, length, heads, 5)).astype("float32")
    lengths = np.array([11, 7, 1])
    padding = np.arange(length)[None, :] < lengths[:, None]
    local = to_numpy(local_attention(q, k, v, window, key_padding_mask=padding, causal=causal))
    mask = attention_masks(length, length, key_padding_mask=padding, causal=causal, attention_window=window)
    dense, _ = scaled_dot_product_attention(q, k, v, mask=keras.ops.expand_dims(mask, 1))
    for row, n in enumerate(lengths):  # padding queries are never read
        np.testing.assert_allclose(local[row, :n], to_numpy(dense)[row, :n], rtol=1e-5, atol=1e-5)


def test_windowed_layer_blockwise_matches_explicit_mask():
    """The layer's blockwise path (padding_mask=) equals its dense path (attention_mask=)."""
    layer = MultiHeadAttention(2, 4, attention_window=5)
    x = np.random.default_rng(0).standard_normal((2, 9, 8)).astype("float32")
    padding = np.arange(9)[None, :] < np.array([[9], [5]])
    blockwise = to_numpy(layer(x, x, padding_mask=padding, use_causal_mask=True))
    mask = attention_masks(9, 9, key_padding_mask=padding, causal=True, attention_window=5)
    dense = to_numpy(layer(x, x, attention_mask=mask))
    np.testing.assert_allclose(blockwise[0], dense[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blockwise[1, :5], dense[1, :5], rtol=1e-5, atol=1e-5)
