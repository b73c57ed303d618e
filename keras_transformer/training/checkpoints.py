"""Checkpoints: written during `fit` (`PeriodicCheckpoint`), listed, and averaged (paper section 6.1).

A checkpoint (`ckpt-{update}.weights.h5`) holds the model's weights only, not
its optimizer state (the resume point keeps that, `resume.py`).
`average_checkpoints` works on the HDF5 files, one weight at a time, without a
model. `StopOnNaN` stops a run whose loss is no longer finite.
"""

import contextlib
import os
import pathlib
import re
import time

import h5py
import keras
import numpy as np

from keras_transformer import lora
from keras_transformer.utils import atomic_path, open_hdf5

CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.weights\.h5$")


OPTIMIZER_GROUP = "optimizer"  # where Keras' `save_weights` puts a compiled model's optimizer state


def _atomic_save_weights(model, path):
    """Writes the model's weights, without its optimizer state, as a `.weights.h5` file (atomically).

    About the size of the weights; `model.save_weights` on a compiled model
    also writes Adam's two moments (3x the size), which only a resume point
    needs (`save_resume_point`).
    """
    optimizer = getattr(model, "optimizer", None)
    # A LoRA model's file holds its merged kernels in float32, as `TransformerModel.save_weights` writes them.
    with atomic_path(path, suffix=".weights.h5") as temporary, lora.kernels_merged_in_float32(model):
        keras.saving.save_weights(model, temporary, objects_to_skip=[optimizer] if optimizer is not None else None)


def _load_model_weights(model, path):
    """Loads a weights file's model weights into `model`, leaving its optimizer state as it is.

    The file may hold an optimizer state (a resume point, or a checkpoint
    written before they held the model's weights only) or not.
    """
    optimizer = getattr(model, "optimizer", None)
    model.load_weights(str(path), objects_to_skip=[optimizer] if optimizer is not None else None)


def list_checkpoints(directory):
    """Checkpoint files in `directory`, oldest step first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := CHECKPOINT_PATTERN.match(name))]
    return [path for _, path in sorted(found)]


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Saves `ckpt-{update}.weights.h5` every `every_steps` updates or `every_minutes` minutes.

    A checkpoint holds the model's weights only (what is averaged), not the
    optimizer state: about the size of the parameters, a third of what
    `model.save_weights` writes for a model compiled with Adam. The resume
    point (`ResumePoint`) keeps the optimizer state.

    Counts optimizer updates (`optimizer.iterations`), not batches: under
    gradient accumulation a checkpoint is written once, after the batch that
    completes its update, and never before the first update (the untrained
    weights are not a checkpoint). With `every_minutes` (the paper wrote one
    every 10 minutes) a checkpoint is written at the first update boundary
    after that much training time, and after the last update of the run;
    `every_steps` is then not used. The last `keep` files are kept.

    Files are written to a temporary name and renamed, so a kill never
    leaves a truncated checkpoint.
    """

    def __init__(self, directory, every_steps=None, keep=5, every_minutes=None):
        super().__init__()
        if every_steps is None and every_minutes is None:
            raise ValueError("PeriodicCheckpoint needs every_steps or every_minutes")
        if (every_steps is not None and every_steps < 1) or keep < 1:
            raise ValueError(f"every_steps={every_steps} and keep={keep} must be positive")
        if every_minutes is not None and not every_minutes > 0:
            raise ValueError(f"every_minutes={every_minutes!r} must be a positive number")
        self.directory = pathlib.Path(directory)
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.keep = keep
        self._last_step = None  # the update count seen after the previous batch
        self._last_time = None

    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_begin(self, logs=None):
        self._last_step = self._step()
        self._last_time = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        if step == self._last_step:
            return  # a micro-batch that did not complete an update
        self._last_step = step
        if self.every_minutes is not None:
            due = time.monotonic() - self._last_time >= 60.0 * self.every_minutes
        else:
            due = step % self.every_steps == 0
        if due:
            self.save(step)

    def on_train_end(self, logs=None):
        step = self._step()
        if self.every_minutes is not None and step > 0 and not (self.directory / self._name(step)).exists():
            self.save(step)

    @staticmethod
    def _name(step):
        return f"ckpt-{step:08d}.weights.h5"

    def save(self, step):
        """Writes the checkpoint of update `step` and removes all but the last `keep`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        _atomic_save_weights(self.model, self.directory / self._name(step))
        self._last_time = time.monotonic()
        for old in list_checkpoints(self.directory)[: -self.keep]:
            old.unlink()


class StopOnNaN(keras.callbacks.Callback):
    """Stops training when the loss is NaN or infinite and remembers where."""

    def __init__(self):
        super().__init__()
        self.bad_step = None

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            self.bad_step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            self.model.stop_training = True


def average_checkpoints(paths, output=None):
    """Element-wise mean of the model weights of several Keras weight files (paper section 6.1).

    Works on the HDF5 files directly, so no model is needed: every float
    weight of the model is averaged across the files (in float64, one weight
    at a time, so memory holds one weight of each file, not the files);
    integer arrays are taken from the last file. An optimizer state in the
    files (Keras' `optimizer/` group: a resume point, or a checkpoint
    written before checkpoints held the model's weights only) is left out:
    the average is a model's weights, about the size of its parameters.

    Args:
        paths: weight files (`.weights.h5`) of the same model, with or
            without an optimizer state.
        output: optional path; the averaged weights are written there in
            Keras' layout without the optimizer state (atomically), loadable
            with `model.load_weights`.

    Returns:
        dict mapping each of the model's dataset paths to its averaged numpy array.
    """
    paths = [pathlib.Path(p) for p in paths]
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint path")
    if output is not None and pathlib.Path(output).is_dir():
        raise ValueError(
            f"the output {output} is a directory; give the file to write, e.g. {output}/averaged.weights.h5"
        )
    if output is not None and not str(output).endswith(".weights.h5"):
        # Keras' `load_weights` reads this layout only from a `.weights.h5` name (a plain `.h5` is its legacy format).
        raise ValueError(
            f"the output {output} must end in .weights.h5 (the name model.load_weights reads this layout from)"
        )
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"No such checkpoint: {path}")
    averaged = {}
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open_hdf5(path)) for path in paths]
        groups, names = _model_entries(handles[0])
        writer = None
        if output is not None:
            # Closed (LIFO) before `atomic_path` renames the file into place.
            writer = stack.enter_context(h5py.File(stack.enter_context(atomic_path(output, suffix=".h5")), "w"))
            for name in groups:
                writer.require_group(name).attrs.update(handles[0][name].attrs)
        for name in names:
            for path, handle in zip(paths, handles):
                if name not in handle:
                    raise ValueError(f"{path} has no weight {name!r} (present in {paths[0]}): different models?")
            shapes = [handle[name].shape for handle in handles]
            if any(shape != shapes[0] for shape in shapes):
                raise ValueError(f"Weight {name!r} has different shapes across checkpoints: {shapes}")
            dtype = handles[0][name].dtype
            if np.issubdtype(dtype, np.floating):
                total = np.zeros(shapes[0], "float64")
                for handle in handles:
                    total += np.asarray(handle[name], dtype="float64")
                value = (total / len(handles)).astype(dtype)
            else:
                value = np.asarray(handles[-1][name])
            averaged[name] = value
            if writer is not None:
                writer.create_dataset(name, data=value).attrs.update(handles[-1][name].attrs)
    return averaged


def _model_entries(handle):
    """`(groups, datasets)`: the paths in a Keras weights file outside its optimizer state, in file order."""
    groups, datasets = [], []

    def visit(name, item):
        if name == OPTIMIZER_GROUP or name.startswith(OPTIMIZER_GROUP + "/"):
            return
        (datasets if isinstance(item, h5py.Dataset) else groups).append(name)

    handle.visititems(visit)
    return groups, datasets
