"""TrainingProgress: progress in optimizer steps and passes over the data, on every backend; CountProgress."""

import logging

import keras
import numpy as np
import pytest

from keras_transformer.progress import BatchCounter, CountProgress, TrainingProgress, format_duration


def fit(progress, gradient_accumulation_steps=None, epochs=3, batches_per_epoch=4):
    """A linear model fit on 8 fixed batches, `epochs` x `batches_per_epoch` batches."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=gradient_accumulation_steps), loss="mse"
    )
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def batches():
        while True:
            for i in range(0, 16, 2):
                yield x[i: i + 2], y[i: i + 2]

    model.fit(batches(), epochs=epochs, steps_per_epoch=batches_per_epoch, callbacks=[progress], shuffle=False, verbose=0)
    return model


def progress_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "keras_transformer.progress"]


def test_lines_count_optimizer_steps_and_passes(caplog):
    progress = TrainingProgress(total_steps=12, batches_per_pass=8, checkpoint_every=4, bar=False)
    with caplog.at_level(logging.INFO, logger="keras_transformer.progress"):
        fit(progress)
    lines = progress_lines(caplog)
    assert [line.split(":")[0] for line in lines] == [
        "checkpoint at step 4/12 (33%)", "checkpoint at step 8/12 (66%)", "checkpoint at step 12/12 (100%)",
    ]
    # 8 batches per pass: 4, 8, 12 batches are 0.5, 1.0, 1.5 passes.
    assert ["pass 0.5/1.5", "pass 1.0/1.5", "pass 1.5/1.5"] == [line.split(": ")[1].split(",")[0] for line in lines]
    assert "lr 1.00e-02" in lines[-1] and "loss " in lines[-1]
    assert lines[-1].endswith("ETA 0:00"), lines[-1]


def test_under_gradient_accumulation_a_step_is_an_update(caplog):
    # 12 batches, 2 per update: 6 optimizer steps; every 4 batches is 2 steps.
    progress = TrainingProgress(total_steps=6, batches_per_pass=8, checkpoint_every=2, bar=False)
    with caplog.at_level(logging.INFO, logger="keras_transformer.progress"):
        model = fit(progress, gradient_accumulation_steps=2)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    lines = progress_lines(caplog)
    assert [line.split(",")[0] for line in lines] == [
        "checkpoint at step 2/6 (33%): pass 0.5/1.5",
        "checkpoint at step 4/6 (66%): pass 1.0/1.5",
        "checkpoint at step 6/6 (100%): pass 1.5/1.5",
    ]


def test_a_line_off_the_checkpoint_interval_does_not_claim_a_checkpoint(caplog):
    progress = TrainingProgress(total_steps=12, batches_per_pass=8, checkpoint_every=5, bar=False)
    with caplog.at_level(logging.INFO, logger="keras_transformer.progress"):
        fit(progress)
    assert [line.split(" (")[0] for line in progress_lines(caplog)] == [
        "step 4/12", "step 8/12", "step 12/12",
    ]


def test_the_bar_counts_steps_out_of_the_total(capsys):
    fit(TrainingProgress(total_steps=12, batches_per_pass=8, bar=True))
    err = capsys.readouterr().err
    assert "step 12/12" in err and "pass 1.50" in err, err[-500:]
    assert "Epoch" not in err


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="total_steps=0"):
        TrainingProgress(total_steps=0, batches_per_pass=8)


@pytest.mark.parametrize(
    "seconds, expected", [(None, "?"), (0, "0:00"), (59.6, "1:00"), (61, "1:01"), (3600 + 62, "1:01:02")]
)
def test_format_duration(seconds, expected):
    assert format_duration(seconds) == expected


def test_count_progress_logs_a_line_at_the_start_on_updates_and_at_the_end(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("keras_transformer.progress.time.monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="keras_transformer.progress"):
        with CountProgress("validation BLEU", total=10, unit="sentences", bar=False, every_seconds=30) as progress:
            for seconds in (10, 25, 29):  # at 10, 35 and 64 s: only 35 s is 30 s after the last line
                clock[0] += seconds
                progress.update(2)
            clock[0] += 30
            progress.update(4)  # the last items: the closing line says it
    assert progress_lines(caplog) == [
        "validation BLEU: 0/10 sentences (0%), 0:00 elapsed, ETA ?",
        "validation BLEU: 4/10 sentences (40%), 0:35 elapsed, ETA 0:52",
        "validation BLEU: 10 sentences in 1:34",
    ]


def test_count_progress_counts_evaluate_batches_on_a_bar(capsys):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((10, 3), "float32")
    with CountProgress("validation loss", total=5, unit="batches", bar=True) as progress:
        model.evaluate(x, x[:, :1], batch_size=2, verbose=0, callbacks=[BatchCounter(progress)])
    assert progress.done == 5
    assert "validation loss: 100%" in capsys.readouterr().err
