"""The run directory: `training/` (its state.json, checkpoints, resume point) and the preset installed.

Reading and writing the state, choosing where a run trains (`output_dir`, or
`.NAME.new/` beside it under --overwrite), the arguments that changed since
the interrupted run, cleaning what a kill left, and installing the finished
preset: staged beside `output_dir`, then swapped in.
"""

import json
import logging
import os
import pathlib
import shutil

from keras_transformer.presets import is_preset_directory
from keras_transformer.training.errors import OutputDirectoryError
from keras_transformer.utils import (
    atomic_path,
    remove_directory,
    remove_stale_temporaries,
    replace_directory,
    stale_temporaries,
    temporary_sibling,
)

logger = logging.getLogger("keras_transformer.training")  # one logger for the whole package

STATE_FILE = "state.json"
TRAINING_DIR = "training"
MODEL_CONFIG_FILE = "model_config.json"  # in training/: a fine-tuning run's architecture, read at its resume


def _read_state(path):
    return _read_run_file(path, "a training state")


def _read_run_file(path, what):
    """The JSON object a run wrote at `path` (`what` it holds); `OutputDirectoryError` naming the way out."""
    try:
        value = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OutputDirectoryError(
            f"{path} is not readable JSON ({error}); the training run there cannot be resumed: "
            "pass --overwrite to start again or choose another --output"
        ) from None
    if not isinstance(value, dict):
        raise OutputDirectoryError(f"{path} does not hold {what}; pass --overwrite or choose another --output")
    return value


def _write_state(path, state):
    with atomic_path(path) as temporary:
        pathlib.Path(temporary).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")


def _is_training_output(directory):
    """True for a directory written by `run_training` (or `save_to_preset`).

    A config.json alone is not enough: an ONNX export and a Hugging Face
    checkpoint directory hold one too.
    """
    return is_preset_directory(directory) or (directory / TRAINING_DIR / STATE_FILE).is_file()


def _is_empty(directory):
    """No entries, or only the empty `training/` that older versions left after a failed start."""
    entries = os.listdir(directory)
    return not entries or (entries == [TRAINING_DIR] and not os.listdir(directory / TRAINING_DIR))


def _replacement_directory(output_dir):
    """Where an --overwrite run trains until it replaces `output_dir` (resumable, like `output_dir`)."""
    return output_dir.parent / f".{output_dir.name}.new"


def _choose_work_root(output_dir, overwrite):
    """Returns `(root, state)`: the directory that holds (or will hold) `training/`, and its state or None.

    Reads only; raises `OutputDirectoryError` for an output that must not be touched.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirectoryError(f"--output {output_dir} is a file, not a directory; choose another --output")
    if os.path.ismount(output_dir):
        raise OutputDirectoryError(
            f"--output {output_dir} is a mount point, which cannot be renamed (the finished preset is swapped "
            "in by renaming); choose a directory inside it"
        )
    if not output_dir.exists() or _is_empty(output_dir):
        return output_dir, None
    if not _is_training_output(output_dir):
        what = "refusing to delete it" if overwrite else "not resumable"
        raise OutputDirectoryError(
            f"{output_dir} holds files but no preset (config.json and model.weights.h5) or "
            f"{TRAINING_DIR}/{STATE_FILE}, so it was not written by this trainer ({what}); empty it or choose "
            "another --output"
        )
    if overwrite:
        # The existing run or preset stays until the new one is complete.
        root = _replacement_directory(output_dir)
        state_path = root / TRAINING_DIR / STATE_FILE
        return root, (_read_state(state_path) if state_path.is_file() else None)
    state_path = output_dir / TRAINING_DIR / STATE_FILE
    if not state_path.is_file():
        raise OutputDirectoryError(
            f"{output_dir} holds a preset but no training state; pass --overwrite to replace it or choose another --output"
        )
    return output_dir, _read_state(state_path)


def _describe_changes(recorded, arguments):
    """`{key: (recorded, now)}` for each argument that differs (one on a side only, init_from, is None on the other)."""
    keys = list(arguments) + [key for key in recorded if key not in arguments]
    return {key: (recorded.get(key), arguments.get(key)) for key in keys if recorded.get(key) != arguments.get(key)}


def _format_changes(changes):
    return ", ".join(f"{key}={new!r} (was {old!r})" for key, (old, new) in sorted(changes.items()))


def _finish_interrupted_install(output_dir):
    """Completes a preset installation that a kill interrupted, then removes stale temporaries.

    `_install_preset` stages the complete preset as `.NAME.tmp-PID-HEX/` and moves
    `training/` into it before swapping it in: a staged directory of a dead
    process that holds `training/` is the newest state of the run.
    """
    for entry in stale_temporaries(output_dir):
        if entry.name.startswith(f".{output_dir.name}.tmp-") and (entry / TRAINING_DIR / STATE_FILE).is_file():
            logger.warning("Completing the interrupted installation of %s (from %s)", output_dir, entry.name)
            replace_directory(entry, output_dir)
            break
    for path in (output_dir, output_dir / TRAINING_DIR, _replacement_directory(output_dir) / TRAINING_DIR):
        for entry in remove_stale_temporaries(path):
            logger.info("Removed %s, left by a killed run", entry)
    if output_dir.is_dir():
        for entry in output_dir.glob(".preset-*"):  # the staging directory of earlier versions
            shutil.rmtree(entry, ignore_errors=True)


def _remove_partial_files(work):
    """Deletes temporaries of killed atomic writes (`.NAME.XXXX...`) inside `training/`."""
    for directory in (work, work / "checkpoints", work / "backup"):
        if directory.is_dir():
            for entry in directory.iterdir():
                if entry.name.startswith(".") and entry.is_file():
                    entry.unlink()


def _install_preset(model, metadata, root, output_dir, state):
    """Stages the complete preset beside `output_dir`, moves `training/` into it, and swaps it in.

    A kill before `training/` moves leaves the run resumable where it was; a
    kill after it leaves a staged directory that the next run swaps in
    (`_finish_interrupted_install`). `output_dir` is never a partial preset.
    """
    staging = temporary_sibling(output_dir, "tmp")
    model.save_to_preset(staging, metadata=metadata)
    os.replace(root / TRAINING_DIR, staging / TRAINING_DIR)
    state["finished"] = True
    _write_state(staging / TRAINING_DIR / STATE_FILE, state)
    replace_directory(staging, output_dir)
    if root != output_dir:
        remove_directory(root)
