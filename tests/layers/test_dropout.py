"""The project's Dropout: Keras' inverted dropout, with its own masks on JAX and PyTorch."""

import keras
import numpy as np
import pytest

from conftest import to_numpy
from keras_transformer.layers.dropout import Dropout

SIZE = (1000, 1000)


def _draw(layer, x):
    return to_numpy(layer(x, training=True))


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_drops_at_the_rate_and_scales_the_rest(rate):
    x = np.random.default_rng(0).uniform(1.0, 2.0, SIZE).astype("float32")  # no zeros of its own
    y = _draw(Dropout(rate, seed=1), x)
    dropped = y == 0.0
    # 10^6 Bernoulli draws: the standard deviation of the fraction is < 5e-4.
    assert abs(dropped.mean() - rate) < 2.5e-3
    np.testing.assert_allclose(y[~dropped], x[~dropped] / (1.0 - rate), rtol=1e-6)


def test_successive_masks_and_layers_are_independent():
    x = np.ones(SIZE, "float32")
    layer = Dropout(0.1, seed=1)
    first, second = _draw(layer, x) == 0.0, _draw(layer, x) == 0.0
    other = _draw(Dropout(0.1, seed=2), x) == 0.0
    assert not np.array_equal(first, second)
    # Independent masks are both dropped at 0.1 * 0.1; a shifted or repeated stream would not be.
    assert abs((first & second).mean() - 0.01) < 1e-3
    assert abs((first & other).mean() - 0.01) < 1e-3
    assert abs((first[:, 1:] & first[:, :-1]).mean() - 0.01) < 1e-3


def test_a_seed_repeats_its_masks():
    x = np.ones((64, 64), "float32")
    a, b = Dropout(0.1, seed=7), Dropout(0.1, seed=7)
    for _ in range(2):
        np.testing.assert_array_equal(_draw(a, x), _draw(b, x))


def test_inference_rate_zero_and_one():
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_array_equal(to_numpy(Dropout(0.1)(x, training=False)), x)
    np.testing.assert_array_equal(to_numpy(Dropout(0.0)(x, training=True)), x)
    np.testing.assert_array_equal(to_numpy(Dropout(1.0)(x, training=True)), np.zeros_like(x))


def test_keeps_the_dtype_and_noise_shape_takes_keras_path():
    x = keras.ops.ones((8, 16), dtype="bfloat16")
    y = Dropout(0.5, seed=1, dtype="mixed_bfloat16")(x, training=True)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    values = np.unique(to_numpy(keras.ops.cast(y, "float32")))
    assert set(values) <= {0.0, 2.0}
    shared = to_numpy(Dropout(0.5, noise_shape=(8, 1), seed=1)(np.ones((8, 16), "float32"), training=True))
    assert all(len(np.unique(row)) == 1 for row in shared)  # one draw per row


def test_gradient_is_the_mask_times_the_scale():
    layer = Dropout(0.25, seed=3)
    x = np.random.default_rng(0).uniform(1.0, 2.0, (32, 32)).astype("float32")
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        xt = torch.tensor(x, requires_grad=True)
        y = layer(xt, training=True)
        y.sum().backward()
        gradient, output = xt.grad.numpy(), y.detach().numpy()
    elif backend == "jax":
        import jax

        state = layer.seed_generator.state.value
        layer2 = Dropout(0.25, seed=3)
        output = _draw(layer2, x)

        def total(v):
            # The same first draw: the layer's state as the twin's was.
            layer.seed_generator.state.assign(state)
            return layer(v, training=True).sum()

        gradient = np.asarray(jax.grad(total)(x))
    else:
        import tensorflow as tf

        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, training=True)
            s = tf.reduce_sum(y)
        gradient, output = tape.gradient(s, xt).numpy(), y.numpy()
    np.testing.assert_allclose(gradient, np.where(output == 0.0, 0.0, 1 / 0.75), rtol=1e-6)
