"""Shared test helpers. The backend comes from KERAS_BACKEND (tensorflow, jax, torch)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def tiny_model(**overrides):
    """A small deterministic model for tests; dropout 0 unless overridden."""
    import keras_transformer as kt

    keras.utils.set_random_seed(overrides.pop("seed", 1234))
    config = dict(
        vocabulary_size=50, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=64,
    )
    config.update(overrides)
    return kt.TransformerModel(**config)


def random_ids(rng, batch, length, vocabulary_size=50, low=4):
    """Ids in [low, vocabulary_size), i.e. no special ids."""
    return rng.integers(low, vocabulary_size, size=(batch, length)).astype("int32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_report_header(config):
    return f"keras backend: {BACKEND}"
