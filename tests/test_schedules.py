import keras
import numpy as np
import pytest

from keras_transformer.schedules import WarmupSchedule
from keras_transformer.schedules import WarmupScheduleCallback
from keras_transformer.schedules import warmup_learning_rate

HIDDEN_DIM = 512
WARMUP = 4000


def paper_lrate(step, d_model=HIDDEN_DIM, warmup_steps=WARMUP, scale=1.0):
    """Eq. 3 of the paper, 1-based step, in float64."""
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def _value(x):
    return float(keras.ops.convert_to_numpy(x))


@pytest.mark.parametrize("step", [1, 100, 4000, 4001, 100000])
def test_function_matches_the_paper(step):
    np.testing.assert_allclose(
        _value(warmup_learning_rate(step, HIDDEN_DIM, WARMUP)),
        paper_lrate(step),
        rtol=1e-6,
    )


def test_function_accepts_numpy_arrays_and_scale():
    steps = np.array([1, 100, 4000, 4001, 100000])
    values = keras.ops.convert_to_numpy(warmup_learning_rate(steps, 256, 1000, 2.0))
    expected = [paper_lrate(s, 256, 1000, 2.0) for s in steps]
    np.testing.assert_allclose(values, expected, rtol=1e-6)


@pytest.mark.parametrize("step", [1, 100, 4000, 4001, 100000])
def test_schedule_uses_one_based_step(step):
    schedule = WarmupSchedule(hidden_dim=HIDDEN_DIM, warmup_steps=WARMUP)
    # Keras passes the 0-based iteration count.
    np.testing.assert_allclose(_value(schedule(step - 1)), paper_lrate(step), rtol=1e-6)


def test_first_update_has_a_positive_rate():
    assert _value(WarmupSchedule(HIDDEN_DIM)(0)) == pytest.approx(paper_lrate(1), rel=1e-6)
    assert paper_lrate(1) > 0


def test_peak_is_at_the_end_of_warmup():
    schedule = WarmupSchedule(hidden_dim=HIDDEN_DIM, warmup_steps=WARMUP)
    iterations = np.arange(0, 3 * WARMUP)
    values = keras.ops.convert_to_numpy(schedule(iterations))
    assert int(np.argmax(values)) + 1 == WARMUP  # 1-based step of the peak
    np.testing.assert_allclose(values.max(), (HIDDEN_DIM * WARMUP) ** -0.5, rtol=1e-6)
    assert np.all(np.diff(values[: WARMUP - 1]) > 0)
    assert np.all(np.diff(values[WARMUP:]) < 0)


def test_serialization_round_trip():
    schedule = WarmupSchedule(hidden_dim=256, warmup_steps=100, scale=2.0)
    config = schedule.get_config()
    assert config == {"hidden_dim": 256, "warmup_steps": 100, "scale": 2.0, "gradient_accumulation_steps": None}
    assert WarmupSchedule.from_config(config).get_config() == config

    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == "keras_transformer>WarmupSchedule"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(restored, WarmupSchedule)
    assert _value(restored(41)) == _value(schedule(41))

    # Inside an optimizer config too.
    optimizer = keras.optimizers.Adam(learning_rate=schedule)
    optimizer_config = optimizer.get_config()
    assert optimizer_config["learning_rate"]["config"] == config
    restored = keras.optimizers.Adam.from_config(optimizer_config)
    assert _value(restored.learning_rate) == pytest.approx(paper_lrate(1, 256, 100, 2.0), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden_dim": 0}, "hidden_dim=0 must be a positive int"),
        ({"hidden_dim": 512, "warmup_steps": 0}, "warmup_steps=0 must be a positive int"),
        ({"hidden_dim": 512, "scale": -1.0}, "scale=-1.0 must be a positive number"),
    ],
)
@pytest.mark.parametrize("cls", [WarmupSchedule, WarmupScheduleCallback])
def test_invalid_arguments(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def _tiny_model():
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=123.0), loss="mse")
    return model


def _tiny_data(num_batches, batch_size=2):
    rng = np.random.default_rng(0)
    n = num_batches * batch_size
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_callback_sets_the_schedule_rate_and_logs_lr():
    hidden_dim, warmup = 16, 4
    schedule = WarmupSchedule(hidden_dim, warmup_steps=warmup)
    callback = WarmupScheduleCallback(hidden_dim, warmup_steps=warmup)

    seen = []  # `lr` from each batch's logs

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs["lr"])

    model = _tiny_model()
    x, y = _tiny_data(num_batches=3)
    history = model.fit(
        x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=[callback, Record()]
    )
    # Six updates: steps 1..6 used the schedule's rates for iterations 0..5.
    expected = [_value(schedule(i)) for i in range(6)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"], [expected[2], expected[5]], rtol=1e-6)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    np.testing.assert_allclose(
        float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)), expected[5], rtol=1e-6
    )


def test_callback_resumes_from_optimizer_iterations():
    hidden_dim, warmup = 64, 1000
    model = _tiny_model()
    x, y = _tiny_data(num_batches=1)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # builds the optimizer
    model.optimizer.iterations.assign(500)  # as if restored from a checkpoint
    callback = WarmupScheduleCallback(hidden_dim, warmup_steps=warmup)
    history = model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
    expected = paper_lrate(501, hidden_dim, warmup)
    np.testing.assert_allclose(history.history["lr"], [expected], rtol=1e-6)
    np.testing.assert_allclose(
        _value(WarmupSchedule(hidden_dim, warmup)(500)), expected, rtol=1e-6
    )
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 501


def test_callback_rate_is_the_one_used_by_the_update():
    # SGD on loss = sum(w) (mean over a batch of 1): w_new = w_old - lr.
    model = keras.Sequential(
        [keras.Input(shape=(1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=99.0),
        loss=lambda y_true, y_pred: keras.ops.mean(y_pred),
    )
    x = np.ones((3, 1), "float32")
    callback = WarmupScheduleCallback(hidden_dim=4, warmup_steps=2)
    model.fit(x, x, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    rates = sum(paper_lrate(s, 4, 2) for s in (1, 2, 3))
    np.testing.assert_allclose(model.get_weights()[0], [[-rates]], rtol=1e-5)


@pytest.mark.parametrize("k", [2, 3])
def test_schedule_counts_updates_under_gradient_accumulation(k):
    """Keras hands the schedule its micro-batch counter; told k, it evaluates update u = counter // k + 1."""
    schedule = WarmupSchedule(HIDDEN_DIM, warmup_steps=WARMUP, gradient_accumulation_steps=k)
    counters = np.arange(0, 5 * k)
    values = keras.ops.convert_to_numpy(schedule(counters))
    np.testing.assert_allclose(values, [paper_lrate(c // k + 1) for c in counters], rtol=1e-6)
    assert schedule.get_config()["gradient_accumulation_steps"] == k
    assert WarmupSchedule.from_config(schedule.get_config()).gradient_accumulation_steps == k


@pytest.mark.parametrize("k", [None, 2, 3])
def test_accumulated_updates_use_the_rate_of_their_update(k):
    """SGD on loss = mean(w * x), x = 1: each update moves w by -lr(update), whatever k is.

    Without `gradient_accumulation_steps` in the schedule, Keras 3.15 would
    give update u the rate of step u * k (the bug of issue 14).
    """
    model = keras.Sequential(
        [keras.Input(shape=(1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=WarmupSchedule(4, warmup_steps=3, gradient_accumulation_steps=k),
            gradient_accumulation_steps=k,
        ),
        loss=lambda y_true, y_pred: keras.ops.mean(y_pred),
    )
    updates = 4
    x = np.ones((updates * (k or 1), 1), "float32")
    model.fit(x, x, batch_size=1, epochs=1, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == updates
    expected = -sum(paper_lrate(step, 4, 3) for step in range(1, updates + 1))
    np.testing.assert_allclose(model.get_weights()[0], [[expected]], rtol=1e-5)


def test_invalid_accumulation_steps():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0 must be None or a positive int"):
        WarmupSchedule(512, gradient_accumulation_steps=0)
