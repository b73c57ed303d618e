import keras
import numpy as np
import pytest

from keras_transformer.losses import LabelSmoothedCrossEntropy

B, T, V = 3, 5, 11
EPS = 0.1


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _smoothed_targets(y_true, eps, vocabulary_size):
    """The smoothed distribution q, [B, T, V]: (1 - eps) one-hot + eps / V."""
    one_hot = np.eye(vocabulary_size)[y_true]
    return (1.0 - eps) * one_hot + eps / vocabulary_size


def reference_token_losses(y_true, logits, eps, pad_id=0):
    """Cross-entropy against the explicitly built smoothed distribution."""
    log_probs = _log_softmax(logits.astype("float64"))
    q = _smoothed_targets(y_true, eps, logits.shape[-1])
    losses = -(q * log_probs).sum(axis=-1)  # [B, T]
    mask = np.ones_like(y_true, bool) if pad_id is None else y_true != pad_id
    return np.where(mask, losses, 0.0), mask


def reference_loss(y_true, logits, eps, pad_id=0):
    losses, mask = reference_token_losses(y_true, logits, eps, pad_id)
    return losses.sum() / mask.sum()


def _data(seed=0, padded=True):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(B, T, V)).astype("float32")
    y_true = rng.integers(1, V, size=(B, T)).astype("int32")
    if padded:
        y_true[0, 3:] = 0  # 3 real tokens
        y_true[1, 1:] = 0  # 1 real token
    return y_true, logits


def _value(x):
    return keras.ops.convert_to_numpy(x)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_matches_numpy_reference(padded, eps):
    y_true, logits = _data(padded=padded)
    loss = LabelSmoothedCrossEntropy(label_smoothing=eps)(y_true, logits)
    assert tuple(loss.shape) == ()
    np.testing.assert_allclose(
        _value(loss), reference_loss(y_true, logits, eps), rtol=1e-5
    )


def test_reduction_is_mean_over_non_pad_tokens_not_over_batch():
    y_true, logits = _data(padded=True)
    losses, mask = reference_token_losses(y_true, logits, EPS)
    value = _value(LabelSmoothedCrossEntropy()(y_true, logits))
    np.testing.assert_allclose(value, losses.sum() / mask.sum(), rtol=1e-5)
    # Not the per-sentence mean, nor the mean over B * T positions.
    assert not np.isclose(value, losses.sum() / losses.size, rtol=1e-3)
    per_sentence = losses.sum(axis=1) / mask.sum(axis=1)
    assert not np.isclose(value, per_sentence.mean(), rtol=1e-3)


def test_equals_keras_categorical_crossentropy_on_one_hot_targets():
    y_true, logits = _data(padded=False)
    keras_loss = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=EPS
    )(np.eye(V, dtype="float32")[y_true], logits)
    ours = LabelSmoothedCrossEntropy(label_smoothing=EPS)(y_true, logits)
    np.testing.assert_allclose(_value(ours), _value(keras_loss), rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_zero_smoothing_equals_sparse_categorical_crossentropy(padded):
    y_true, logits = _data(padded=padded)
    # `ignore_class` makes Keras average over the non-ignored tokens too.
    sparse = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0 if padded else None
    )(y_true, logits)
    ours = LabelSmoothedCrossEntropy(label_smoothing=0.0)(y_true, logits)
    np.testing.assert_allclose(_value(ours), _value(sparse), rtol=1e-5)


def test_padding_does_not_change_the_value():
    y_true, logits = _data(padded=True)
    loss = LabelSmoothedCrossEntropy()
    value = _value(loss(y_true, logits))
    # Different logits at padded positions.
    noisy = logits.copy()
    noisy[y_true == 0] = 1e3 * np.random.default_rng(1).normal(
        size=noisy[y_true == 0].shape
    )
    np.testing.assert_allclose(_value(loss(y_true, noisy)), value, rtol=1e-6)
    # Extra all-padding time steps.
    y_long = np.pad(y_true, ((0, 0), (0, 4)))
    logits_long = np.pad(logits, ((0, 0), (0, 4), (0, 0)), constant_values=7.0)
    np.testing.assert_allclose(_value(loss(y_long, logits_long)), value, rtol=1e-6)


def test_pad_id_is_configurable():
    y_true, logits = _data(padded=False)
    y_true[:, -2:] = 4
    value = LabelSmoothedCrossEntropy(pad_id=4)(y_true, logits)
    np.testing.assert_allclose(
        _value(value), reference_loss(y_true, logits, EPS, pad_id=4), rtol=1e-5
    )
    all_tokens = LabelSmoothedCrossEntropy(pad_id=None)(y_true, logits)
    np.testing.assert_allclose(
        _value(all_tokens), reference_loss(y_true, logits, EPS, None), rtol=1e-5
    )


def test_reductions_and_sample_weight():
    y_true, logits = _data(padded=True)
    losses, mask = reference_token_losses(y_true, logits, EPS)
    per_token = LabelSmoothedCrossEntropy(reduction=None)(y_true, logits)
    assert tuple(per_token.shape) == (B, T)
    np.testing.assert_allclose(_value(per_token), losses, rtol=1e-5, atol=1e-6)
    assert np.all(_value(per_token)[~mask] == 0.0)

    summed = LabelSmoothedCrossEntropy(reduction="sum")(y_true, logits)
    np.testing.assert_allclose(_value(summed), losses.sum(), rtol=1e-5)

    weights = np.array([1.0, 0.0, 2.0], "float32")  # [B]
    weighted = LabelSmoothedCrossEntropy()(y_true, logits, sample_weight=weights)
    np.testing.assert_allclose(
        _value(weighted), (losses * weights[:, None]).sum() / mask.sum(), rtol=1e-5
    )
    weighted_mean = LabelSmoothedCrossEntropy(reduction="mean_with_sample_weight")(
        y_true, logits, sample_weight=weights[:, None] * np.ones((B, T), "float32")
    )
    np.testing.assert_allclose(
        _value(weighted_mean),
        (losses * weights[:, None]).sum() / (mask * weights[:, None]).sum(),
        rtol=1e-5,
    )


def test_all_padding_gives_zero_not_nan():
    _, logits = _data()
    value = LabelSmoothedCrossEntropy()(np.zeros((B, T), "int32"), logits)
    assert _value(value) == 0.0


def test_mixed_precision_logits_compute_in_float32():
    y_true, logits = _data(padded=True)
    for dtype in ("float16", "bfloat16"):
        low = keras.ops.cast(logits, dtype)
        value = LabelSmoothedCrossEntropy()(y_true, low)
        assert keras.backend.standardize_dtype(value.dtype) == "float32"
        reference = reference_loss(
            y_true, keras.ops.convert_to_numpy(keras.ops.cast(low, "float32")), EPS
        )
        np.testing.assert_allclose(_value(value), reference, rtol=1e-5)


def test_config_round_trip():
    loss = LabelSmoothedCrossEntropy(label_smoothing=0.2, pad_id=3, name="ls")
    config = loss.get_config()
    assert config["label_smoothing"] == 0.2
    assert config["pad_id"] == 3
    assert config["from_logits"] is True
    restored = LabelSmoothedCrossEntropy.from_config(config)
    assert restored.get_config() == config

    serialized = keras.saving.serialize_keras_object(loss)
    assert serialized["registered_name"] == "keras_transformer>LabelSmoothedCrossEntropy"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(restored, LabelSmoothedCrossEntropy)
    assert restored.get_config() == config
    y_true, logits = _data()
    np.testing.assert_allclose(
        _value(restored(y_true, logits)), _value(loss(y_true, logits)), rtol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"from_logits": False}, "from_logits=False"),
        ({"label_smoothing": 1.0}, r"label_smoothing=1.0 must be a float in \[0, 1\)"),
        ({"label_smoothing": -0.1}, r"label_smoothing=-0.1"),
        ({"pad_id": -1}, "pad_id=-1"),
        ({"reduction": "median"}, "reduction='median'"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LabelSmoothedCrossEntropy(**kwargs)


def _gradient(fn, x):
    """d fn(x) / dx as NumPy, on the current backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x).numpy()
    if backend == "jax":
        import jax

        return np.asarray(jax.grad(fn)(x))
    if backend == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        fn(x).backward()
        return x.grad.numpy()
    pytest.skip(f"no gradient helper for backend {backend!r}")


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_gradients_are_finite_and_match_analytic(scale):
    y_true, logits = _data(padded=True)
    logits = logits * scale  # 1e4: saturated softmax must stay finite
    loss = LabelSmoothedCrossEntropy()
    grad = _gradient(lambda z: loss(y_true, z), logits)
    assert np.all(np.isfinite(grad))
    # d loss / d logits = (softmax - q) / num_tokens at real tokens, 0 at padding.
    mask = y_true != 0
    softmax = np.exp(_log_softmax(logits.astype("float64")))
    expected = (softmax - _smoothed_targets(y_true, EPS, V)) / mask.sum()
    expected[~mask] = 0.0
    np.testing.assert_allclose(grad, expected, atol=1e-6)


def _embedding_model(weights):
    # Logits straight from an embedding table: easy to differentiate by hand.
    model = keras.Sequential(
        [keras.Input(shape=(T,), dtype="int32"), keras.layers.Embedding(V, V)]
    )
    model.layers[0].set_weights([weights])
    return model


def test_model_fit_and_evaluate_use_the_token_mean():
    rng = np.random.default_rng(2)
    weights = rng.normal(size=(V, V)).astype("float32")
    x = rng.integers(0, V, size=(B, T)).astype("int32")
    y_true, _ = _data(padded=True)
    logits = weights[x]  # [B, T, V]
    loss = LabelSmoothedCrossEntropy()

    model = _embedding_model(weights)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss=loss)
    evaluated = model.evaluate(x, y_true, batch_size=B, verbose=0)
    np.testing.assert_allclose(evaluated, reference_loss(y_true, logits, EPS), rtol=1e-5)

    # One SGD step: the update is exactly the gradient of the token mean.
    history = model.fit(x, y_true, batch_size=B, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        history.history["loss"][0], reference_loss(y_true, logits, EPS), rtol=1e-5
    )
    mask = y_true != 0
    softmax = np.exp(_log_softmax(logits.astype("float64")))
    logit_grad = (softmax - _smoothed_targets(y_true, EPS, V)) / mask.sum()
    logit_grad[~mask] = 0.0
    table_grad = np.zeros((V, V))
    np.add.at(table_grad, x, logit_grad)
    np.testing.assert_allclose(
        model.layers[0].get_weights()[0], weights - table_grad, atol=1e-5
    )


def _gradients(fn, *xs):
    """`(fn(*xs), [d fn / d x for x in xs])` as NumPy, on the current backend; `fn` returns a scalar."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        xs = [tf.constant(x) for x in xs]
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            y = fn(*xs)
        return y.numpy(), [g.numpy() for g in tape.gradient(y, xs)]
    if backend == "jax":
        import jax

        value, grads = jax.value_and_grad(fn, argnums=tuple(range(len(xs))))(*xs)
        return np.asarray(value), [np.asarray(g) for g in grads]
    import torch

    xs = [torch.tensor(x, requires_grad=True) for x in xs]
    y = fn(*xs)
    y.backward()
    # PyTorch leaves `grad` None where no gradient flowed.
    return y.detach().numpy(), [np.zeros(x.shape, "float32") if x.grad is None else x.grad.numpy() for x in xs]


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [4, 15, 64])
def test_fused_output_losses_equal_the_projection_then_the_loss(eps, with_bias, chunk_rows):
    """Value, accuracy and the three gradients against NumPy in float64, chunks that do and do not divide N."""
    from keras_transformer.losses import fused_output_losses

    rng = np.random.default_rng(3)
    n, d, v = 15, 6, 23
    hidden = rng.normal(size=(n, d)).astype("float32")
    embeddings = rng.normal(size=(v, d)).astype("float32")
    bias = rng.normal(size=(v,)).astype("float32")
    labels = rng.integers(0, v, size=(n,)).astype("int32")
    mask = (labels != 0).astype("float32")
    weights = mask * rng.uniform(0.5, 2.0, size=(n,)).astype("float32")  # sample weights on the real tokens

    def total(h, w, *b):
        return fused_output_losses(h, w, b[0] if b else None, labels, weights, mask, eps, chunk_rows=chunk_rows)[0]

    _, correct, predictions = fused_output_losses(
        hidden, embeddings, bias if with_bias else None, labels, weights, mask, eps, chunk_rows=chunk_rows)
    value, grads = _gradients(total, hidden, embeddings, *((bias,) if with_bias else ()))
    z = hidden.astype("float64") @ embeddings.T.astype("float64") + (bias if with_bias else 0.0)
    log_probs = _log_softmax(z)
    q = _smoothed_targets(labels, eps, v)
    np.testing.assert_allclose(value, (weights * -(q * log_probs).sum(-1)).sum(), rtol=1e-5)
    dz = weights[:, None] * (np.exp(log_probs) - q)
    np.testing.assert_allclose(grads[0], dz @ embeddings, atol=1e-5)
    np.testing.assert_allclose(grads[1], dz.T @ hidden, atol=1e-5)
    if with_bias:
        np.testing.assert_allclose(grads[2], dz.sum(0), atol=1e-5)
    np.testing.assert_array_equal(_value(predictions), z.argmax(-1))
    assert _value(correct) == (mask * (z.argmax(-1) == labels)).sum()


@pytest.mark.parametrize("n", [13, 16])
def test_fused_output_losses_in_bfloat16_with_a_float32_matrix(n):
    """Mixed precision: bfloat16 rows, the float32 matrix and bias; 7 and 8 chunks of 2 rows (the embedding
    gradient's bfloat16 sums go to float32 every `MIXED_GRADIENT_CHUNKS` chunks and after the last). Within
    bfloat16's rounding of float64 from the same bfloat16 values."""
    from keras_transformer.losses import MIXED_GRADIENT_CHUNKS, fused_output_losses

    assert MIXED_GRADIENT_CHUNKS == 4  # the chunk counts above straddle it
    rng = np.random.default_rng(6)
    d, v = 8, 29
    hidden = rng.normal(size=(n, d)).astype("float32")
    embeddings = rng.normal(size=(v, d)).astype("float32") * 0.5
    bias = rng.normal(size=(v,)).astype("float32")
    labels = rng.integers(0, v, size=(n,)).astype("int32")
    weights = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")

    def total(h, w, b):
        return fused_output_losses(keras.ops.cast(h, "bfloat16"), w, b, labels, weights, weights, 0.1, chunk_rows=2)[0]

    value, (dh, dw, db) = _gradients(total, hidden, embeddings, bias)
    h, w = (np.asarray(_value(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32")), "float64")
            for x in (hidden, embeddings))
    z = h @ w.T + bias
    log_probs = _log_softmax(z)
    q = _smoothed_targets(labels, 0.1, v)
    dz = weights[:, None] * (np.exp(log_probs) - q)
    np.testing.assert_allclose(value, (weights * -(q * log_probs).sum(-1)).sum(), rtol=2e-2)
    for got, want in ((dh, dz @ w), (dw, dz.T @ h), (db, dz.sum(0))):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_fused_output_losses_predict_the_first_of_equal_maxima():
    """Tied logits (duplicate embedding rows): the prediction is the first of them, as `argmax`'s."""
    from keras_transformer.losses import fused_output_losses

    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(12, 5)).astype("float32")
    embeddings = rng.normal(size=(9, 5)).astype("float32") * 0.1
    embeddings[7] = 1.0
    embeddings[[2, 5, 8]] = embeddings[7]  # four equal columns of logits: 2, 5, 7 and 8
    hidden[:6] = embeddings[7] * 10.0  # rows whose maximum is one of the tied columns
    labels = np.array([2, 5, 7, 8, 2, 0, 1, 2, 3, 4, 5, 6], "int32")
    ones = np.ones(12, "float32")
    z = hidden @ embeddings.T
    assert (z[:6, [2, 5, 7, 8]] == z[:6].max(-1, keepdims=True)).all()
    _, correct, predictions = fused_output_losses(hidden, embeddings, None, labels, ones, ones, 0.1, 5)
    np.testing.assert_array_equal(_value(predictions), z.argmax(-1))
    assert (_value(predictions)[:6] == 2).all()
    assert _value(correct) == (z.argmax(-1) == labels).sum()


def test_fused_output_losses_without_the_embedding_gradient():
    """A frozen output matrix (LoRA) gets zeros and the rows their full gradient."""
    from keras_transformer.losses import fused_output_losses

    rng = np.random.default_rng(4)
    hidden = rng.normal(size=(9, 4)).astype("float32")
    embeddings = rng.normal(size=(13, 4)).astype("float32")
    labels = rng.integers(1, 13, size=(9,)).astype("int32")
    ones = np.ones(9, "float32")

    def total(frozen):
        return lambda h, w: fused_output_losses(h, w, None, labels, ones, ones, 0.1, 4, embedding_gradient=not frozen)[0]

    value, (dh, dw) = _gradients(total(False), hidden, embeddings)
    frozen_value, (frozen_dh, frozen_dw) = _gradients(total(True), hidden, embeddings)
    np.testing.assert_allclose(frozen_value, value, rtol=1e-6)
    np.testing.assert_allclose(frozen_dh, dh, rtol=1e-6)
    assert not np.any(frozen_dw) and np.any(dw)


def test_vocabulary_argmax_is_numpy_s_argmax():
    """The first of equal maxima, -0.0 tying 0.0 included (Keras' `ops.argmax` on TensorFlow picks the 0.0)."""
    from keras_transformer.losses import vocabulary_argmax

    rng = np.random.default_rng(3)
    z = rng.normal(size=(2, 5, 11)).astype("float32")
    z[0, 1, [3, 6, 9]] = 5.0  # tied maxima: the first, 3
    z[1, 2] = -1.0
    z[1, 2, 4], z[1, 2, 7] = -0.0, 0.0  # numpy: -0.0 == 0.0, so the first, 4
    predictions = _value(vocabulary_argmax(z))
    assert predictions.dtype == np.int32
    np.testing.assert_array_equal(predictions, z.argmax(-1))
    assert predictions[0, 1] == 3 and predictions[1, 2] == 4
