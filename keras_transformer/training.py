"""Compile and fit under a distribution strategy, with checkpoints and averaging.

Distribution (`strategy=`):
- "none": the default device.
- "mirrored" (TensorFlow backend): `tf.distribute.MirroredStrategy` over all
  local GPUs (or logical CPU devices). XLA is turned off under it: with
  `jit_compile=True`, TF 2.21 / Keras 3.15 fail with "Trying to access
  resource ... located in device CPU:1 from device CPU:0" (a known XLA
  limitation with mirrored variables), while `jit_compile=False` works.
- "multi_worker" (JAX backend): `keras.distribution.DataParallel` over
  `jax.distributed` processes. Keras 3.15's `model.fit` does not work under
  TensorFlow's `MultiWorkerMirroredStrategy` (keras-team/keras#20585:
  "Attempt to convert a value (PerReplica ...) to a Tensor"), so several
  machines train on JAX.
- "auto": "mirrored" on TensorFlow with more than one GPU, else "none".
"""

import base64
import contextlib
import dataclasses
import gc
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import time

import h5py
import keras
import numpy as np

from keras_transformer import data as data_lib
from keras_transformer import datasets
from keras_transformer import lora
from keras_transformer.convert import hf_model_type, is_hf_handle
from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.model import TransformerModel
from keras_transformer.optimizers import InPlaceAdam
from keras_transformer.presets import PRESETS, PRETRAINED_PRESETS, is_preset_directory, jsonable_config
from keras_transformer.progress import BatchCounter, CountProgress, TrainingProgress
from keras_transformer.schedules import WarmupSchedule
from keras_transformer.tokenizer import load_tokenizer, train_tokenizer
from keras_transformer.utils import (
    atomic_directory,
    atomic_path,
    open_hdf5,
    remove_directory,
    remove_stale_temporaries,
    replace_directory,
    stale_temporaries,
    temporary_sibling,
)

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "mirrored", "multi_worker", "none")
MIXED_PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.weights\.h5$")


def native_bfloat16():
    """`(bool, why)`: whether this machine multiplies bfloat16 matrices natively, and what says so.

    The accelerator Keras' backend trains on (a CUDA GPU of compute
    capability 8.0 or later, a TPU), else the CPU's own instructions
    (`avx512_bf16` or `amx_bf16` in Linux's /proc/cpuinfo). Elsewhere
    bfloat16 is emulated and slower than float32.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.is_bf16_supported(), f"GPU {torch.cuda.get_device_name()}"
    elif backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform == "tpu":
            return True, "TPU"
        if device.platform == "gpu":
            capability = getattr(device, "compute_capability", "0.0")
            return float(capability) >= 8.0, f"GPU compute capability {capability}"
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0))
            return tuple(capability) >= (8, 0), f"GPU compute capability {capability}"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        flags = []
    found = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]
    return bool(found), f"CPU with {found[0]}" if found else "CPU without avx512_bf16 or amx_bf16"


def resolve_mixed_precision(mixed_precision):
    """The Keras policy a run uses for `mixed_precision` (`MIXED_PRECISIONS` or None), None for float32.

    "auto" is "mixed_bfloat16" where `native_bfloat16()` says so, else
    float32; the choice is logged.
    """
    if mixed_precision == "auto":
        native, why = native_bfloat16()
        resolved = "mixed_bfloat16" if native else None
        logger.info("mixed_precision=auto: %s (%s)", resolved or "float32", why)
        return resolved
    return None if mixed_precision == "float32" else mixed_precision


def resolve_strategy(strategy="auto"):
    """Returns `(name, scope)`: the strategy actually used and a context manager.

    Build and compile the model inside the scope.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    backend = keras.backend.backend()
    if strategy == "auto":
        strategy = "none"
        if backend == "tensorflow":
            import tensorflow as tf

            if len(tf.config.list_logical_devices("GPU")) > 1:
                strategy = "mirrored"
    if strategy == "none":
        return "none", contextlib.nullcontext()
    if strategy == "mirrored":
        if backend != "tensorflow":
            raise ValueError(f"strategy='mirrored' needs the TensorFlow backend, the backend is {backend!r}")
        import tensorflow as tf

        mirrored = tf.distribute.MirroredStrategy()
        logger.info("MirroredStrategy over %d replicas", mirrored.num_replicas_in_sync)
        return "mirrored", mirrored.scope()
    # multi_worker
    if backend != "jax":
        raise ValueError(
            "strategy='multi_worker' runs on the JAX backend (Keras 3's model.fit does not "
            "work under TensorFlow's MultiWorkerMirroredStrategy, keras-team/keras#20585); "
            f"the backend is {backend!r}. Set KERAS_BACKEND=jax."
        )
    import jax

    if jax.process_count() == 1:
        logger.warning("multi_worker: jax.distributed is not initialised; running as one process")
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    logger.info("DataParallel over %d devices in %d processes", len(devices), jax.process_count())
    return "multi_worker", contextlib.nullcontext()


def masked_accuracy(y_true, y_pred):
    """Token accuracy over non-padding targets (pad id 0) of one batch.

    `y_pred`: logits `[B, T, V]`, or the predicted ids `[B, T]` (what a fused
    training step hands its metrics, `fused_training`).
    """
    ops = keras.ops
    mask = ops.cast(ops.not_equal(y_true, 0), "float32")
    predicted = y_pred if len(y_pred.shape) == len(y_true.shape) else ops.argmax(y_pred, axis=-1)
    correct = ops.cast(ops.equal(ops.cast(predicted, y_true.dtype), y_true), "float32")
    return ops.sum(correct * mask) / ops.maximum(ops.sum(mask), 1.0)


def compile_model(
    model,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    label_smoothing=0.1,
    gradient_accumulation_steps=None,
    jit_compile="auto",
    strategy_name="none",
):
    """Adam(0.9, 0.98, 1e-9) with the paper's warmup schedule and label-smoothed loss.

    Args:
        model: a `TransformerModel`.
        warmup_steps: int, the schedule's warmup (4000 in the paper).
        learning_rate_scale: float, multiplies the paper's learning rate.
        label_smoothing: float, epsilon_ls (0.1 in the paper).
        gradient_accumulation_steps: optional int k: one update every k
            batches, from their mean gradient (the paper's ~25k-token batches
            on one device). The schedule counts updates (`WarmupSchedule`
            is told k); 1 or None: no accumulation.
        jit_compile: "auto" (Keras' choice, but off under MirroredStrategy,
            see the module docstring, and off on CPU TensorFlow, where it
            was slower here), or a bool.
        strategy_name: the name returned by `resolve_strategy`.
    """
    accumulation = accumulation_steps(gradient_accumulation_steps)
    if jit_compile == "auto":
        if strategy_name == "mirrored":
            jit_compile = False
        elif keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            jit_compile = bool(tf.config.list_logical_devices("GPU"))
    # Keras' Adam, updating in place (`InPlaceAdam`: the same formula and variables).
    optimizer = InPlaceAdam(
        learning_rate=WarmupSchedule(
            model.hidden_dim, warmup_steps=warmup_steps, scale=learning_rate_scale,
            gradient_accumulation_steps=accumulation,
        ),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9,
        gradient_accumulation_steps=accumulation,
    )
    model.compile(
        optimizer=optimizer,
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing),
        metrics=[masked_accuracy],
        jit_compile=jit_compile,
    )
    return model


def accumulation_steps(gradient_accumulation_steps):
    """Micro-batches per update as Keras' optimizer takes it: None for 1 (Keras refuses 1)."""
    k = gradient_accumulation_steps
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
        raise ValueError(f"gradient_accumulation_steps={k!r} must be None or an integer >= 1")
    return int(k) if k and k > 1 else None


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


# ---------------------------------------------------------------------- #
# The main job: parallel text in, preset directory out.
# ---------------------------------------------------------------------- #
STATE_FILE = "state.json"
TRAINING_DIR = "training"
RESUME_FILE = "resume.weights.h5"  # in training/backup/
RESUME_ATTRIBUTE = "keras_transformer_resume"
MODEL_CONFIG_FILE = "model_config.json"  # in training/: a fine-tuning run's architecture, read at its resume
RANDOM_STATE = "random_state"  # in the resume point: what draws the dropout masks (`_random_state`)
# Arguments that may differ when an interrupted run is resumed: they do not
# change what was already trained (the total length may grow or shrink down
# to what is done). Every other recorded argument must be repeated as given.
RESUMABLE_CHANGES = (
    "steps", "epochs", "keep_checkpoints", "average_last", "checkpoint_every_minutes", "strategy", "jit_compile",
    "bleu_beam_size", "validation_bleu", "validation_bleu_sentences",
)


class UserInputError(Exception):
    """Raised (as a ValueError or OSError subclass) for bad arguments, data or output paths.

    Nothing has been written when it is raised; the CLI prints its message
    as one line and exits with status 2.
    """


class BadArgumentError(UserInputError, ValueError):
    """An argument, a value in the data, or a difference from the interrupted run."""


class InputFileError(UserInputError, FileNotFoundError):
    """A data or preset file that does not exist."""


class OutputDirectoryError(UserInputError, FileExistsError):
    """An `output_dir` that must not be touched (not ours, finished, or unreadable state)."""


def _as_input_error(error):
    if isinstance(error, UserInputError):
        return error
    if isinstance(error, FileNotFoundError):
        return InputFileError(str(error))
    if isinstance(error, FileExistsError):
        return OutputDirectoryError(str(error))
    return BadArgumentError(str(error))


def save_resume_point(model, path, intervals, **info):
    """Writes the weights, the optimizer state and the number of finished intervals as one file.

    The file is written under a temporary name and renamed, so a kill leaves
    either the previous resume point or this one, never a mixture (Keras'
    `BackupAndRestore` writes its weights in place and the epoch in a second
    file).
    """
    state = {"intervals": int(intervals), "step": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
             RANDOM_STATE: _random_state(model), **info}
    with atomic_path(path, suffix=".weights.h5") as temporary:
        model.save_weights(temporary, overwrite=True)
        with h5py.File(temporary, "r+") as handle:
            handle.attrs[RESUME_ATTRIBUTE] = json.dumps(state)
            lora.save_resume_state(model, handle)  # a LoRA model's frozen kernels and adapters, unmerged


def _seed_state_variables(model):
    """The state variable of each of the model's `SeedGenerator`s (the dropouts'), in the model's order.

    In order, not by path: a path holds names numbered across the process
    (`seed_generator_14`), which another process or model numbers otherwise.
    """
    return [variable for variable in model.non_trainable_variables if variable.name == "seed_generator_state"]


def _random_state(model):
    """What draws the dropout masks: the `SeedGenerator` states, and on PyTorch torch's own generators.

    Keras' PyTorch backend runs an unseeded `Dropout` with
    `torch.nn.functional.dropout`, which draws from torch's global generator
    (CPU, and each CUDA device's), not from the layer's `SeedGenerator`.
    """
    state = {"seed_generators": [[int(x) for x in keras.ops.convert_to_numpy(variable)]
                                 for variable in _seed_state_variables(model)]}
    if keras.backend.backend() == "torch":
        import torch

        def encode(tensor):
            return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")

        state["torch"] = encode(torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [encode(tensor) for tensor in torch.cuda.get_rng_state_all()]
    return state


def _restore_seed_generators(model, state, path):
    variables = _seed_state_variables(model)
    saved = state.get("seed_generators", [])
    if len(saved) != len(variables):
        # load_weights accepted the weights, so the architecture is the saved one.
        raise OutputDirectoryError(f"The resume point {path} holds {len(saved)} dropout random states and the "
                                   f"model {len(variables)}; pass --overwrite to start again")
    for values, variable in zip(saved, variables):
        variable.assign(np.asarray(values, dtype=variable.dtype))


def _restore_torch_generators(state):
    if keras.backend.backend() != "torch" or "torch" not in state:
        return
    import torch

    def decode(text):
        return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())

    torch.set_rng_state(decode(state["torch"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(text) for text in state["torch_cuda"]])


def load_resume_point(model, path):
    """Restores what `save_resume_point` wrote into a model built and compiled as the saved one.

    The weights and the optimizer state (Keras' `load_weights`), and the
    dropouts' `SeedGenerator` states, which Keras' weight files leave out
    (`Layer.save_own_variables` skips them): without them a resumed run drew
    step 0's dropout masks again, and its weights left an uninterrupted
    run's. On PyTorch the masks come from torch's generators, which `fit`
    itself draws from before its first step (its symbolic build runs the
    model): pass the returned state to `ResumePoint(..., random_state=)`,
    which restores them before the first step. A resume point written before
    the random state was kept restores weights and optimizer only.

    Returns:
        The saved random state (`RANDOM_STATE`), or None for an older resume point.
    """
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    with h5py.File(path, "r") as handle:
        lora_state = lora.read_resume_state(model, handle, path)  # a LoRA model's W, A and B, checked
    model.load_weights(str(path))
    lora.restore_resume_state(lora_state)  # over the merged kernels that load_weights set
    state = read_resume_point(path).get(RANDOM_STATE)
    if state is not None:
        _restore_seed_generators(model, state, path)
    return state


def read_resume_point(path):
    """The dict stored by `save_resume_point`, or None when `path` holds none."""
    if not os.path.isfile(path):
        return None
    try:
        with h5py.File(path, "r") as handle:
            return json.loads(handle.attrs[RESUME_ATTRIBUTE])
    except (OSError, KeyError, ValueError) as error:
        # Written atomically, so only a damaged disk or a foreign file gets here.
        raise OutputDirectoryError(
            f"The resume point {path} is unreadable ({error}); the checkpoints beside it are in "
            f"{pathlib.Path(path).parent.parent / 'checkpoints'}. Pass --overwrite to start again"
        ) from None


class ResumePoint(keras.callbacks.Callback):
    """Saves a resume point (`save_resume_point`) at the end of every interval ("epoch" of `fit`).

    `random_state`: what `load_resume_point` returned, when this `fit`
    continues from a resume point: torch's generators are set to it before
    the first step, where the uninterrupted run had them after writing the
    resume point (the `SeedGenerator` states were restored by the load).
    A new `fit` draws from torch's generator before its first step (its
    symbolic build runs the model; its data loader draws a base seed), and
    the uninterrupted run's `fit`, going on, did not.
    """

    def __init__(self, path, random_state=None):
        super().__init__()
        self.path = pathlib.Path(path)
        self.random_state = random_state

    def on_train_batch_begin(self, batch, logs=None):
        if self.random_state is not None:
            _restore_torch_generators(self.random_state)
            self.random_state = None

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            return  # StopOnNaN reports it; resuming from NaN weights would not help
        save_resume_point(self.model, self.path, epoch + 1, loss=None if loss is None else float(loss))


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


# ---------------------------------------------------------------------- #
# The arguments of a run, checked once.
# ---------------------------------------------------------------------- #
DEFAULT_PRESET = "small"  # the architecture of a run that names neither preset nor init_from
# The validation BLEU at the end scores at most this many sentences (the first ones): the bundled
# corpus's whole validation split (469), and a bounded share of a large one (beam search is the slow part).
DEFAULT_VALIDATION_BLEU_SENTENCES = 500
# The integer arguments (checked in this order; `seed` may be 0, `max_length`
# is >= 3, the others are >= 1) and those of them that may be None.
_INTEGERS = ("vocabulary_size", "tokens_per_batch", "max_length", "warmup_steps", "gradient_accumulation_steps",
             "checkpoint_every", "keep_checkpoints", "average_last", "bleu_beam_size", "validation_bleu_sentences",
             "seed", "tokenizer_max_sentences", "steps", "epochs")
_OPTIONAL_INTEGERS = ("steps", "epochs", "vocabulary_size", "gradient_accumulation_steps", "tokenizer_max_sentences",
                      "average_last")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What `run_training` is asked to do: its keyword arguments, their defaults and their checks.

    The fields are `run_training`'s arguments (documented there) with the
    same defaults. A config is checked when it is made, so one that exists
    is valid: nonsense raises `BadArgumentError` naming the first bad value.
    `dataclasses.replace(config, steps=...)` makes a changed, checked copy.

    Example:

    ```python
    config = TrainingConfig(preset="tiny", steps=200, checkpoint_every=50)
    metadata = run_training("runs/tiny", config, verbose=0)  # keywords override fields
    finetune = TrainingConfig(init_from="opus_mt_en_de", steps=1000, learning_rate_scale=0.1)
    ```
    """

    preset: object = None  # None: DEFAULT_PRESET, unless init_from is given
    init_from: object = None
    train_src: object = None
    train_tgt: object = None
    valid_src: object = None
    valid_tgt: object = None
    vocabulary_size: object = None
    tokens_per_batch: int = 25000
    steps: object = None
    epochs: object = None
    max_length: int = 128
    warmup_steps: int = 4000
    learning_rate_scale: float = 1.0
    label_smoothing: float = 0.1
    gradient_accumulation_steps: object = None
    checkpoint_every: int = 500
    checkpoint_every_minutes: object = None
    keep_checkpoints: int = 5
    average_last: object = None
    strategy: str = "auto"
    mixed_precision: object = None
    jit_compile: object = "auto"
    bleu_beam_size: int = 4
    validation_bleu: bool = True
    validation_bleu_sentences: int = DEFAULT_VALIDATION_BLEU_SENTENCES
    seed: int = 0
    overwrite: bool = False
    verbose: object = None
    model_overrides: object = None
    tokenizer_max_sentences: object = None
    lora_rank: object = None  # None: every weight trains
    lora_targets: object = None  # None: lora.DEFAULT_LORA_TARGETS
    source_language: object = None  # a multilingual checkpoint's (NLLB-200's) language codes, with init_from
    target_language: object = None

    def __post_init__(self):
        _check_config(self)

    @property
    def model_preset(self):
        """What the model is built from: `init_from` (architecture, weights, tokenizer), else `preset`."""
        if self.init_from is not None:
            return self.init_from
        return self.preset if self.preset is not None else DEFAULT_PRESET

    @property
    def micro_batches(self):
        """Batches per optimizer update (`gradient_accumulation_steps`, 1 without accumulation)."""
        return self.gradient_accumulation_steps or 1

    @property
    def checkpoints_averaged(self):
        """`average_last`, or the preset's default (`default_average_last`)."""
        return self.average_last if self.average_last is not None else default_average_last(self.model_preset)

    def recorded_arguments(self, train_pairs, valid_pairs):
        """The arguments as `state.json` records them (a resume compares them), with the data's size."""
        vocabulary_size = self.vocabulary_size
        preset = self.model_preset if self.init_from is None else None
        if isinstance(preset, str) and preset in PRESETS:
            vocabulary_size = vocabulary_size or PRESETS[preset]["config"]["vocabulary_size"]
        # init_from is recorded when given: a run without it records the keys runs always recorded.
        fine_tuning = {"init_from": _path_or_name(self.init_from)} if self.init_from is not None else {}
        if self.source_language is not None or self.target_language is not None:
            fine_tuning.update(source_language=self.source_language, target_language=self.target_language)
        if self.lora_rank is not None:
            # The layers adapted: "attention" and its four projections by name are the same run.
            fine_tuning.update(lora_rank=self.lora_rank, lora_targets=list(lora.target_layer_names(self.lora_targets)))
        arguments = {
            "preset": _path_or_name(preset), **fine_tuning, "train_src": _path_or_name(self.train_src),
            "train_tgt": _path_or_name(self.train_tgt), "valid_src": _path_or_name(self.valid_src),
            "valid_tgt": _path_or_name(self.valid_tgt), "train_pairs": train_pairs, "valid_pairs": valid_pairs,
            "vocabulary_size": vocabulary_size, "tokenizer_max_sentences": self.tokenizer_max_sentences,
            "tokens_per_batch": self.tokens_per_batch, "steps": self.steps, "epochs": self.epochs,
            "max_length": self.max_length, "warmup_steps": self.warmup_steps,
            "learning_rate_scale": self.learning_rate_scale, "label_smoothing": self.label_smoothing,
            "gradient_accumulation_steps": accumulation_steps(self.gradient_accumulation_steps),
            "checkpoint_every": self.checkpoint_every, "checkpoint_every_minutes": self.checkpoint_every_minutes,
            "keep_checkpoints": self.keep_checkpoints, "average_last": self.checkpoints_averaged,
            "strategy": self.strategy, "mixed_precision": self.mixed_precision, "jit_compile": self.jit_compile,
            "bleu_beam_size": self.bleu_beam_size, "seed": self.seed,
            "model_overrides": dict(self.model_overrides or {}),
            # Recorded when not the default, so that a run recorded before these existed resumes as it was.
            **({"validation_bleu": False} if not self.validation_bleu else {}),
            **({"validation_bleu_sentences": self.validation_bleu_sentences}
               if self.validation_bleu_sentences != DEFAULT_VALIDATION_BLEU_SENTENCES else {}),
        }
        return json.loads(json.dumps(arguments, default=str))  # as it reads back from state.json


def _check_config(config):
    """Raises `BadArgumentError` naming the first nonsense argument of `config`."""
    if config.steps is not None and config.epochs is not None:
        raise BadArgumentError(
            f"Pass steps or epochs, not both (received steps={config.steps}, epochs={config.epochs})"
        )
    for name in _INTEGERS:
        value = getattr(config, name)
        if value is None and name in _OPTIONAL_INTEGERS:
            continue
        # A kept pair has a target of start + at least one token + end (`data.encode_pairs`).
        minimum = {"seed": 0, "max_length": 3}.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise BadArgumentError(f"{name}={value!r} must be an integer >= {minimum}")
    scale, minutes, smoothing = config.learning_rate_scale, config.checkpoint_every_minutes, config.label_smoothing
    if not (isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0):
        raise BadArgumentError(f"learning_rate_scale={scale!r} must be a number > 0")
    if minutes is not None and not (
        isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and np.isfinite(minutes) and minutes > 0
    ):
        raise BadArgumentError(f"checkpoint_every_minutes={minutes!r} must be a number > 0")
    if not (isinstance(smoothing, (int, float)) and 0.0 <= smoothing < 1.0):
        raise BadArgumentError(f"label_smoothing={smoothing!r} must be in [0, 1)")
    if config.strategy not in STRATEGIES:
        raise BadArgumentError(f"strategy={config.strategy!r} must be one of {STRATEGIES}")
    if config.mixed_precision is not None and config.mixed_precision not in MIXED_PRECISIONS:
        raise BadArgumentError(
            f"mixed_precision={config.mixed_precision!r} must be None or one of {MIXED_PRECISIONS}"
        )
    if config.jit_compile not in ("auto", True, False):
        raise BadArgumentError(f"jit_compile={config.jit_compile!r} must be 'auto', True or False")
    if not isinstance(config.validation_bleu, (bool, np.bool_)):
        raise BadArgumentError(f"validation_bleu={config.validation_bleu!r} must be True or False")
    if config.init_from is not None:
        _check_init_from(config)
    else:
        _check_preset(config.model_preset)
        if config.source_language is not None or config.target_language is not None:
            raise BadArgumentError("--source-language and --target-language name a multilingual checkpoint's "
                                   "languages: pass them with --init-from")
    _check_lora(config)
    unpaired = [(config.train_src, config.train_tgt), (config.valid_src, config.valid_tgt)]
    if any((src is None) != (tgt is None) for src, tgt in unpaired):
        raise BadArgumentError("Pass --train-src with --train-tgt, and --valid-src with --valid-tgt")


def _check_lora(config):
    """Raises `BadArgumentError` for a bad `lora_rank` or `lora_targets`, or LoRA on a model trained from scratch."""
    rank, targets = config.lora_rank, config.lora_targets
    if rank is None:
        if targets is not None:
            raise BadArgumentError(f"lora_targets={targets!r} needs lora_rank (--lora-rank R)")
        return
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise BadArgumentError(f"lora_rank={rank!r} must be an integer >= 1")
    try:
        lora.target_layer_names(targets, name="lora_targets")
    except ValueError as error:
        raise BadArgumentError(str(error)) from None
    if config.init_from is None:
        raise BadArgumentError(
            f"lora_rank={rank} adapts a trained model: pass --init-from (a preset trains from random weights and "
            "a new vocabulary, which LoRA would freeze)"
        )


def _check_preset(preset):
    """Raises `BadArgumentError` unless `preset` is a built-in name or a directory with config.json.

    A pretrained checkpoint is refused with the way to fine-tune it (`init_from`).
    """
    pretrained = (isinstance(preset, str) and (preset in PRETRAINED_PRESETS or is_hf_handle(preset))) or (
        isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset) and hf_model_type(preset) is not None
    )
    if pretrained:
        raise BadArgumentError(
            f"--preset {preset} is a pretrained checkpoint, whose tokenizer must be kept: fine-tune it "
            f"with --init-from {preset} (and no --preset)"
        )
    if isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset):
        if not os.path.isfile(os.path.join(preset, "config.json")):
            raise BadArgumentError(
                f"--preset {preset} is a directory without config.json; pass a preset directory or one of "
                f"{', '.join(PRESETS)}"
            )
    elif not (isinstance(preset, str) and preset in PRESETS):
        raise BadArgumentError(f"Unknown preset {preset!r}: use one of {', '.join(PRESETS)} or a preset directory")


_INIT_FROM_CHOICES = (f"a trained preset directory, a Hugging Face checkpoint directory, hf://org/name or one of "
                      f"{', '.join(PRETRAINED_PRESETS)}")


def _check_init_from(config):
    """Raises `BadArgumentError` unless `config.init_from` names a trained model and nothing contradicts it.

    The one rule: `preset` is an architecture trained from scratch with a new
    vocabulary, `init_from` a trained model fine-tuned with its own tokenizer;
    a run takes one of them, and nothing that would make a new vocabulary.
    """
    init_from = config.init_from
    if config.preset is not None:
        raise BadArgumentError(
            f"Pass --preset (an architecture trained from scratch) or --init-from (a trained model to fine-tune), "
            f"not both (received preset={str(config.preset)!r}, init_from={str(init_from)!r}); "
            "a fine-tuned model keeps the architecture of its checkpoint"
        )
    for name in ("vocabulary_size", "tokenizer_max_sentences"):
        if getattr(config, name) is not None:
            raise BadArgumentError(
                f"{name}={getattr(config, name)!r} is for training a new vocabulary, but a run with --init-from "
                f"keeps the tokenizer of {init_from}; drop --{name.replace('_', '-')}"
            )
    if isinstance(init_from, str) and init_from in PRESETS:
        raise BadArgumentError(
            f"--init-from {init_from} is an architecture with random weights: train it with --preset {init_from}, "
            f"or fine-tune {_INIT_FROM_CHOICES}"
        )
    if not isinstance(init_from, (str, os.PathLike)):
        raise BadArgumentError(f"--init-from {init_from!r} is not a directory; pass {_INIT_FROM_CHOICES}")
    # A directory is checked when a run reads it (`_import_model`): a resumed run does not, and an hf://
    # handle is resolved (downloaded, or found in the cache) then.


def _check_init_directory(init_from):
    """Raises `BadArgumentError` unless a local `init_from` is a directory with config.json."""
    if isinstance(init_from, str) and (init_from in PRETRAINED_PRESETS or is_hf_handle(init_from)):
        return
    if not os.path.isdir(init_from):
        raise BadArgumentError(f"--init-from {init_from!r} is not a directory; pass {_INIT_FROM_CHOICES}")
    if not os.path.isfile(os.path.join(init_from, "config.json")):
        raise BadArgumentError(f"--init-from {init_from} is a directory without config.json; pass {_INIT_FROM_CHOICES}")


def default_average_last(preset):
    """Checkpoints averaged by default: the built-in preset's `average_last` (paper 6.1), else 5."""
    presets = {**PRESETS, **PRETRAINED_PRESETS}
    if isinstance(preset, str) and preset in presets:
        return presets[preset].get("average_last", 5)
    return 5


def _path_or_name(value):
    """A file or directory as an absolute path (the comparison on resume); a name, hf:// handle or None as it is."""
    if value is None or (isinstance(value, str) and (value in PRESETS or value in PRETRAINED_PRESETS)):
        return value
    if is_hf_handle(value):
        return value
    return os.path.abspath(os.fspath(value))


# ---------------------------------------------------------------------- #
# run_training and its stages: prepare, data, model, fit, finalize.
# ---------------------------------------------------------------------- #
def run_training(output_dir, config=None, **overrides):
    """Trains a Transformer on parallel text and writes a preset directory.

    Without data paths it trains on the bundled LibreOffice English-German
    corpus. A run trains an architecture (`preset`) from random weights with
    a new shared vocabulary, or fine-tunes a trained model (`init_from`)
    with the tokenizer it was trained with. A killed run resumes from its
    last resume point when the same command is run again: every
    `checkpoint_every` steps the weights, the optimizer state and the
    interval count are written as one file, atomically (`save_resume_point`).
    A resumed run must repeat the recorded arguments, except those in
    `RESUMABLE_CHANGES`, which are applied and recorded.

    Everything (arguments, data, the output directory, the interrupted run's
    arguments) is checked before anything is written; such errors are
    `UserInputError`s. The preset is staged beside `output_dir` and swapped
    in at the end, so `output_dir` never holds weights without config.json.

    The work is done in stages, each a function below: `_prepare` (the
    work directory and the resume decision; reads only), `_prepare_data`
    (tokenizer, the imported model, batches; reads only), `_start` (the first writes),
    `_build_model`, `_fit`, `_average` (averaging, validation loss) and
    `_finalize` (the averaged model, metadata, validation BLEU, installing
    the preset). Checkpoints and the averaged weights hold the model's
    weights only; the resume point holds the optimizer state too. At most
    one model with an optimizer state is in memory at a time: the imported
    model is freed once its weights are copied, and the trained model
    before the averaged one is built.

    Args:
        output_dir: where the preset (config.json, model.weights.h5 with
            the averaged weights, the tokenizer's files, metadata.json) is
            written; `output_dir/training/` keeps checkpoints and resume state.
        config: optional `TrainingConfig`; the keyword arguments below
            override its fields (without one, they override the defaults).
        preset: architecture preset name, or a preset directory (its
            architecture and weights with a new vocabulary); default "small"
            (`DEFAULT_PRESET`). Not with `init_from`.
        init_from: a trained model to fine-tune, anything
            `TransformerModel.from_preset` loads with weights and a tokenizer:
            a preset directory written by this function, a Hugging Face
            Marian checkpoint directory, an "hf://org/name" handle or a named
            pretrained preset ("opus_mt_en_de"). Its architecture, weights and
            tokenizer are kept (sources are encoded as source text, targets
            with `target=True`); no vocabulary is trained, so `preset`,
            `vocabulary_size` and `tokenizer_max_sentences` are refused.
            `model_overrides` may change what the checkpoint allows (e.g.
            `dropout`).
        lora_rank: optional int r: fine-tune `init_from` with LoRA
            (`TransformerModel.enable_lora`): only rank-r adapters of the
            `lora_targets` train, every other weight is frozen. Checkpoints,
            the averaged weights and the preset hold the merged kernels (an
            ordinary model); the resume point also keeps the adapters.
        lora_targets: what LoRA adapts (with `lora_rank`): a name or list of
            names of `lora.LORA_TARGET_NAMES`; default "attention" (every
            attention projection), "feedforward" adds the feed-forward layers.
        train_src, train_tgt, valid_src, valid_tgt: parallel text files.
        vocabulary_size: shared subword vocabulary; default: the preset's.
        tokens_per_batch: token budget per side of a batch (paper: ~25000).
            With gradient accumulation this is the micro-batch: an update
            sees `gradient_accumulation_steps * tokens_per_batch` tokens.
        steps, epochs: training length in optimizer updates or passes over
            the data (at most one may be given; default 10 epochs), rounded
            up to a multiple of `checkpoint_every`.
        max_length: longest sequence in tokens; longer pairs are dropped.
        warmup_steps, learning_rate_scale: the paper's schedule.
        label_smoothing: epsilon_ls.
        gradient_accumulation_steps: optional int k: each update averages
            the gradients of k batches. Every count in this function
            (`steps`, `warmup_steps`, `checkpoint_every`, checkpoint names,
            `metadata.json`) is of updates, not batches.
        checkpoint_every: updates between resume points, and between
            checkpoints unless `checkpoint_every_minutes` is given.
        checkpoint_every_minutes: optional number: write the checkpoints
            that are averaged every this many minutes of training instead
            (the paper: 10), and after the last update.
        keep_checkpoints: checkpoints kept on disk.
        average_last: average the last K checkpoints into the final weights;
            default: the preset's (`PRESETS[name]["average_last"]`: 5 for
            base, 20 for big, as in the paper), 5 for a preset directory.
        strategy: see `resolve_strategy`.
        mixed_precision: None or "float32", "mixed_bfloat16",
            "mixed_float16" (loss scaling is added by Keras for float16), or
            "auto": bfloat16 where the machine computes it natively
            (`native_bfloat16`: a CPU with AVX512-BF16 or AMX, a GPU of compute
            capability 8.0+), else float32.
        jit_compile: see `compile_model`.
        bleu_beam_size: beam for the validation BLEU at the end.
        validation_bleu: bool; False skips the validation BLEU at the end
            (beam search over the validation sentences: minutes for a base-
            sized model on a CPU); the validation loss is still computed.
        validation_bleu_sentences: the validation BLEU scores the first this
            many validation sentences (default 500: all of the bundled
            corpus's 469); `metadata.json` records how many were scored
            (`valid_bleu_sentences`, 0 when skipped) of how many
            (`valid_sentences`). The validation loss uses all of them.
        seed: data shuffling and initialisation seed.
        overwrite: replace an existing run or preset in `output_dir` (only a
            directory written by this trainer, or an empty one). The new run
            trains in `.NAME.new/` beside it (resumable with the same command)
            and replaces `output_dir` only when it is complete.
        verbose: 0: no progress shown; 1: a progress bar in steps (with the
            pass over the data, loss, learning rate and ETA) and a line per
            checkpoint; 2: the lines only (see `TrainingProgress`); default:
            1 on a terminal, 2 otherwise. The lines are logged at INFO.
        model_overrides: optional dict of TransformerModel arguments (with
            `init_from`, those its checkpoint allows).
        tokenizer_max_sentences: optional int: train the shared vocabulary on
            a reproducible sample of this many sentences (source and target
            lines together) instead of all of them; a few million are plenty
            for WMT-sized corpora.

    Returns:
        dict: the metadata written to `metadata.json`.
    """
    started = time.time()
    config = _configure(config, overrides)
    output_dir = pathlib.Path(os.path.abspath(output_dir))  # `.`, `runs/x/`: a name to stage beside
    # A preset installation that a kill interrupted is completed first (it is
    # the newest state of the run), then nothing is written until every
    # argument, the data and the interrupted run have been checked.
    _finish_interrupted_install(output_dir)
    with _input_errors():
        run = _prepare(output_dir, config, started)
        if run.finished is not None:
            return run.finished
        data = _prepare_data(run)
    # From here on the run writes, in `run.root / training` only.
    _start(run, data)
    mixed_precision = resolve_mixed_precision(config.mixed_precision)
    with _global_policy(mixed_precision):
        model, strategy_name = _build_model(run, data)
        final_train_loss = _fit(run, data, model, strategy_name)
        averaged = _average(run, data, model)
        del model
        gc.collect()  # frees the trained model and its optimizer state (reference cycles) before `_finalize`
        trained = {"strategy": strategy_name, "mixed_precision": mixed_precision, "final_train_loss": final_train_loss}
        return _finalize(run, data, averaged, trained)


def _configure(config, overrides):
    """`config` (default: `TrainingConfig()`) with `overrides` applied, checked."""
    if config is None:
        config = TrainingConfig()
    elif not isinstance(config, TrainingConfig):
        raise TypeError(f"config={config!r} must be a TrainingConfig (pass the other arguments by keyword)")
    unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(TrainingConfig)})
    if unknown:
        raise TypeError(f"run_training() got unknown argument(s) {unknown}; see TrainingConfig for the allowed ones")
    return dataclasses.replace(config, **overrides) if overrides else config


@contextlib.contextmanager
def _input_errors():
    """Re-raises a ValueError or OSError (bad data, a missing file) as the `UserInputError` it is."""
    try:
        yield
    except (ValueError, OSError) as error:
        raise _as_input_error(error) from error


@contextlib.contextmanager
def _global_policy(mixed_precision):
    """Sets Keras' (global) mixed-precision policy for this run only.

    The written preset is float32 (the compute dtype is the user's choice
    when loading it, not a leftover of how it was trained).
    """
    previous = keras.mixed_precision.global_policy()
    try:
        if mixed_precision:
            keras.mixed_precision.set_global_policy(mixed_precision)
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


@dataclasses.dataclass
class _Texts:
    """The parallel text of a run: the files read (the bundled corpus by default) and their lines."""

    paths: dict  # {"train": (src, tgt), "valid": (src, tgt)}
    train_sources: list
    train_targets: list
    valid_sources: list
    valid_targets: list


@dataclasses.dataclass
class _Run:
    """What `_prepare` decided: where the run trains, its recorded arguments, and what it continues."""

    config: TrainingConfig
    output_dir: pathlib.Path
    root: pathlib.Path  # holds `training/`: `output_dir`, or `.NAME.new/` under --overwrite
    texts: _Texts
    arguments: dict  # as recorded in state.json
    state: dict = None  # the interrupted run's state.json; None: start afresh
    resume: dict = None  # its resume point (`read_resume_point`); None: train from step 0
    changes: dict = dataclasses.field(default_factory=dict)  # {argument: (recorded, now)}
    finished: dict = None  # the metadata of the identical finished run: nothing to do
    started: float = 0.0  # time.time() at the start

    @property
    def work(self):
        return self.root / TRAINING_DIR

    @property
    def resume_path(self):
        return self.work / "backup" / RESUME_FILE


def _prepare(output_dir, config, started):
    """Stage 1 (reads only): chooses the work root, reads the data and the interrupted state, decides the resume.

    Raises `OutputDirectoryError` for an output that must not be touched and
    `BadArgumentError` for a resume whose arguments differ where they may not.
    """
    root, state = _choose_work_root(output_dir, config.overwrite)
    texts = _read_texts(config)
    arguments = config.recorded_arguments(len(texts.train_sources), len(texts.valid_sources))
    run = _Run(config, output_dir, root, texts, arguments, state=state, started=started)
    if state is not None:
        _decide_resume(run)
    return run


def _read_texts(config):
    """The training and validation lines (the bundled corpus when no training files are given)."""
    train_src, train_tgt, valid_src, valid_tgt = config.train_src, config.train_tgt, config.valid_src, config.valid_tgt
    if train_src is None:
        train_src, train_tgt = datasets.bundled_paths("train")
        if valid_src is None:
            valid_src, valid_tgt = datasets.bundled_paths("valid")
    train_sources, train_targets = data_lib.read_parallel(train_src, train_tgt)
    valid_sources, valid_targets = data_lib.read_parallel(valid_src, valid_tgt) if valid_src is not None else ([], [])
    paths = {"train": (train_src, train_tgt), "valid": (valid_src, valid_tgt)}
    return _Texts(paths, train_sources, train_targets, valid_sources, valid_targets)


def _decide_resume(run):
    """Resume the interrupted run in `run.root`, start it again, or say why neither (sets `run`'s fields)."""
    root, work = run.root, run.work
    if "arguments" not in run.state:
        raise OutputDirectoryError(
            f"{root} was written by an older version of this trainer, whose backups cannot be "
            f"resumed safely; its checkpoints are in {work / 'checkpoints'}. Pass --overwrite to start again"
        )
    run.changes = changes = _describe_changes(run.state["arguments"], run.arguments)
    if run.state.get("finished"):
        if not changes:
            logger.info("%s already holds the finished run of these arguments; nothing to do", run.output_dir)
            run.finished = json.loads((run.output_dir / "metadata.json").read_text(encoding="utf-8"))
            return
        raise OutputDirectoryError(
            f"{run.output_dir} holds a finished training run (with {_format_changes(changes)}); "
            "pass --overwrite to train again"
        )
    run.resume = resume = read_resume_point(run.resume_path)
    if resume is None and changes:
        logger.info("%s has no finished interval: starting it again with the new arguments", root)
        run.state = None
    elif resume is not None and root != run.output_dir and changes:
        logger.warning(
            "Discarding the interrupted --overwrite run in %s (%s): starting it again", root, _format_changes(changes)
        )
        run.state, run.resume = None, None
    elif resume is not None:
        fixed = {k: v for k, v in changes.items() if k not in RESUMABLE_CHANGES}
        if fixed:
            raise BadArgumentError(
                f"{root} holds an interrupted run ({resume['step']} steps done) with other arguments: "
                f"{_format_changes(fixed)}. Repeat the original arguments to resume it, or pass "
                "--overwrite to start again (the run there is kept until the new one is complete)"
            )


@dataclasses.dataclass
class _Data:
    """What `_prepare_data` made: the shared vocabulary, the batches, and the run's length in updates.

    Everything counts optimizer updates; one update is `micro` batches, a
    Keras fit "epoch" is one interval of `interval` updates (a resume point).
    """

    tokenizer: object
    new_tokenizer: bool  # trained or imported by this run (else loaded from `training/`)
    train_pairs: int  # pairs kept after encoding
    train_data: object  # repeated, positioned after what a resumed run has trained
    valid_data: object  # None without validation text
    batches_per_epoch: int  # batches in one pass over the training data
    micro: int
    interval: int
    total_steps: int  # a multiple of `interval`
    fit_epochs: int  # total_steps // interval
    initial_epoch: int  # intervals already trained
    imported: object = None  # init_from's model (`_import_model`), for a run that starts from its weights
    imported_config: dict = None  # init_from's architecture (a resumed run's: recorded in training/); None: `preset`


def _bind_languages(tokenizer, config):
    """`tokenizer` bound to the run's language pair when it is a multilingual one (NLLB-200's); checked."""
    bind = getattr(tokenizer, "with_languages", None)
    if bind is None:
        if config.source_language is not None or config.target_language is not None:
            raise BadArgumentError(f"--source-language/--target-language: {config.init_from} translates one "
                                   "language pair and has no language codes; leave them out")
        return tokenizer
    try:
        for name in ("source_language", "target_language"):
            tokenizer.check_language(name, getattr(config, name))
    except ValueError as error:
        raise BadArgumentError(f"--init-from {config.init_from}: {error} (--source-language, --target-language)") from None
    return bind(config.source_language, config.target_language)


def _prepare_data(run):
    """Stage 2 (reads only): the tokenizer (kept across a resume), the model to fine-tune, the batches and the schedule.

    Raises `BadArgumentError` when a resume asks for fewer steps than are done.
    """
    config, texts = run.config, run.texts
    imported = imported_config = None
    if config.init_from is not None:
        # A run resumed from a resume point has its weights there, its tokenizer and its architecture in
        # training/: the checkpoint it started from is not read again (it may be gone, or offline).
        imported_config = _recorded_model_config(run) if run.resume is not None else None
        if imported_config is None:
            imported = _import_model(config)
            imported_config = jsonable_config(imported.get_config())
    saved = load_tokenizer(run.work) if run.state is not None else None
    if saved is not None:
        tokenizer, new_tokenizer = saved, False
    elif imported is not None:
        tokenizer, new_tokenizer = imported.tokenizer, True
        logger.info("Fine-tuning %s with its %s (%d pieces); no vocabulary is trained", config.init_from,
                    type(tokenizer).__name__, tokenizer.vocabulary_size)
    else:
        vocabulary_size = run.arguments["vocabulary_size"]
        logger.info("Training a %s-token shared vocabulary on %d sentence pairs", vocabulary_size,
                    len(texts.train_sources))
        tokenizer = train_tokenizer(
            texts.train_sources + texts.train_targets, vocabulary_size=vocabulary_size,
            max_sentences=config.tokenizer_max_sentences,
        )
        new_tokenizer = True
    tokenizer = _bind_languages(tokenizer, config)
    train_ids = data_lib.encode_pairs(tokenizer, texts.train_sources, texts.train_targets, config.max_length)
    batching = dict(tokens_per_batch=config.tokens_per_batch, max_length=config.max_length)
    one_pass = data_lib.make_dataset(*train_ids, seed=config.seed, **batching)
    batches_per_epoch = int(one_pass.cardinality())
    micro, interval, total_steps, fit_epochs = _schedule(run, batches_per_epoch)
    initial_epoch = run.resume["intervals"] if run.resume is not None else 0
    train_data = data_lib.make_dataset(*train_ids, seed=config.seed, repeat=True, **batching)
    if initial_epoch:
        # The same batches as an uninterrupted run: skip what was trained.
        train_data = train_data.skip(initial_epoch * interval * micro)
    valid_data = None
    if texts.valid_sources:
        valid_ids = data_lib.encode_pairs(tokenizer, texts.valid_sources, texts.valid_targets, config.max_length)
        valid_data = data_lib.make_dataset(*valid_ids, shuffle=False, **batching)
    return _Data(tokenizer, new_tokenizer, len(train_ids[0]), train_data, valid_data, batches_per_epoch, micro,
                 interval, total_steps, fit_epochs, initial_epoch, imported=imported, imported_config=imported_config)


def _recorded_model_config(run):
    """The architecture a fine-tuning run recorded at its start (`MODEL_CONFIG_FILE`), or None (older runs)."""
    path = run.work / MODEL_CONFIG_FILE
    return _read_run_file(path, "a model config") if path.is_file() else None


def _import_model(config):
    """The model `init_from` names, with its weights and tokenizer (`model_overrides` applied), checked.

    Loaded outside any strategy (stage 2 reads only); `_build_model` makes
    the model that is trained from its config and weights.

    Raises:
        BadArgumentError: the model is quantized, has no tokenizer, `max_length` is longer
            than its positions reach, or an hf:// handle needs the [hub]
            extra. What `from_preset` refuses (a checkpoint it cannot import,
            an override the checkpoint does not allow, an hf:// handle that
            is neither cached nor reachable) is a ValueError or OSError, which
            `run_training` raises as the `UserInputError` it is.
    """
    init_from = config.init_from
    _check_init_directory(init_from)
    try:
        model = TransformerModel.from_preset(init_from, **dict(config.model_overrides or {}))
    except ModuleNotFoundError as error:  # an hf:// handle without the [hub] extra: its message says what to install
        raise BadArgumentError(str(error)) from None
    if model.quantization is not None:
        raise BadArgumentError(
            f"--init-from {init_from} is quantized ({model.quantization!r}): its int8 weights cannot be trained; "
            "fine-tune the float32 preset it was quantized from"
        )
    if model.tokenizer is None:
        raise BadArgumentError(
            f"--init-from {init_from} has no tokenizer: a model is fine-tuned with the tokenizer it was trained "
            "with; pass a directory written by run_training or save_to_preset(directory, tokenizer=...)"
        )
    if config.max_length > model.max_sequence_length:
        raise BadArgumentError(
            f"max_length={config.max_length} is longer than the max_sequence_length={model.max_sequence_length} "
            f"of {init_from}; pass --max-length {model.max_sequence_length} or less"
        )
    return model


def _schedule(run, batches_per_epoch):
    """`(micro, interval, total_steps, fit_epochs)`: batches per update, updates per interval, and the length."""
    config, resume = run.config, run.resume
    micro = config.micro_batches
    total_steps = config.steps if config.steps is not None else -(-(config.epochs or 10) * batches_per_epoch // micro)
    interval = run.state["interval"] if resume is not None else max(1, min(config.checkpoint_every, total_steps))
    fit_epochs = -(-total_steps // interval)
    # Keras runs whole "epochs" of `interval` updates (the resume points), so
    # the total is rounded up to a multiple of the checkpoint interval.
    total_steps = fit_epochs * interval
    if resume is not None and fit_epochs < resume["intervals"]:
        raise BadArgumentError(
            f"The interrupted run in {run.root} has already trained {resume['intervals'] * interval} steps; "
            f"this command asks for {total_steps}. Ask for at least as many steps, or pass --overwrite"
        )
    return micro, interval, total_steps, fit_epochs


def _start(run, data):
    """The first writes: a new `training/` (state and tokenizer), or the resumed state with its changes.

    A new `training/` is assembled beside its place and renamed: it never
    exists without its state. Sets `run.state`.
    """
    work = run.work
    if run.state is None:
        run.state = {"arguments": run.arguments, "interval": data.interval, "steps": data.total_steps,
                     "finished": False, "changes": []}
        with atomic_directory(work) as staging:  # replaces a `training/` that is not resumed
            _write_state(staging / STATE_FILE, run.state)
            data.tokenizer.save(staging)
            if data.imported_config is not None:
                config_text = json.dumps(data.imported_config, indent=2, sort_keys=True) + "\n"
                (staging / MODEL_CONFIG_FILE).write_text(config_text)
        return
    remove_stale_temporaries(work)
    _remove_partial_files(work)
    if data.new_tokenizer:
        data.tokenizer.save(work)
    if run.changes:
        logger.info("Resuming with %s", _format_changes(run.changes))
        changed = {k: list(v) for k, v in run.changes.items()}
        run.state["changes"].append({"at_step": run.resume["step"], "changed": changed})
        run.state["arguments"] = run.arguments
    run.state["steps"] = data.total_steps
    _write_state(work / STATE_FILE, run.state)


def _build_model(run, data):
    """Stage 3: builds and compiles the model under the strategy, restoring the resume point.

    Returns `(model, strategy_name)`.
    """
    config = run.config
    keras.utils.set_random_seed(config.seed)
    strategy_name, scope = resolve_strategy(config.strategy)
    overrides = dict(config.model_overrides or {})
    with scope:
        if data.imported_config is not None:
            # The checkpoint's architecture and weights (a resumed run's: the resume point's, below), in
            # variables made under the strategy.
            model_config = dict(data.imported_config)
            if "dtype" not in overrides:
                model_config.pop("dtype", None)  # the run's policy (mixed precision), as for a preset
            model = TransformerModel.from_config(model_config)
            if data.imported is not None:
                for variable, value in zip(model.weights, data.imported.weights, strict=True):
                    variable.assign(value)  # one weight at a time: no third copy of the weights in memory
                data.imported = None  # freed: the run's model holds its weights now
        else:
            overrides.setdefault("vocabulary_size", data.tokenizer.vocabulary_size)
            overrides.setdefault("max_sequence_length", max(config.max_length, 8))
            model = TransformerModel.from_preset(config.model_preset, **overrides)
        if config.lora_rank is not None:  # before the optimizer and the resume point see the variables
            model.enable_lora(config.lora_rank, targets=config.lora_targets)
            logger.info("LoRA rank %d on %s: %d of %d parameters train", config.lora_rank,
                        ", ".join(model.lora_targets), sum(int(np.prod(v.shape)) for v in model.trainable_weights),
                        model.count_params())
        compile_model(
            model,
            warmup_steps=config.warmup_steps,
            learning_rate_scale=config.learning_rate_scale,
            label_smoothing=config.label_smoothing,
            gradient_accumulation_steps=config.gradient_accumulation_steps,  # compile_model normalizes 1 to None
            jit_compile=config.jit_compile,
            strategy_name=strategy_name,
        )
        if data.initial_epoch:
            load_resume_point(model, run.resume_path)
            logger.info("Resuming %s after step %d (interval %d of %d)", run.root, run.resume["step"],
                        data.initial_epoch, data.fit_epochs)
    return model, strategy_name


def _fit(run, data, model, strategy_name):
    """Stage 4: `model.fit` from the resumed interval to the last, with resume points and checkpoints.

    Returns the last training loss (the resume point's when nothing was left
    to train). Raises `FloatingPointError` when the loss became NaN.
    """
    config, work = run.config, run.work
    nan_guard = StopOnNaN()
    callbacks = [
        # A resumed fit restores torch's generators at its first step (`load_resume_point`).
        ResumePoint(run.resume_path, random_state=run.resume.get(RANDOM_STATE) if data.initial_epoch else None),
        PeriodicCheckpoint(
            work / "checkpoints", every_steps=data.interval, every_minutes=config.checkpoint_every_minutes,
            keep=max(config.keep_checkpoints, config.checkpoints_averaged),
        ),
        nan_guard,
        keras.callbacks.CSVLogger(str(work / "log.csv"), append=True),
    ]
    micro = data.micro
    logger.info(
        "Training %s (%d parameters) for %d updates of %d batch%s (%d batches per pass over the data), strategy=%s",
        config.model_preset, model.count_params(), data.total_steps, micro, "" if micro == 1 else "es",
        data.batches_per_epoch, strategy_name,
    )
    verbose = _verbosity(config)
    if verbose:
        # In steps and passes over the data, not Keras' fit epochs (checkpoint intervals).
        callbacks.append(TrainingProgress(
            data.total_steps, data.batches_per_epoch,
            checkpoint_every=None if config.checkpoint_every_minutes else data.interval, bar=verbose == 1,
        ))
    final_train_loss = (run.resume or {}).get("loss")
    if data.initial_epoch < data.fit_epochs:
        history = model.fit(
            data.train_data,
            epochs=data.fit_epochs,
            initial_epoch=data.initial_epoch,
            steps_per_epoch=data.interval * micro,  # Keras counts batches
            validation_data=data.valid_data,
            callbacks=callbacks,
            shuffle=False,  # the tf.data pipeline shuffles
            verbose=0,
        )
        if history.history.get("loss"):
            final_train_loss = float(history.history["loss"][-1])
    if nan_guard.bad_step is not None:
        raise FloatingPointError(
            f"The training loss became NaN or infinite at step {nan_guard.bad_step}. Lower the "
            "learning rate (--learning-rate-scale), use float32, or check the data. "
            f"Checkpoints before that step are in {work / 'checkpoints'}."
        )
    return final_train_loss


def _verbosity(config):
    """`config.verbose`, or its default: 1 (a progress bar) on a terminal, 2 (lines) otherwise."""
    return config.verbose if config.verbose is not None else (1 if sys.stderr.isatty() else 2)


@dataclasses.dataclass
class _Averaged:
    """What `_average` leaves for `_finalize` once the trained model is freed."""

    checkpoints: list  # the checkpoint files averaged (none: the trained model's last weights)
    path: pathlib.Path  # their average (`training/averaged.weights.h5`): the model's weights only
    model_config: dict  # the trained model's
    scores: dict  # the validation loss and token accuracy of the averaged weights, when there is validation text
    seconds: float  # from the start of `run_training` to the averaged weights (metadata's `train_seconds_this_run`)


def _average(run, data, model):
    """Stage 5: averages the last checkpoints into `averaged.weights.h5` and gives their validation loss.

    The loss is the trained model's (compiled, under the run's strategy and
    precision) with the averaged weights loaded; its optimizer state is left
    as it is.
    """
    work = run.work
    checkpoints = list_checkpoints(work / "checkpoints")[-run.config.checkpoints_averaged:]
    path = work / "averaged.weights.h5"
    if checkpoints:
        average_checkpoints(checkpoints, path)  # one weight at a time; without the optimizer state
        _load_model_weights(model, path)
    else:  # nothing to average (the checkpoints were removed): the last weights, as the others load them
        _atomic_save_weights(model, path)
    seconds = round(time.time() - run.started, 1)
    scores = {}
    if data.valid_data is not None:
        verbose = _verbosity(run.config)
        batches = int(data.valid_data.cardinality())
        with _optional_progress(verbose, "validation loss", batches if batches >= 0 else None, "batches") as progress:
            callbacks = [BatchCounter(progress)] if progress is not None else []
            results = model.evaluate(data.valid_data, verbose=0, return_dict=True, callbacks=callbacks)
        scores = {"valid_loss": float(results["loss"]), "valid_token_accuracy": float(results["masked_accuracy"])}
    return _Averaged(checkpoints, path, model.get_config(), scores, seconds)


def _optional_progress(verbose, description, total, unit):
    """A `CountProgress` (a bar with `verbose` 1, lines with 2) as a context manager; None with `verbose` 0."""
    if not verbose:
        return contextlib.nullcontext()
    return CountProgress(description, total, unit, bar=verbose == 1)


def _finalize(run, data, averaged, trained):
    """Stage 6: the averaged model (float32, no optimizer), its validation BLEU, metadata, the preset installed.

    Args:
        averaged: what `_average` returned.
        trained: `{"strategy": ..., "final_train_loss": ...}` from the model and fit stages.

    Returns:
        dict: the metadata written to `metadata.json`.
    """
    config, texts = run.config, run.texts
    model_config = dict(averaged.model_config, dtype="float32")
    final = TransformerModel.from_config(model_config)
    final.load_weights(str(averaged.path))
    final.tokenizer = data.tokenizer

    metadata = _metadata(run, data, averaged, trained)
    metadata.update(averaged.scores)
    if texts.valid_sources:
        metadata["valid_sentences"] = len(texts.valid_sources)
        metadata["valid_bleu_sentences"] = 0
        if config.validation_bleu:
            count = min(config.validation_bleu_sentences, len(texts.valid_sources))
            metadata.update(_validation_bleu(
                final, data.tokenizer, texts.valid_sources[:count], texts.valid_targets[:count],
                config.bleu_beam_size, verbose=_verbosity(config),
            ))
    _install_preset(final, metadata, run.root, run.output_dir, run.state)
    logger.info("Wrote %s: %s", run.output_dir, {k: v for k, v in metadata.items() if k.startswith("valid")})
    return metadata


def _metadata(run, data, averaged, trained):
    """metadata.json before the validation scores: what trained the model, on what, for how long."""
    config = run.config
    metadata = {
        "preset": str(config.model_preset),
        **({"init_from": run.arguments["init_from"]} if config.init_from is not None else {}),
        **({"lora": {"rank": config.lora_rank, "targets": run.arguments["lora_targets"]}} if config.lora_rank else {}),
        # Portable: the bundled corpus by name and version, other files as given.
        "data": {**datasets.data_record(run.texts.paths), "train_pairs": data.train_pairs},
        "steps": data.total_steps,
        "tokens_per_batch": config.tokens_per_batch,
        "hyperparameters": {
            "warmup_steps": config.warmup_steps, "learning_rate_scale": config.learning_rate_scale,
            "label_smoothing": config.label_smoothing,
            "gradient_accumulation_steps": accumulation_steps(config.gradient_accumulation_steps),
            "checkpoint_every": data.interval, "checkpoint_every_minutes": config.checkpoint_every_minutes,
            "average_last": config.checkpoints_averaged, "max_length": config.max_length,
            "seed": config.seed,
        },
        "averaged_checkpoints": [p.name for p in averaged.checkpoints],
        "backend": keras.backend.backend(),
        "strategy": trained["strategy"],
        "mixed_precision": trained["mixed_precision"],
        "train_seconds_this_run": averaged.seconds,
        "final_train_loss": trained["final_train_loss"],
    }
    if run.state["changes"]:
        metadata["resumed_with_changes"] = run.state["changes"]
    return metadata


def _validation_bleu(model, tokenizer, sources, references, beam_size, verbose=0):
    """sacreBLEU and chrF of the averaged model on `sources` (the first validation sentences), and their count.

    `verbose` 1 shows a progress bar in sentences, 2 a line every 30
    seconds (`CountProgress`), 0 nothing.
    """
    from keras_transformer.evaluate import evaluate
    from keras_transformer.translator import Translator

    started = time.monotonic()
    description = f"validation BLEU (beam {beam_size})"
    with _optional_progress(verbose, description, len(sources), "sentences") as progress:
        result = evaluate(Translator(model, tokenizer), sources, references, beam_size=beam_size,
                          progress=progress or False)
    return {
        "valid_bleu": round(result["bleu"], 2),
        "valid_chrf": round(result["chrf"], 2),
        "valid_bleu_signature": result["bleu_signature"],
        "valid_bleu_sentences": result["sentences"],
        "valid_bleu_seconds": round(time.monotonic() - started, 1),
    }


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
