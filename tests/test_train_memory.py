"""What a training step holds: on JAX the compiled step donates the weights and the optimizer state."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer import training


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="buffer donation is JAX's")
def test_a_jax_step_donates_weights_and_optimizer_state():
    import jax

    model = kt.TransformerModel(vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32)
    training.compile_model(model)
    x = {"encoder_token_ids": np.full((2, 5), 5, "int32"), "decoder_token_ids": np.full((2, 4), 6, "int32")}
    y = np.full((2, 4), 7, "int32")
    model.train_on_batch(x, y)
    held = [v.value for v in model.trainable_variables + model.optimizer.variables]
    live = len(jax.live_arrays())
    model.train_on_batch(x, y)
    # Donated: the step wrote its results into the old buffers' place, so none of them is alive twice.
    assert all(array.is_deleted() for array in held)
    assert len(jax.live_arrays()) == live
