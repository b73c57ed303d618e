"""A fused training step (the output projection and the loss together) equals Keras' own step."""

import keras
import numpy as np
import pytest

from conftest import random_ids, tiny_model, to_numpy
from keras_transformer import fused_training, training
from keras_transformer.losses import LabelSmoothedCrossEntropy


def _batches(seed=0, count=3):
    rng = np.random.default_rng(seed)
    batches = []
    # On TensorFlow a second shape retraces the step with an unknown row count (the loss's chunks are then
    # sized at run time); JAX and PyTorch run the same code at any shape, and JAX compiles each one (slow).
    lengths = (7, 5, 9) if keras.backend.backend() == "tensorflow" else (7, 7, 7)
    for length in lengths[:count]:
        source = random_ids(rng, 4, length + 1)
        target = random_ids(rng, 4, length + 1)
        target[1, length - 2:] = 0  # padding in the targets
        source[2, 3:] = 0
        batches.append(({"encoder_token_ids": source, "decoder_token_ids": target[:, :-1]}, target[:, 1:]))
    return batches


def _train(fuse, batches, sample_weight=None, optimizer="sgd", **overrides):
    model = tiny_model(**overrides)
    model.fuse_output_loss = fuse
    if optimizer == "sgd":
        # SGD moves each weight by its gradient times 0.5: equal steps give equal weights.
        # (Adam would turn a gradient that is 0 up to rounding into a full step of either sign.)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=LabelSmoothedCrossEntropy(0.1),
                      metrics=[training.masked_accuracy])
    else:
        training.compile_model(model, warmup_steps=4, label_smoothing=0.1)
    logs = [model.train_on_batch(x, y, sample_weight=sample_weight, return_dict=True) for x, y in batches]
    return model, logs


@pytest.mark.parametrize("overrides", [
    {},
    {"logits_bias": True, "normalize_first": True, "activation": "silu"},
    {"vocabulary_size": 53},  # chunks of 16 rows or more, never dividing the batch
])
def test_a_fused_step_trains_as_keras_step_does(overrides):
    batches = _batches()
    fused, fused_logs = _train(True, batches, **overrides)
    plain, plain_logs = _train(False, batches, **overrides)
    for a, b in zip(fused_logs, plain_logs):
        assert a.keys() == b.keys() == {"loss", "masked_accuracy"}
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["masked_accuracy"], b["masked_accuracy"], rtol=1e-6)
    for a, b in zip(fused.weights, plain.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=2e-6, err_msg=a.path)


def test_the_paper_s_optimizer_gives_the_same_losses():
    batches = _batches()
    _, fused_logs = _train(True, batches, optimizer="adam")
    _, plain_logs = _train(False, batches, optimizer="adam")
    for a, b in zip(fused_logs, plain_logs):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
        np.testing.assert_allclose(a["masked_accuracy"], b["masked_accuracy"], rtol=1e-6)


def test_sample_weights_and_evaluate():
    batches = _batches(count=1)
    weights = np.array([1.0, 0.5, 2.0, 0.0], "float32")
    fused, fused_logs = _train(True, batches, sample_weight=weights)
    plain, plain_logs = _train(False, batches, sample_weight=weights)
    np.testing.assert_allclose(fused_logs[0]["loss"], plain_logs[0]["loss"], rtol=1e-5)
    x, y = batches[0]
    np.testing.assert_allclose(fused.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5)


def test_the_step_is_fused_and_other_calls_give_logits(monkeypatch):
    calls = []
    real = fused_training.compute_loss
    monkeypatch.setattr(fused_training, "compute_loss", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    x, y = _batches(count=1)[0]
    model, _ = _train(True, [(x, y)])
    assert calls and calls[0][-1] == model.hidden_dim  # the loss received hidden states
    logits = model(x, training=True)  # outside a step: logits
    assert tuple(logits.shape) == (4, 7, model.vocabulary_size)


@pytest.mark.parametrize("change, reason", [
    (lambda m: setattr(m, "fuse_output_loss", False), "fuse_output_loss is False"),
    (lambda m: m.compile(optimizer="adam", loss=LabelSmoothedCrossEntropy(),
                         metrics=["sparse_categorical_accuracy"]), "needs the logits"),
    (lambda m: m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
     "not LabelSmoothedCrossEntropy"),
])
def test_keras_path_when_the_step_cannot_be_fused(change, reason):
    model = tiny_model()
    model.fuse_output_loss = True
    training.compile_model(model)
    assert fused_training.why_not_fused(model) is None
    change(model)
    assert reason in fused_training.why_not_fused(model)
    x, y = _batches(count=1)[0]
    logs = model.train_on_batch(x, y, return_dict=True)  # trains, on Keras' path
    assert np.isfinite(logs["loss"])


def test_auto_fuses_on_every_backend():
    model = tiny_model()
    training.compile_model(model)
    assert model.fuse_output_loss == "auto"
    assert fused_training.why_not_fused(model) is None


def test_per_token_losses_are_not_fused():
    model = tiny_model()
    model.fuse_output_loss = True
    model.compile(optimizer="adam", loss=LabelSmoothedCrossEntropy(reduction="none"))
    assert "'none'" in fused_training.why_not_fused(model)


def test_a_frozen_embedding_stays_frozen():
    x, y = _batches(count=1)[0]
    model = tiny_model()
    model.fuse_output_loss = True
    model.token_embedding.trainable = False
    training.compile_model(model)
    before = to_numpy(model.token_embedding.embeddings)
    model.train_on_batch(x, y)
    np.testing.assert_array_equal(to_numpy(model.token_embedding.embeddings), before)


def test_mixed_bfloat16_steps_agree():
    """bfloat16 products, float32 loss: the fused step within bfloat16's rounding of Keras' step."""
    batches = _batches()
    _, fused_logs = _train(True, batches, dtype="mixed_bfloat16")
    _, plain_logs = _train(False, batches, dtype="mixed_bfloat16")
    for a, b in zip(fused_logs, plain_logs):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=2e-2)


@pytest.mark.parametrize("logits_bias", [False, True])
def test_mixed_bfloat16_logits(logits_bias):
    """Mixed precision: float32 logits from the bfloat16 product, within its rounding of the float32 model's."""
    x, _ = _batches(count=1)[0]
    exact = tiny_model(logits_bias=logits_bias)
    mixed = tiny_model(logits_bias=logits_bias, dtype="mixed_bfloat16")
    mixed(x)
    mixed.set_weights(exact.get_weights())
    expected, logits = to_numpy(exact(x)), mixed(x)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    np.testing.assert_allclose(to_numpy(logits), expected, atol=0.05 * np.abs(expected).max())
