"""The Quick start's settings have one source: keras_transformer/quickstart.py."""

import pathlib
import subprocess
import sys

import nbformat

from keras_transformer import quickstart
from keras_transformer.train import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "quickstart.sh"
NOTEBOOK = ROOT / "colab" / "01_quickstart.ipynb"


def parsed(settings):
    """What `python -m keras_transformer.train` receives from `train_arguments(settings)`."""
    args = vars(build_parser().parse_args(["--output", "runs/x", *quickstart.train_arguments(settings)]))
    return {name: args[name] for name in settings}


def test_the_script_options_are_the_notebook_arguments():
    # The script passes train_arguments() to the CLI; the notebook passes SETTINGS to run_training.
    for settings in (quickstart.SETTINGS, quickstart.SMOKE_SETTINGS):
        assert parsed(settings) == settings


def test_printed_as_a_file_without_importing_keras():
    code = (
        "import runpy, sys; path = sys.argv.pop(1); runpy.run_path(path, run_name='__main__'); "
        "assert 'keras' not in sys.modules and 'tensorflow' not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "keras_transformer" / "quickstart.py")],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert result.stdout.split() == quickstart.train_arguments()


def test_script_and_notebook_read_the_settings_and_restate_none():
    script = SCRIPT.read_text()
    assert "python keras_transformer/quickstart.py" in script
    notebook = "\n".join(cell.source for cell in nbformat.read(str(NOTEBOOK), as_version=4).cells)
    assert "quickstart.SETTINGS" in notebook and "quickstart.SMOKE_SETTINGS" in notebook
    for name, value in quickstart.SETTINGS.items():
        if name == "preset":
            continue
        option = f"--{name.replace('_', '-')}"
        # --epochs and --mixed-precision are there once, for the EPOCHS and MIXED_PRECISION overrides.
        rest = script
        for override in ('${EPOCHS:+--epochs "$EPOCHS"}', '${MIXED_PRECISION:+--mixed-precision "$MIXED_PRECISION"}'):
            rest = rest.replace(override, "")
        assert option not in rest, f"the script restates {option}"
        assert f"{name}=" not in notebook and f"{name}: {value}" not in notebook, f"the notebook restates {name}"


def test_epochs_can_be_overridden_after_the_settings():
    # scripts/quickstart.sh: EPOCHS=6 appends --epochs 6; the last one counts.
    args = build_parser().parse_args(["--output", "x", *quickstart.train_arguments(), "--epochs", "6"])
    assert args.epochs == 6 and args.warmup_steps == quickstart.SETTINGS["warmup_steps"]


def test_the_script_passes_epochs_and_mixed_precision_from_the_environment(tmp_path):
    # A stand-in `python` first on PATH: the real one for quickstart.py, and for the
    # training command a recorder of its arguments that stops the script there.
    real_python = sys.executable
    recorder = tmp_path / "bin" / "python"
    recorder.parent.mkdir()
    recorder.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ]; then echo "$@" > "{tmp_path}/train-args"; exit 3; fi\n'
        f'exec "{real_python}" "$@"\n'
    )
    recorder.chmod(0o755)
    env = {"PATH": f"{recorder.parent}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
           "EPOCHS": "18", "MIXED_PRECISION": "mixed_bfloat16"}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    arguments = (tmp_path / "train-args").read_text().split()
    assert arguments[:2] == ["-m", "keras_transformer.train"]
    assert arguments[-4:] == ["--epochs", "18", "--mixed-precision", "mixed_bfloat16"]
    parsed = build_parser().parse_args(arguments[2:])
    assert parsed.epochs == 18 and parsed.mixed_precision == "mixed_bfloat16"  # the last one counts
    del env["EPOCHS"], env["MIXED_PRECISION"]
    (tmp_path / "train-args").unlink()
    subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    arguments = (tmp_path / "train-args").read_text().split()
    assert arguments.count("--mixed-precision") == 1 and arguments.count("--epochs") == 1
    assert build_parser().parse_args(arguments[2:]).mixed_precision == quickstart.SETTINGS["mixed_precision"]
