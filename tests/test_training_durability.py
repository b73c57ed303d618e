"""Nothing lost, nothing silent: bad input, --overwrite, resume and kills (issue 13, items 1-5 and 7)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import h5py
import numpy as np
import pytest

import keras_transformer as kt
from conftest import BACKEND, resume_after_the_first_interval, tiny_model, to_numpy
from keras_transformer import training, utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_corpus(tmp_path, n=200):
    from keras_transformer.datasets import load_bundled

    english, german = load_bundled("valid")
    (tmp_path / "src.txt").write_text("\n".join(english[:n]) + "\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(german[:n]) + "\n", encoding="utf-8")
    return str(tmp_path / "src.txt"), str(tmp_path / "tgt.txt")


def _snapshot(directory):
    """{relative path: sha1} of every file under `directory` (names of directories too)."""
    result = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            result[os.path.relpath(os.path.join(root, name), directory) + "/"] = None
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                result[os.path.relpath(path, directory)] = hashlib.sha1(f.read()).hexdigest()
    return result


def _finished_run(directory):
    """A directory shaped like a finished run (what --overwrite may replace)."""
    (directory / "training").mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.weights.h5").write_bytes(b"old weights")
    (directory / "training" / "state.json").write_text(json.dumps({"arguments": {}, "finished": True}))
    return _snapshot(directory)


def _run_until_the_first_resume_point(monkeypatch, output, arguments):
    """`run_training(output, **arguments)`, stopped right after its first resume point (as if killed there)."""
    save = training.ResumePoint.on_epoch_end

    def save_then_stop(self, epoch, logs=None):
        save(self, epoch, logs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(training.ResumePoint, "on_epoch_end", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            training.run_training(output, **arguments)


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ---------------------------------------------------------------------- #
# Item 7: nonsense arguments are argparse errors (exit 2, one line).
# ---------------------------------------------------------------------- #
TRAIN_REQUIRED = ["--output", "unused-output"]


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--epochs", "0"], "--epochs"),
        (["--steps", "0"], "--steps"),
        (["--steps", "-5"], "--steps"),
        (["--steps", "ten"], "--steps"),
        (["--average-last", "0"], "--average-last"),
        (["--checkpoint-every", "0"], "--checkpoint-every"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints"),
        (["--tokens-per-batch", "-1"], "--tokens-per-batch"),
        (["--vocabulary-size", "0"], "--vocabulary-size"),
        (["--max-length", "0"], "--max-length"),
        (["--warmup-steps", "0"], "--warmup-steps"),
        (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps"),
        (["--learning-rate-scale", "0"], "--learning-rate-scale"),
        (["--learning-rate-scale", "nan"], "--learning-rate-scale"),
        (["--label-smoothing", "1"], "--label-smoothing"),
        (["--label-smoothing", "-0.1"], "--label-smoothing"),
        (["--seed", "-1"], "--seed"),
        (["--tokenizer-max-sentences", "0"], "--tokenizer-max-sentences"),
        (["--validation-bleu-sentences", "0"], "--validation-bleu-sentences"),
        (["--no-validation-bleu", "--validation-bleu-sentences", "5"], "not allowed with argument"),
    ],
)
def test_train_cli_refuses_nonsense_numbers(tmp_path, capsys, argv, name):
    from keras_transformer import train

    output = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--output", str(output)] + argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert name in error and argv[1] in error, error
    assert not output.exists()


@pytest.mark.parametrize("last", ["0", "-1", "x"])
def test_average_checkpoints_cli_refuses_nonsense_last(tmp_path, capsys, last):
    tiny_model().save_weights(str(tmp_path / "ckpt-00000001.weights.h5"))
    from keras_transformer import average as cli
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(tmp_path), "--last", last, "--output", str(tmp_path / "avg.weights.h5")])
    assert exit_info.value.code == 2
    assert "--last" in capsys.readouterr().err
    assert not (tmp_path / "avg.weights.h5").exists()


def test_average_checkpoints_cli_names_a_missing_input(tmp_path, capsys):
    from keras_transformer import average as cli
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(tmp_path / "nope.weights.h5"), "--output", str(tmp_path / "avg.weights.h5")])
    assert exit_info.value.code == 2
    assert "nope.weights.h5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(steps=0), "steps=0"),
        (dict(epochs=0), "epochs=0"),
        (dict(steps=5, epochs=2), "not both"),
        (dict(average_last=0), "average_last=0"),
        (dict(checkpoint_every=0), "checkpoint_every=0"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(validation_bleu_sentences=0), r"^validation_bleu_sentences=0 must be an integer >= 1$"),
        (dict(validation_bleu="no"), r"^validation_bleu='no' must be True or False$"),
        (dict(mixed_precision="bfloat16"), r"^mixed_precision='bfloat16' must be None or one of \('auto', "),
        (dict(preset="tinyy"), "Unknown preset 'tinyy'"),
        (dict(train_src="missing.en", train_tgt="missing.de"), "missing.en"),
    ],
)
def test_run_training_refuses_bad_input_before_writing(tmp_path, arguments, message):
    """Item 4: a failed start creates nothing, so the corrected command is not refused."""
    output = tmp_path / "out"
    with pytest.raises(training.UserInputError, match=message):
        training.run_training(output, **{"preset": "tiny", **arguments})
    assert not output.exists()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="data checks only; the same on every backend")
def test_validation_text_without_a_usable_pair_is_refused_before_writing(tmp_path):
    src, tgt = _small_corpus(tmp_path)
    for name in ("valid.en", "valid.de"):
        (tmp_path / name).write_text("word " * 100 + "\n", encoding="utf-8")
    output = tmp_path / "out"
    with pytest.raises(training.BadArgumentError, match="No sentence pair is between 1 and 46 tokens long"):
        training.run_training(output, preset="tiny", train_src=src, train_tgt=tgt, valid_src=tmp_path / "valid.en",
                              valid_tgt=tmp_path / "valid.de", vocabulary_size=300, max_length=48)
    assert not output.exists()


def test_train_cli_prints_one_line_for_a_missing_file(tmp_path, capsys):
    from keras_transformer import train

    with pytest.raises(SystemExit) as exit_info:
        train.main(["--preset", "tiny", "--output", str(tmp_path / "out"),
                    "--train-src", str(tmp_path / "typo.en"), "--train-tgt", str(tmp_path / "typo.de")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m keras_transformer.train: error: ")
    assert "typo.en" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- #
# Item 1: --overwrite checks everything first and never deletes what is not ours.
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "arguments",
    [dict(train_src="typo.en", train_tgt="typo.de"), dict(steps=0), dict(preset="nonexistent")],
    ids=["missing-file", "zero-steps", "unknown-preset"],
)
def test_overwrite_with_a_bad_argument_keeps_the_old_directory(tmp_path, arguments):
    output = tmp_path / "run"
    before = _finished_run(output)
    with pytest.raises(training.UserInputError):
        training.run_training(output, **{"preset": "tiny", "overwrite": True, **arguments})
    assert _snapshot(output) == before
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("files", [
    ("thesis.tex",),
    ("config.json", "model.safetensors"),  # a Hugging Face checkpoint directory
    ("config.json", "weights.bin", "encoder.onnx"),  # an ONNX export
])
def test_a_directory_that_is_not_ours_is_never_deleted(tmp_path, overwrite, files):
    src, tgt = _small_corpus(tmp_path)
    output = tmp_path / "documents"
    output.mkdir()
    for name in files:
        (output / name).write_text("keep me")
    with pytest.raises(training.OutputDirectoryError, match="holds files but no preset .config.json and "
                       r"model.weights.h5. or training/state.json, so it was not written by this trainer"):
        training.run_training(output, preset="tiny", train_src=src, train_tgt=tgt, overwrite=overwrite)
    assert _snapshot(output) == {name: hashlib.sha1(b"keep me").hexdigest() for name in files}


def test_a_truncated_state_is_named_and_kept(tmp_path):
    output = tmp_path / "run"
    (output / "training").mkdir(parents=True)
    (output / "training" / "state.json").write_text('{"arguments": {"preset": "ti')
    before = _snapshot(output)
    with pytest.raises(training.OutputDirectoryError, match=r"state\.json is not readable JSON.*--overwrite"):
        training.run_training(output, preset="tiny")
    assert _snapshot(output) == before


def test_a_finished_run_needs_overwrite(tmp_path):
    src, tgt = _small_corpus(tmp_path)
    output = tmp_path / "run"
    before = _finished_run(output)
    with pytest.raises(training.OutputDirectoryError, match="finished training run.*--overwrite"):
        training.run_training(output, preset="tiny", train_src=src, train_tgt=tgt)
    assert _snapshot(output) == before


# ---------------------------------------------------------------------- #
# Item 3: a resume must repeat the interrupted run's arguments.
# ---------------------------------------------------------------------- #
def _interrupted_run(tmp_path, monkeypatch, **arguments):
    """A run stopped right after its state was written, with a resume point after 2 of 4 intervals."""
    src, tgt = _small_corpus(tmp_path)
    output = tmp_path / "run"
    arguments = dict(preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300, tokens_per_batch=512,
                     steps=4, checkpoint_every=1, max_length=48, **arguments)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop()

    with monkeypatch.context() as patch:
        patch.setattr(training.run, "resolve_strategy", stop)
        with pytest.raises(Stop):
            training.run_training(output, **arguments)
    backup = output / "training" / "backup"
    backup.mkdir()
    with h5py.File(backup / training.RESUME_FILE, "w") as handle:
        handle.attrs[training.RESUME_ATTRIBUTE] = json.dumps({"intervals": 2, "step": 2})
    return output, arguments


@pytest.mark.parametrize(
    "changed, listed",
    [
        (dict(preset="small"), "preset='small' (was 'tiny')"),
        (dict(vocabulary_size=400), "vocabulary_size=400 (was 300)"),
        (dict(checkpoint_every=2), "checkpoint_every=2 (was 1)"),
        (dict(max_length=40, seed=3), "max_length=40 (was 48), seed=3 (was 0)"),
    ],
)
def test_resume_with_other_arguments_is_refused_and_nothing_is_rewritten(tmp_path, monkeypatch, changed, listed):
    output, arguments = _interrupted_run(tmp_path, monkeypatch)
    before = _snapshot(output)
    with pytest.raises(training.BadArgumentError) as error:
        training.run_training(output, **{**arguments, **changed})
    assert listed in str(error.value)
    assert "Repeat the original arguments" in str(error.value)
    assert _snapshot(output) == before


def test_resume_refuses_fewer_steps_than_done(tmp_path, monkeypatch):
    output, arguments = _interrupted_run(tmp_path, monkeypatch)
    before = _snapshot(output)
    with pytest.raises(training.BadArgumentError, match="already trained 2 steps"):
        training.run_training(output, **{**arguments, "steps": 1})
    assert _snapshot(output) == before


def test_a_run_without_progress_starts_again_with_the_corrected_arguments(tmp_path, monkeypatch):
    """A start that failed (here: after the state was written) keeps nothing that a new command must repeat."""
    output, arguments = _interrupted_run(tmp_path, monkeypatch)
    (output / "training" / "backup" / training.RESUME_FILE).unlink()
    def stop(strategy):
        raise RuntimeError("stop")

    with monkeypatch.context() as patch:
        patch.setattr(training.run, "resolve_strategy", stop)
        with pytest.raises(RuntimeError, match="stop"):
            training.run_training(output, **{**arguments, "vocabulary_size": 350})
    state = json.loads((output / "training" / "state.json").read_text())
    assert state["arguments"]["vocabulary_size"] == 350


# What state.json records (a resume compares it): the same keys as before `TrainingConfig`,
# so that runs interrupted under an earlier version still resume.
RECORDED_ARGUMENTS = [
    "preset", "train_src", "train_tgt", "valid_src", "valid_tgt", "train_pairs", "valid_pairs", "vocabulary_size",
    "tokenizer_max_sentences", "tokens_per_batch", "steps", "epochs", "max_length", "warmup_steps",
    "learning_rate_scale", "label_smoothing", "gradient_accumulation_steps", "checkpoint_every",
    "checkpoint_every_minutes", "keep_checkpoints", "average_last", "strategy", "mixed_precision", "jit_compile",
    "bleu_beam_size", "seed", "model_overrides",
]


def test_the_validation_options_are_changes_a_resume_applies_and_records(tmp_path, monkeypatch):
    """What the end of a run scores is not what was trained: a resume may change it (`RESUMABLE_CHANGES`)."""
    output, arguments = _interrupted_run(tmp_path, monkeypatch)

    def stop(strategy):
        raise RuntimeError("resumed")

    with monkeypatch.context() as patch:
        patch.setattr(training.run, "resolve_strategy", stop)
        with pytest.raises(RuntimeError, match="resumed"):
            training.run_training(output, **arguments, validation_bleu=False, validation_bleu_sentences=20)
    state = json.loads((output / "training" / "state.json").read_text())
    assert state["changes"] == [{"at_step": 2, "changed": {"validation_bleu": [None, False],
                                                            "validation_bleu_sentences": [None, 20]}}]
    assert (state["arguments"]["validation_bleu"], state["arguments"]["validation_bleu_sentences"]) == (False, 20)


def test_train_cli_passes_the_validation_options(tmp_path, monkeypatch):
    from keras_transformer import train

    received = {}
    monkeypatch.setattr(train, "run_training", lambda output, **kwargs: received.update(kwargs) or {})
    train.main(["--output", str(tmp_path / "out")])
    assert (received["validation_bleu"], received["validation_bleu_sentences"]) == (
        True, training.DEFAULT_VALIDATION_BLEU_SENTENCES)
    train.main(["--output", str(tmp_path / "out"), "--no-validation-bleu"])
    assert received["validation_bleu"] is False
    train.main(["--output", str(tmp_path / "out"), "--validation-bleu-sentences", "50"])
    assert (received["validation_bleu"], received["validation_bleu_sentences"]) == (True, 50)
    # The default keeps the bundled corpus's whole validation split, so the Quick start's valid BLEU is unchanged.
    from keras_transformer.datasets import load_bundled

    assert training.DEFAULT_VALIDATION_BLEU_SENTENCES >= len(load_bundled("valid")[0])


def test_a_config_object_is_the_same_run_as_its_keywords(tmp_path, monkeypatch):
    """`run_training(output, TrainingConfig(...), **overrides)` records what the keyword call recorded."""
    output, arguments = _interrupted_run(tmp_path, monkeypatch)
    state_path = output / "training" / "state.json"
    recorded = json.loads(state_path.read_text())["arguments"]
    assert list(recorded) == RECORDED_ARGUMENTS
    assert (recorded["average_last"], recorded["gradient_accumulation_steps"]) == (5, None)  # tiny's default, 1 -> None
    config = training.TrainingConfig(**{k: v for k, v in arguments.items() if k != "seed"}, seed=3)
    before = _snapshot(output)
    with pytest.raises(training.BadArgumentError, match=r"seed=3 \(was 0\)"):
        training.run_training(output, config)
    assert _snapshot(output) == before

    def stop(strategy):
        raise RuntimeError("resumed")

    with monkeypatch.context() as patch:
        patch.setattr(training.run, "resolve_strategy", stop)
        with pytest.raises(RuntimeError, match="resumed"):  # the same arguments: it resumes, changing nothing
            training.run_training(output, config, seed=0, gradient_accumulation_steps=1)
    state = json.loads(state_path.read_text())
    assert state["arguments"] == recorded and state["changes"] == []


@pytest.mark.skipif(BACKEND != "tensorflow", reason="argument checks only; the same on every backend")
def test_a_config_is_checked_when_it_is_made_and_changed(tmp_path):
    import dataclasses

    with pytest.raises(training.BadArgumentError, match=r"^keep_checkpoints=0 must be an integer >= 1$"):
        training.TrainingConfig(keep_checkpoints=0)
    with pytest.raises(training.BadArgumentError, match=r"^max_length=2 must be an integer >= 3$"):
        training.TrainingConfig(max_length=2)
    config = training.TrainingConfig(preset="tiny", steps=10)
    with pytest.raises(training.BadArgumentError, match="Pass steps or epochs, not both"):
        dataclasses.replace(config, epochs=2)
    with pytest.raises(training.BadArgumentError, match="Pass --train-src with --train-tgt"):
        training.run_training(tmp_path / "out", config, train_src="a.en")
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['step'\]"):
        training.run_training(tmp_path / "out", config, step=3)
    with pytest.raises(TypeError, match="must be a TrainingConfig"):
        training.run_training(tmp_path / "out", "tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 20
    assert (config.checkpoints_averaged, training.TrainingConfig(preset="big").checkpoints_averaged) == (5, 20)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- #
# Item 2: a resume point is one file with weights, optimizer state and interval count.
# ---------------------------------------------------------------------- #
def test_resume_point_restores_weights_and_optimizer_state(tmp_path):
    import tensorflow as tf

    x = {"encoder_token_ids": np.full((2, 5), 7, "int32"), "decoder_token_ids": np.full((2, 4), 8, "int32")}
    dataset = tf.data.Dataset.from_tensors((x, np.full((2, 4), 9, "int32"))).repeat()
    model = tiny_model(vocabulary_size=20)
    training.compile_model(model, warmup_steps=10)
    path = tmp_path / "backup" / training.RESUME_FILE
    model.fit(dataset, epochs=2, steps_per_epoch=3, callbacks=[training.ResumePoint(path)], verbose=0)
    assert training.read_resume_point(path)["intervals"] == 2
    assert training.read_resume_point(path)["step"] == 6
    assert os.listdir(path.parent) == [training.RESUME_FILE]

    restored = tiny_model(vocabulary_size=20, seed=7)
    training.compile_model(restored, warmup_steps=10)
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(str(path))
    assert int(to_numpy(restored.optimizer.iterations)) == 6
    for expected, actual in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(actual), to_numpy(expected))
    for expected, actual in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(to_numpy(actual), to_numpy(expected))


def test_a_resume_point_continues_with_the_same_dropout_masks(tmp_path):
    """A model with dropout resumed after its first interval ends with the uninterrupted run's weights, bitwise.

    Keras' weight files leave out the dropouts' random state (`SeedGenerator`,
    and torch's generator, which Keras' PyTorch dropout draws from); without it
    the resumed model drew step 0's masks again.
    """
    def build(seed):
        model = tiny_model(vocabulary_size=20, dropout=0.3, seed=seed)
        training.compile_model(model, warmup_steps=10)
        return model

    model, resumed, _ = resume_after_the_first_interval(tmp_path, build)
    for expected, actual in zip(model.weights, resumed.weights):
        np.testing.assert_array_equal(to_numpy(actual), to_numpy(expected), err_msg=expected.path)


@pytest.mark.slow
def test_an_interrupted_run_resumes_with_its_optimizer_state(tmp_path, monkeypatch):
    """Stopped after its first resume point, a call asking for one more step continues: 3 steps, not 1 + 3.

    The safe changes (more steps, fewer checkpoints averaged) are applied and recorded.
    """
    src, tgt = _small_corpus(tmp_path, n=100)
    output = tmp_path / "run"
    arguments = dict(preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300, tokens_per_batch=512,
                     steps=2, checkpoint_every=1, warmup_steps=10, max_length=32, verbose=0,
                     model_overrides={"max_sequence_length": 32, "num_layers": 1})
    _run_until_the_first_resume_point(monkeypatch, output, arguments)
    resume_path = output / "training" / "backup" / training.RESUME_FILE
    assert training.read_resume_point(resume_path)["intervals"] == 1
    assert not (output / "config.json").exists()

    metadata = training.run_training(output, **{**arguments, "steps": 3, "average_last": 2})
    resume = training.read_resume_point(resume_path)
    assert (resume["intervals"], resume["step"]) == (3, 3)  # the optimizer's counter was restored
    assert metadata["steps"] == 3
    assert metadata["resumed_with_changes"] == [
        {"at_step": 1, "changed": {"average_last": [5, 2], "steps": [2, 3]}}]
    assert metadata["averaged_checkpoints"] == ["ckpt-00000002.weights.h5", "ckpt-00000003.weights.h5"]
    checkpoints = training.list_checkpoints(output / "training" / "checkpoints")
    assert [p.name for p in checkpoints] == [f"ckpt-{step:08d}.weights.h5" for step in (1, 2, 3)]
    model = kt.TransformerModel.from_preset(str(output))
    assert model.tokenizer is not None

    # Checkpoints and the average hold the model's weights (about their float32 bytes); only the resume point
    # holds Adam's two moments too (3x: what every checkpoint weighed when written with model.save_weights).
    # HDF5 adds about 2.4 KB per array (a quarter of this small model's 0.4 MB; under 1% of a base model's).
    weight_bytes, limit = 4 * model.count_params(), 1.05 * 4 * model.count_params() + 4096 * len(model.weights)
    assert limit < 2 * weight_bytes
    for path in [*checkpoints, output / "training" / "averaged.weights.h5"]:
        assert weight_bytes < path.stat().st_size < limit, (path.name, path.stat().st_size, weight_bytes)
        with h5py.File(path, "r") as handle:
            assert "optimizer" not in handle
    assert resume_path.stat().st_size > 2.9 * weight_bytes, (resume_path.stat().st_size, weight_bytes)
    with h5py.File(resume_path, "r") as handle:
        assert "optimizer" in handle


@pytest.mark.slow
def test_a_resumed_run_with_accumulation_skips_whole_updates(tmp_path, monkeypatch):
    """Under accumulation k an interval of n updates is n * k batches: a resume skips that many, counts updates.

    (Two runs in one process are not bit-identical, so the data position is
    checked where it is chosen: the number of batches the resumed run skips.)
    """
    import tensorflow as tf

    src, tgt = _small_corpus(tmp_path, n=100)
    arguments = dict(preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300, tokens_per_batch=256,
                     steps=4, checkpoint_every=2, warmup_steps=10, max_length=32, verbose=0,
                     gradient_accumulation_steps=3, average_last=1,
                     model_overrides={"max_sequence_length": 32, "num_layers": 1})
    _run_until_the_first_resume_point(monkeypatch, tmp_path / "run", arguments)
    resume = training.read_resume_point(tmp_path / "run" / "training" / "backup" / training.RESUME_FILE)
    assert (resume["intervals"], resume["step"]) == (1, 2)  # 6 batches, 2 updates
    skipped = []
    skip = tf.data.Dataset.skip
    monkeypatch.setattr(tf.data.Dataset, "skip", lambda self, count, **kw: (skipped.append(count), skip(self, count, **kw))[1])
    metadata = training.run_training(tmp_path / "run", **arguments)
    assert skipped == [2 * 3]
    assert metadata["steps"] == 4 and metadata["averaged_checkpoints"] == ["ckpt-00000004.weights.h5"]
    assert training.read_resume_point(tmp_path / "run" / "training" / "backup" / training.RESUME_FILE)["step"] == 4


@pytest.mark.slow
def test_overwrite_replaces_the_old_run_only_when_the_new_one_is_complete(tmp_path, monkeypatch):
    src, tgt = _small_corpus(tmp_path, n=100)
    output = tmp_path / "run"
    before = _finished_run(output)
    arguments = dict(preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300, tokens_per_batch=512,
                     steps=2, checkpoint_every=1, warmup_steps=10, max_length=32, verbose=0, overwrite=True,
                     model_overrides={"max_sequence_length": 32, "num_layers": 1})
    _run_until_the_first_resume_point(monkeypatch, output, arguments)
    assert _snapshot(output) == before  # interrupted: the old run is untouched
    assert (tmp_path / ".run.new" / "training" / "state.json").is_file()

    metadata = training.run_training(output, **arguments)  # the same command resumes the replacement
    resume = training.read_resume_point(output / "training" / "backup" / training.RESUME_FILE)
    assert (resume["intervals"], resume["step"], metadata["steps"]) == (2, 2, 2)
    assert json.loads((output / "training" / "state.json").read_text())["finished"] is True
    assert (output / "model.weights.h5").read_bytes() != b"old weights"
    assert sorted(os.listdir(tmp_path)) == ["run", "src.txt", "tgt.txt"]
    assert kt.TransformerModel.from_preset(str(output)).tokenizer is not None


# ---------------------------------------------------------------------- #
# Item 5: stale temporaries are removed; an interrupted swap is completed.
# ---------------------------------------------------------------------- #
def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    dead, hex_ = _dead_pid(), uuid.uuid4().hex
    names = {
        f".out.tmp-{dead}-{hex_}": True,  # killed writer
        f".out.old-{dead}-{hex_}": True,
        f".out.tmp-{hex_}": True,  # older versions' name, no pid
        f".out.tmp-{os.getpid()}-{hex_}": False,  # a live writer
        f".other.tmp-{dead}-{hex_}": False,  # another directory's
        # A staging directory's own temporary (a killed `save_to_preset` into `.out.tmp-...`; a random-kill run
        # left one): stale when its writers are dead, kept while one lives.
        f"..out.tmp-{dead}-{hex_}.tmp-{dead}-{uuid.uuid4().hex}": True,
        f"..out.tmp-{os.getpid()}-{hex_}.tmp-{os.getpid()}-{uuid.uuid4().hex}": False,
        f"..other.tmp-{dead}-{hex_}.tmp-{dead}-{uuid.uuid4().hex}": False,
        "out": False,
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    removed = utils.remove_stale_temporaries(tmp_path / "out")
    assert sorted(p.name for p in removed) == sorted(n for n, stale in names.items() if stale)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, stale in names.items() if not stale)


def test_atomic_directory_cleans_up_after_a_killed_writer(tmp_path):
    leftover = tmp_path / f".export.tmp-{_dead_pid()}-{uuid.uuid4().hex}"
    leftover.mkdir()
    with utils.atomic_directory(tmp_path / "export") as staging:
        (staging / "model.onnx").write_text("graph")
    assert sorted(os.listdir(tmp_path)) == ["export"]


@pytest.mark.parametrize("old_output", ["missing", "emptied", "old preset"])
def test_an_interrupted_preset_installation_is_completed(tmp_path, old_output):
    """A kill after training/ moved into the staged preset: the next run swaps it in."""
    output = tmp_path / "run"
    staged = tmp_path / f".run.tmp-{_dead_pid()}-{uuid.uuid4().hex}"
    (staged / "training").mkdir(parents=True)
    (staged / "config.json").write_text('{"new": true}')
    (staged / "training" / "state.json").write_text('{"finished": true}')
    if old_output != "missing":
        output.mkdir()
    if old_output == "old preset":
        (output / "config.json").write_text('{"new": false}')
    training._finish_interrupted_install(output)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert json.loads((output / "config.json").read_text()) == {"new": True}
    assert (output / "training" / "state.json").is_file()


# ---------------------------------------------------------------------- #
# The fault-injection test: SIGKILL at random moments, the same command finishes.
# ---------------------------------------------------------------------- #
TRAIN_SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys
    logging.basicConfig(level=logging.INFO)
    output, src, tgt, steps, kill_at = sys.argv[1:6]
    mode, _, value = kill_at.partition("=")
    if mode in ("replace", "target"):
        # Fault injection: SIGKILL this process just before the n-th rename (or the
        # first rename onto a path ending in `value`), the moment a write completes.
        real_replace, calls = os.replace, [0]

        def replace(source, destination, **kwargs):
            calls[0] += 1
            if (mode == "replace" and calls[0] == int(value)) or (
                mode == "target" and os.fspath(destination).endswith(value)
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(source, destination, **kwargs)

        os.replace = replace
    from keras_transformer.training import run_training
    run_training(output, preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300,
                 tokens_per_batch=512, steps=int(steps), checkpoint_every=1, warmup_steps=10,
                 max_length=48, verbose=0, model_overrides={"max_sequence_length": 64, "num_layers": 1})
    """
)


@pytest.mark.slow
# One backend is enough for the process-level test: its runs are processes of their own on TensorFlow, so it
# runs once, beside the notebooks (conftest.py, KT_PROCESS_TESTS_BACKEND), to even out tests/run.sh's lanes.
@pytest.mark.own_processes
def test_training_survives_random_sigkills(tmp_path):
    """Kills at random times, at random renames, before a resume point and inside the final swap.

    Set KT_FAULT_SEED to replay a sequence of kills.
    """
    seed = int(os.environ.get("KT_FAULT_SEED", time.time_ns() % 2**31))
    rng = np.random.default_rng(seed)
    src, tgt = _small_corpus(tmp_path)
    output = tmp_path / "run"
    steps = 4
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO, KERAS_BACKEND="tensorflow")

    def command(kill_at, steps=steps):
        return [sys.executable, "-c", TRAIN_SCRIPT, str(output), src, tgt, str(steps), kill_at]

    kills = [
        f"replace={rng.integers(1, 8)}",  # early: the state, the tokenizer, training/, the first checkpoints
        f"target={training.RESUME_FILE}",  # a checkpoint written, its resume point not yet
        "time",  # anywhere, shortly after a resume point
        "target=/run",  # the final swap: the old directory renamed away, the new one not yet in
    ]
    more_steps = steps + 1  # from the last kill on: a change that is applied and recorded (unless finished)
    log = []
    for kill_at in kills:
        if kill_at == kills[-1] and json.loads((output / "training" / "state.json").read_text())["finished"]:
            more_steps = steps  # finished already: more steps would need --overwrite
        if kill_at == "time":
            stderr_file = open(tmp_path / "stderr.txt", "w+b")
            process = subprocess.Popen(command("none"), env=env, stderr=stderr_file)
            # Wait for the resumed run to train, then kill it at a random moment.
            resume = output / "training" / "backup" / training.RESUME_FILE
            mtime = resume.stat().st_mtime_ns if resume.exists() else 0
            deadline = time.time() + 180
            while process.poll() is None and time.time() < deadline and (
                not resume.exists() or resume.stat().st_mtime_ns == mtime
            ):
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            process.kill()
            process.wait()
            stderr_file.seek(0)
            stderr = stderr_file.read()
            stderr_file.close()
            os.remove(tmp_path / "stderr.txt")
        else:
            process = subprocess.run(command(kill_at, more_steps if kill_at == kills[-1] else steps),
                                     env=env, stderr=subprocess.PIPE, timeout=300)
            stderr = process.stderr
        log.append((kill_at, process.returncode))
        assert process.returncode in (0, -signal.SIGKILL), (seed, log, stderr.decode()[-3000:])

    finished = subprocess.run(command("none", more_steps), env=env, stderr=subprocess.PIPE, timeout=300)
    assert finished.returncode == 0, (seed, log, finished.stderr.decode()[-3000:])
    killed = sum(code == -signal.SIGKILL for _, code in log)
    print(f"survived {killed} SIGKILLs ({log}), seed {seed}")
    assert killed >= 3, log

    # The right number of steps, each interval counted once.
    kills_steps, steps = steps, more_steps
    work = output / "training"
    resume = training.read_resume_point(work / "backup" / training.RESUME_FILE)
    assert (resume["intervals"], resume["step"]) == (steps, steps)
    with h5py.File(work / "backup" / training.RESUME_FILE, "r") as handle:  # (checkpoints hold no optimizer state)
        counters = [np.asarray(handle[name]) for name in _datasets(handle) if name.startswith("optimizer/")]
        counters = [int(c) for c in counters if c.shape == () and np.issubdtype(c.dtype, np.integer)]
    assert counters == [steps]  # optimizer.iterations: no interval trained twice
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["steps"] == steps
    if steps != kills_steps:
        assert [c["changed"] for c in metadata["resumed_with_changes"]] == [{"steps": [steps - 1, steps]}]
    state = json.loads((work / "state.json").read_text())
    assert state["finished"] is True and state["arguments"]["steps"] == steps
    assert sorted(os.listdir(tmp_path)) == ["run", "src.txt", "tgt.txt"]  # no temporaries left
    loaded = kt.TransformerModel.from_preset(str(output))
    assert loaded.tokenizer is not None and loaded.tokenizer.vocabulary_size == loaded.vocabulary_size

    # The same command again has nothing to do.
    assert training.run_training(
        output, preset="tiny", train_src=src, train_tgt=tgt, vocabulary_size=300, tokens_per_batch=512,
        steps=steps, checkpoint_every=1, warmup_steps=10, max_length=48, verbose=0,
        model_overrides={"max_sequence_length": 64, "num_layers": 1},
    ) == metadata


def _datasets(handle):
    names = []
    handle.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names
