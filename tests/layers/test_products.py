"""The bfloat16 products JAX's CPU backend runs on AMX (`layers.products`) compute Keras' products."""

import keras
import numpy as np
import pytest

from conftest import random_ids, tiny_model, to_numpy
from keras_transformer.generation import generate
from keras_transformer.layers import products

on_amx = pytest.mark.skipif(not products.jax_cpu_with_amx(), reason="JAX's CPU backend on a CPU with amx_bf16 only")


def _bfloat16(rng, *shape):
    """Random values that bfloat16 holds exactly, as float32 and as bfloat16 tensors."""
    values = to_numpy(keras.ops.cast(keras.ops.cast(rng.normal(size=shape), "bfloat16"), "float32"))
    return values, keras.ops.cast(values, "bfloat16")


@pytest.mark.parametrize("form", ["nn", "nt", "tn"])
def test_the_three_forms_in_float32_are_keras_products(rng, form):
    a, b = rng.normal(size=(6, 4)).astype("float32"), rng.normal(size=(6, 4) if form != "nn" else (4, 5))
    b = b.astype("float32")
    expected = {"nn": lambda: a @ b, "nt": lambda: a @ b.T, "tn": lambda: a.T @ b}[form]()
    np.testing.assert_allclose(to_numpy(getattr(products, form)(a, b, "float32")), expected, rtol=1e-5)


def _skip_unless_fast_forms(dtype):
    if not products.jax_cpu():
        pytest.skip("JAX's CPU backend only")
    if dtype == "bfloat16" and not products.jax_cpu_with_amx():
        pytest.skip("bfloat16: a CPU with amx_bf16 only")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shapes", [
    ((37, 16), (16, 24)),
    ((3, 5, 16), (16, 24)),  # [B, T, D] inputs
    ((1, 16), (16, 24)),  # one row, as a decoding step of one sentence
    ((6, 40), (40, 8)),  # the gradient's product transposes the narrower operand, the upstream here
])
def test_products_and_their_gradients_are_keras_ones(rng, shapes, dtype):
    """In bfloat16, each value is the float32 product of the same bfloat16 inputs, rounded once to bfloat16."""
    _skip_unless_fast_forms(dtype)
    import jax
    import jax.numpy as jnp

    (x, x_in), (kernel, kernel_in) = _bfloat16(rng, *shapes[0]), _bfloat16(rng, *shapes[1])
    bias, bias_in = _bfloat16(rng, shapes[1][1])
    upstream = _bfloat16(rng, *shapes[0][:-1], shapes[1][1])[0]
    if dtype == "float32":
        x_in, kernel_in, bias_in = x, kernel, bias

    def reference(x, kernel, bias):
        return jnp.sum((x @ kernel + bias) * upstream)

    def ours(x, kernel, bias):
        y = products.matmul(x, kernel, bias)
        assert y.dtype == dtype
        return jnp.sum(y.astype("float32") * upstream)

    tolerance = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-2, atol=2e-2)}[dtype]
    expected = jax.grad(reference, argnums=(0, 1, 2))(x, kernel, bias)
    actual = jax.grad(ours, argnums=(0, 1, 2))(x_in, kernel_in, bias_in)
    np.testing.assert_allclose(to_numpy(products.matmul(x_in, kernel_in, bias_in)).astype("float32"),
                               x @ kernel + bias, **tolerance)
    for name, a, e in zip(("x", "kernel", "bias"), actual, expected):
        assert a.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(a, "float32"), e, err_msg=name, **tolerance)


@on_amx
@pytest.mark.parametrize("widths", [(8, 40), (40, 8)])  # either operand the narrower: transposed either way
def test_a_sum_over_rows_transposes_either_operand(rng, widths):
    (a, a16), (b, b16) = _bfloat16(rng, 50, widths[0]), _bfloat16(rng, 50, widths[1])
    np.testing.assert_allclose(to_numpy(products.tn(a16, b16, "float32")), a.T @ b, rtol=1e-5, atol=1e-5)


@on_amx
def test_no_rows_give_zeros(rng):
    _, a16 = _bfloat16(rng, 0, 8)
    _, b16 = _bfloat16(rng, 0, 5)
    np.testing.assert_array_equal(to_numpy(products.tn(a16, b16, "float32")), np.zeros((8, 5)))


@on_amx
def test_a_bfloat16_model_computes_and_decodes_as_keras_products_do(rng, monkeypatch):
    """The model's logits within bfloat16's rounding of Keras' own products; beam search runs on them."""
    src = random_ids(rng, 3, 7)
    tgt = random_ids(rng, 3, 6)
    inputs = {"encoder_token_ids": src, "decoder_token_ids": tgt}
    ours = tiny_model(dtype="mixed_bfloat16", logits_bias=True)
    logits = to_numpy(ours(inputs))
    ids = generate(ours, src, beam_size=2, max_extra_length=4)
    monkeypatch.setattr(products, "jax_cpu_with_amx", lambda: False)  # Keras' products from here on
    keras_products = tiny_model(dtype="mixed_bfloat16", logits_bias=True)
    keras_products(inputs)
    keras_products.set_weights(ours.get_weights())
    expected = to_numpy(keras_products(inputs))
    np.testing.assert_allclose(logits, expected, atol=0.02 * np.abs(expected).max())
    assert ids.shape[0] == 3 and ids.shape[1] >= 2


def test_a_distribution_keeps_keras_products(monkeypatch):
    """Under a `keras.distribution` the rows may be sharded: `rows_first` would gather them, so Keras' ops run."""
    _skip_unless_fast_forms("float32")
    x = np.ones((4, 3), "float32")
    assert products.in_fast_forms(x)
    monkeypatch.setattr(keras.distribution, "distribution", lambda: object())
    assert not products.in_fast_forms(x)
