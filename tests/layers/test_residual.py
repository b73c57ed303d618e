import keras
import numpy as np
import pytest

from conftest import to_numpy
from keras_transformer.layers.residual import residual_connection


@pytest.mark.parametrize("normalize_first", [False, True])
def test_residual_connection_is_the_papers_or_pre_ln(rng, normalize_first):
    x = rng.normal(size=(2, 3, 4)).astype("float32")
    w = rng.normal(size=(4, 4)).astype("float32")
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    norm.build((None, None, 4))
    norm.set_weights([rng.normal(size=4).astype("float32"), rng.normal(size=4).astype("float32")])
    gamma, beta = norm.get_weights()
    dropout = keras.layers.Dropout(0.5)

    def layer_norm(y):
        return (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-5) * gamma + beta

    out = to_numpy(residual_connection(x, lambda y: keras.ops.matmul(y, w), norm, dropout, normalize_first))
    # Dropout is off outside training; post-LN LayerNorm(x + Sublayer(x)), pre-LN x + Sublayer(LayerNorm(x)).
    expected = x + layer_norm(x) @ w if normalize_first else layer_norm(x + x @ w)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
