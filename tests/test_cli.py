"""The commands' output: no framework start-up noise, no false alarms, progress in steps.

The slow test runs the `python -m` commands as a user does (fresh processes,
no TF_CPP_MIN_LOG_LEVEL in the environment, tiny preset, a few steps) and
asserts on what stderr does not contain. The train and export commands' runs
are the ones that built the suite's trained tiny preset and its ONNX exports
(`tiny_trained` in conftest.py, once per machine and code); the other commands
read that preset.
"""

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import (
    BACKEND, ROOT, TINY_TRAINED_CHECKPOINT_EVERY, TINY_TRAINED_PARTS, TINY_TRAINED_STEPS, TINY_TRAINED_VALID_LINES,
    run_command,
)
from keras_transformer import cli

# Lines a command must not print by default (each names what it catches).
NOISE = {
    "absl::InitializeLog": "absl's start-up notice",
    "cudart_stub": "TensorFlow's CUDA stub notice",
    "cuInit": "the CUDA error of a machine without a GPU",
    "cpu_feature_guard": "TensorFlow's CPU instructions notice",
    "oneDNN": "TensorFlow's oneDNN notice",
    "XLA service": "XLA's start-up notice",
    "retracing": "tf.function retracing warnings",
    "[E:onnxruntime": "ONNX Runtime's provider errors",
    "Traceback": "a crash",
    "Epoch ": "Keras' fit epochs (checkpoint intervals) as progress",
}
# absl's C++ log line prefix: severity, date, time, thread, file:line]
CXX_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]", re.MULTILINE)


# ---------------------------------------------------------------------- #
# keras_transformer.cli
# ---------------------------------------------------------------------- #
def test_verbose_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert cli.quiet_startup(["--preset", "x", "--verbose"]) is True
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def test_quiet_startup_sets_the_log_level_and_keeps_the_users(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert cli.quiet_startup(["--preset", "x"]) is False
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    cli.quiet_startup([])
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"


def test_stderr_is_discarded_at_the_file_descriptor_and_restored(capfd):
    with cli._stderr_discarded():
        os.write(2, b"from C++\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_tensorflows_own_handler_is_removed_so_records_print_once(monkeypatch):
    tensorflow_logger = logging.getLogger("tensorflow")
    monkeypatch.setattr(tensorflow_logger, "handlers", list(tensorflow_logger.handlers))
    own = logging.StreamHandler(sys.stderr)
    tensorflow_logger.addHandler(own)
    cli.setup_logging(verbose=False)
    assert own not in tensorflow_logger.handlers


def test_verbose_argument():
    import argparse

    parser = cli.add_verbose_argument(argparse.ArgumentParser())
    assert parser.parse_args([]).verbose is False and parser.parse_args(["--verbose"]).verbose is True


# ---------------------------------------------------------------------- #
# The commands, as a user runs them
# ---------------------------------------------------------------------- #
def _package_imports_tensorflow():
    code = "import sys, keras_transformer; sys.exit(int('tensorflow' in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 1


# The commands run from the repository root (conftest.run_command), so they import this checkout.
_run = run_command


def _assert_quiet(result, command):
    assert result.returncode == 0, f"{command} failed:\n{result.stderr[-3000:]}"
    _assert_no_noise(result.stderr, command)


def _assert_no_noise(stderr, command):
    found = {pattern: what for pattern, what in NOISE.items() if pattern in stderr}
    assert not found, f"{command} printed {sorted(found.values())}:\n{stderr[-3000:]}"
    assert not CXX_LOG_LINE.search(stderr), f"{command} printed C++ log lines:\n{stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.tensorflow_only
# Its commands run on the TensorFlow backend whatever the suite's; it stays in
# the TensorFlow run rather than with the notebooks (own_processes): near the
# start of that run, it asks for `tiny_trained` first, so the shared preset and
# exports are built by the time notebook 03 (in the PyTorch run) reads them.
@pytest.mark.skipif(BACKEND != "tensorflow", reason="the commands run on the TensorFlow backend (export needs it)")
def test_commands_print_no_noise_and_train_reports_steps(tmp_path, tiny_trained):
    # `python -m keras_transformer.X` runs the package's __init__ first: it must
    # not import TensorFlow, or the commands could not quiet it.
    assert not _package_imports_tensorflow()
    # `python -m keras_transformer.train`, run as `_run` runs it (conftest.py, `_build_tiny_trained`).
    train_stderr = (tiny_trained / "train.stderr").read_text(encoding="utf-8")
    _assert_no_noise(train_stderr, "train")
    # A line per checkpoint, in optimizer steps out of the total, with the pass over the data and an ETA.
    lines = re.findall(rf"checkpoint at step (\d+)/{TINY_TRAINED_STEPS} \(\d+%\): pass [\d.]+/[\d.]+, loss [\d.]+, "
                       r"val_loss [\d.]+, lr [\d.e+-]+; [\d:]+ elapsed, ETA [\d:?]+", train_stderr)
    every = TINY_TRAINED_CHECKPOINT_EVERY
    assert lines == [str(step) for step in range(every, TINY_TRAINED_STEPS + 1, every)], train_stderr[-3000:]
    # The validation at the end shows progress (the command's stderr is not a terminal: lines, no bar).
    for line in (r"validation loss: 0/\d+ batches \(0%\)", r"validation loss: \d+ batches in \d+:\d\d",
                 rf"validation BLEU \(beam 4\): 0/{TINY_TRAINED_VALID_LINES} sentences \(0%\)",
                 rf"validation BLEU \(beam 4\): {TINY_TRAINED_VALID_LINES} sentences in \d+:\d\d"):
        assert re.search(line, train_stderr), (line, train_stderr[-3000:])
    run = tiny_trained / TINY_TRAINED_PARTS["preset"]
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["valid_sentences"] == metadata["valid_bleu_sentences"] == TINY_TRAINED_VALID_LINES
    # Portable metadata: the bundled corpus by name and version, other files as given.
    data = metadata["data"]
    assert data["train"] == ["bundled:libreoffice_en_de/train.en.gz", "bundled:libreoffice_en_de/train.de.gz"]
    assert data["valid"] == [str(tiny_trained / name) for name in TINY_TRAINED_PARTS["valid"]]
    assert data["bundled_corpus"]["name"] == "libreoffice_en_de" and data["bundled_corpus"]["version"]

    translate = _run("keras_transformer.translate", "--preset", str(run), "--beam-size", "2",
                     input="Select the cells.\nClick OK.\n")
    _assert_quiet(translate, "translate")
    assert len(translate.stdout.splitlines()) == 2

    # Small batches of sorted lengths: several length buckets, each compiled once.
    evaluate = _run("keras_transformer.evaluate", "--preset", str(run), "--limit", "40", "--beam-size", "1",
                    "--batch-size", "4", "--json", "--no-progress")
    _assert_quiet(evaluate, "evaluate")
    assert '"src": "bundled:libreoffice_en_de/test.en.gz"' in evaluate.stdout

    average = _run("keras_transformer.average", str(run / "training" / "checkpoints"),
                   "--output", str(tmp_path / "average.weights.h5"))
    _assert_quiet(average, "average_checkpoints")

    # `python -m export.onnx` (and --quantize int8) of that preset, run as `_run` runs it.
    for part in ("onnx", "int8"):
        _assert_no_noise((tiny_trained / f"{part}.stderr").read_text(encoding="utf-8"), f"export.onnx ({part})")

    # The ONNX Runtime server: no CUDA false alarm where onnxruntime-gpu cannot use a GPU.
    served = _run("export.runtime", "--model", str(tiny_trained / TINY_TRAINED_PARTS["onnx"]), "--beam-size", "1",
                  input="Click OK.\n")
    assert served.returncode == 0 and served.stdout.strip(), served.stderr[-3000:]
    _assert_quiet(served, "export.runtime")

    saved_model = _run("export.saved_model", "--preset", str(run), "--output", str(tmp_path / "saved_model"))
    _assert_quiet(saved_model, "export.saved_model")

    # --verbose brings the frameworks' messages back.
    verbose = _run("keras_transformer.translate", "--preset", str(run), "--beam-size", "1", "--verbose",
                   input="Click OK.\n")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert CXX_LOG_LINE.search(verbose.stderr), verbose.stderr[-3000:]
