"""InPlaceAdam: Keras' Adam, updated in place."""

import keras
import numpy as np
import pytest

from keras_transformer.optimizers import InPlaceAdam
from keras_transformer.schedules import WarmupSchedule


def _trained(optimizer_class, steps=5, **kwargs):
    """A small model after `steps` updates; its weights and the optimizer's variables."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
    model.compile(
        optimizer=optimizer_class(
            learning_rate=WarmupSchedule(64, warmup_steps=10, scale=10.0), beta_1=0.9, beta_2=0.98, epsilon=1e-9,
            **kwargs,
        ),
        loss="mse",
    )
    rng = np.random.default_rng(0)
    for _ in range(steps):
        model.train_on_batch(rng.normal(size=(4, 5)).astype("float32"), rng.normal(size=(4, 3)).astype("float32"))
    return model


@pytest.mark.parametrize("accumulation", [None, 2])
def test_updates_equal_keras_adam(accumulation):
    ours = _trained(InPlaceAdam, gradient_accumulation_steps=accumulation)
    reference = _trained(keras.optimizers.Adam, gradient_accumulation_steps=accumulation)
    assert [tuple(v.shape) for v in ours.optimizer.variables] == [tuple(v.shape) for v in reference.optimizer.variables]
    for a, b in zip(ours.get_weights() + ours.optimizer.variables, reference.get_weights() + reference.optimizer.variables):
        # The same formula in another order of operations: float32 rounding apart.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # The updates moved the weights (the comparison above is not between two untrained models).
    untrained = _trained(InPlaceAdam, steps=0)
    assert not np.allclose(ours.get_weights()[0], untrained.get_weights()[0], atol=1e-3)


def test_a_keras_adam_checkpoint_resumes_with_in_place_adam(tmp_path):
    """Resume points written before InPlaceAdam (with keras.optimizers.Adam) load and continue the same."""
    reference = _trained(keras.optimizers.Adam, steps=3)
    reference.save_weights(str(tmp_path / "resume.weights.h5"))
    ours = _trained(InPlaceAdam, steps=0)
    ours.optimizer.build(ours.trainable_variables)
    ours.load_weights(str(tmp_path / "resume.weights.h5"))
    assert int(np.asarray(ours.optimizer.iterations)) == 3
    for a, b in zip(ours.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        InPlaceAdam(amsgrad=True)


def test_config_round_trip():
    optimizer = InPlaceAdam(learning_rate=1e-3, beta_2=0.98, epsilon=1e-9)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, InPlaceAdam)
    assert restored.beta_2 == 0.98 and restored.epsilon == 1e-9
