import numpy as np
import pytest

from conftest import to_numpy
from keras_transformer.layers import TransformerDecoderLayer, TransformerEncoderLayer
from keras_transformer.layers.attention import attention_masks


def numpy_layer_norm(layer, x):
    gamma, beta = [to_numpy(w) for w in layer.weights]
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + layer.epsilon) * gamma + beta


def numpy_ffn(layer, x):
    w1, b1 = [to_numpy(w) for w in layer.feedforward_intermediate.weights]
    w2, b2 = [to_numpy(w) for w in layer.feedforward_output.weights]
    return np.maximum(0, x @ w1 + b1) @ w2 + b2  # paper equation (2)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_encoder_layer_composes_the_sublayers_as_the_paper(rng, normalize_first):
    layer = TransformerEncoderLayer(intermediate_dim=32, num_heads=2, dropout=0.0, normalize_first=normalize_first)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    out = to_numpy(layer(x, padding_mask=padding))

    mask = to_numpy(attention_masks(5, 5, key_padding_mask=padding))
    attend = lambda y: to_numpy(layer.self_attention(y, y, attention_mask=mask))  # noqa: E731
    ln1, ln2 = layer.self_attention_norm, layer.feedforward_norm
    if normalize_first:
        h = x + attend(numpy_layer_norm(ln1, x))
        expected = h + numpy_ffn(layer, numpy_layer_norm(ln2, h))
    else:  # LayerNorm(x + Sublayer(x))
        h = numpy_layer_norm(ln1, x + attend(x))
        expected = numpy_layer_norm(ln2, h + numpy_ffn(layer, h))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_decoder_layer_composes_the_sublayers_as_the_paper(rng):
    layer = TransformerDecoderLayer(intermediate_dim=32, num_heads=2, dropout=0.0)
    x = rng.normal(size=(2, 4, 8)).astype("float32")
    enc = rng.normal(size=(2, 6, 8)).astype("float32")
    enc_padding = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    out = to_numpy(layer(x, enc, encoder_padding_mask=enc_padding))

    causal = to_numpy(attention_masks(4, 4, causal=True))
    cross = to_numpy(attention_masks(4, 6, key_padding_mask=enc_padding))
    h = numpy_layer_norm(layer.self_attention_norm, x + to_numpy(layer.self_attention(x, x, attention_mask=causal)))
    h = numpy_layer_norm(layer.cross_attention_norm, h + to_numpy(layer.cross_attention(h, enc, attention_mask=cross)))
    expected = numpy_layer_norm(layer.feedforward_norm, h + numpy_ffn(layer, h))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_call_with_scores_gives_the_outputs_of_call(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    enc = rng.normal(size=(2, 6, 8)).astype("float32")
    padding = np.array([[1, 1, 1, 0, 0], [1] * 5], bool)
    enc_padding = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    encoder = TransformerEncoderLayer(intermediate_dim=16, num_heads=2, dropout=0.0)
    out, weights = encoder.call_with_scores(x, padding_mask=padding)
    np.testing.assert_allclose(to_numpy(out), to_numpy(encoder(x, padding_mask=padding)), rtol=1e-5, atol=1e-5)
    assert tuple(weights.shape) == (2, 2, 5, 5)
    assert np.all(to_numpy(weights)[0, :, :, 3:] < 1e-6)  # padding keys get no weight
    decoder = TransformerDecoderLayer(intermediate_dim=16, num_heads=2, dropout=0.0)
    out, self_weights, cross_weights = decoder.call_with_scores(
        x, enc, decoder_padding_mask=padding, encoder_padding_mask=enc_padding
    )
    full = decoder(x, enc, decoder_padding_mask=padding, encoder_padding_mask=enc_padding)
    np.testing.assert_allclose(to_numpy(out), to_numpy(full), rtol=1e-5, atol=1e-5)
    assert tuple(self_weights.shape) == (2, 2, 5, 5) and tuple(cross_weights.shape) == (2, 2, 5, 6)
    assert np.all(to_numpy(self_weights)[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] < 1e-6)
    assert np.all(to_numpy(cross_weights)[0, :, :, 4:] < 1e-6)


def test_dropout_is_applied_only_in_training(rng):
    layer = TransformerEncoderLayer(intermediate_dim=32, num_heads=2, dropout=0.5)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    inference = to_numpy(layer(x, training=False))
    np.testing.assert_allclose(inference, to_numpy(layer(x, training=False)))
    assert not np.allclose(inference, to_numpy(layer(x, training=True)))


def test_decoder_cached_steps_match_full_pass(rng):
    layer = TransformerDecoderLayer(intermediate_dim=32, num_heads=2, dropout=0.0, key_dim=3, value_dim=5)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    enc = rng.normal(size=(2, 6, 8)).astype("float32")
    full = to_numpy(layer(x, enc))
    cache = (np.zeros((2, 2, 5, 3), "float32"), np.zeros((2, 2, 5, 5), "float32"))  # [B, N, T_max, H]
    cross = layer.compute_cross_attention_cache(enc)
    for t in range(5):
        out, cache = layer.call_cached(x[:, t:t + 1], cache, t, cross)
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_windowed_decoder_sees_the_past_half_of_the_window(rng):
    """Causal and restricted (r = 5): position i sees i - 2, i - 1, i; cached steps agree."""
    layer = TransformerDecoderLayer(intermediate_dim=16, num_heads=2, dropout=0.0, attention_window=5)
    x = rng.normal(size=(1, 8, 8)).astype("float32")
    enc = rng.normal(size=(1, 3, 8)).astype("float32")
    full = to_numpy(layer(x, enc))
    for j in range(8):
        changed = x.copy()
        changed[0, j] += 1.0
        moved = np.abs(to_numpy(layer(changed, enc)) - full).max(-1)[0] > 1e-6  # which outputs changed
        np.testing.assert_array_equal(moved, [j <= i <= j + 2 for i in range(8)])
    cache = (np.zeros((1, 2, 8, 4), "float32"), np.zeros((1, 2, 8, 4), "float32"))
    cross = layer.compute_cross_attention_cache(enc)
    for t in range(8):
        out, cache = layer.call_cached(x[:, t:t + 1], cache, t, cross)
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_restricted_window_limits_what_the_encoder_sees(rng):
    layer = TransformerEncoderLayer(intermediate_dim=16, num_heads=2, dropout=0.0, attention_window=3)
    x = rng.normal(size=(1, 6, 8)).astype("float32")
    changed = x.copy()
    changed[0, 5] += 1.0  # positions 0..3 see 1 position each side, so not 5
    a, b = to_numpy(layer(x)), to_numpy(layer(changed))
    np.testing.assert_allclose(a[0, :4], b[0, :4], atol=1e-6)
    assert not np.allclose(a[0, 4:], b[0, 4:])


@pytest.mark.parametrize("layer_class", [TransformerEncoderLayer, TransformerDecoderLayer])
def test_config_round_trip(layer_class):
    layer = layer_class(intermediate_dim=64, num_heads=4, dropout=0.2, key_dim=8, value_dim=4,
                        normalize_first=True, attention_window=5)
    clone = layer_class.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


def test_heads_must_divide_hidden_size_without_explicit_head_sizes():
    with pytest.raises(ValueError, match="num_heads=3 must divide hidden_dim=8"):
        TransformerEncoderLayer(intermediate_dim=16, num_heads=3)(np.zeros((1, 2, 8), "float32"))
    # With explicit d_k and d_v any head count works (paper Table 3, rows A/B).
    out = TransformerEncoderLayer(intermediate_dim=16, num_heads=3, key_dim=4, value_dim=4)(np.zeros((1, 2, 8), "float32"))
    assert tuple(out.shape) == (1, 2, 8)
