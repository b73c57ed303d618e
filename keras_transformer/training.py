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

import contextlib
import logging
import os
import pathlib
import re
import shutil

import h5py
import keras
import numpy as np

from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.schedules import WarmupSchedule
from keras_transformer.utils import atomic_path, open_hdf5

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "mirrored", "multi_worker", "none")
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.weights\.h5$")


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
    """Token accuracy over non-padding targets (pad id 0) of one batch."""
    ops = keras.ops
    mask = ops.cast(ops.not_equal(y_true, 0), "float32")
    correct = ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), y_true.dtype), y_true), "float32")
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
        gradient_accumulation_steps: optional int, apply the update every
            k batches (simulates the paper's ~25k-token batches on one device).
        jit_compile: "auto" (Keras' choice, but off under MirroredStrategy,
            see the module docstring, and off on CPU TensorFlow, where it
            was slower here), or a bool.
        strategy_name: the name returned by `resolve_strategy`.
    """
    if jit_compile == "auto":
        jit_compile = "auto"
        if strategy_name == "mirrored":
            jit_compile = False
        elif keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            jit_compile = bool(tf.config.list_logical_devices("GPU"))
    optimizer = keras.optimizers.Adam(
        learning_rate=WarmupSchedule(model.hidden_dim, warmup_steps=warmup_steps, scale=learning_rate_scale),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    model.compile(
        optimizer=optimizer,
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing),
        metrics=[masked_accuracy],
        jit_compile=jit_compile,
    )
    return model


def _atomic_save_weights(model, path):
    with atomic_path(path, suffix=".weights.h5") as temporary:
        model.save_weights(temporary, overwrite=True)


def list_checkpoints(directory):
    """Checkpoint files in `directory`, oldest step first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := CHECKPOINT_PATTERN.match(name))]
    return [path for _, path in sorted(found)]


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Saves `ckpt-{step}.weights.h5` every `every_steps` optimizer steps, keeping the last `keep`.

    Files are written to a temporary name and renamed, so a kill never
    leaves a truncated checkpoint.
    """

    def __init__(self, directory, every_steps, keep=5):
        super().__init__()
        if every_steps < 1 or keep < 1:
            raise ValueError(f"every_steps={every_steps} and keep={keep} must be positive")
        self.directory = pathlib.Path(directory)
        self.every_steps = every_steps
        self.keep = keep

    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        if step % self.every_steps == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_save_weights(self.model, self.directory / f"ckpt-{step:08d}.weights.h5")
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
    """Element-wise mean of several Keras weight files (paper section 6.1).

    Works on the HDF5 files directly, so no model is needed: every float
    weight present in the first file is averaged across all files; optimizer
    state and integer arrays (step counters) are taken from the last file.

    Args:
        paths: weight files (`.weights.h5`) of the same model.
        output: optional path; the averaged weights are written there in the
            same layout (atomically), loadable with `model.load_weights`.

    Returns:
        dict mapping each dataset path to its averaged numpy array.
    """
    paths = [pathlib.Path(p) for p in paths]
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint path")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"No such checkpoint: {path}")
    names = []
    with open_hdf5(paths[0]) as first:
        first.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    averaged = {}
    for name in names:
        arrays = []
        for path in paths:
            with open_hdf5(path) as handle:
                if name not in handle:
                    raise ValueError(f"{path} has no weight {name!r} (present in {paths[0]}): different models?")
                arrays.append(np.asarray(handle[name]))
        if any(a.shape != arrays[0].shape for a in arrays):
            raise ValueError(f"Weight {name!r} has different shapes across checkpoints: {[a.shape for a in arrays]}")
        if np.issubdtype(arrays[0].dtype, np.floating) and not name.startswith("optimizer/"):
            averaged[name] = np.mean(np.stack([a.astype("float64") for a in arrays]), axis=0).astype(arrays[0].dtype)
        else:
            averaged[name] = arrays[-1]
    if output is not None:
        with atomic_path(output, suffix=".h5") as temporary:
            shutil.copyfile(paths[-1], temporary)
            with h5py.File(temporary, "r+") as handle:
                for name, value in averaged.items():
                    handle[name][...] = value
    return averaged


# ---------------------------------------------------------------------- #
# The main job: parallel text in, preset directory out.
# ---------------------------------------------------------------------- #
STATE_FILE = "state.json"
TRAINING_DIR = "training"


def _read_state(path):
    """The resume state in `path`; a damaged file is a ValueError that names it."""
    import json

    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is damaged ({error}), so the run in {path.parent.parent} cannot be resumed; "
            "pass --overwrite to train again from the start"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} must hold a JSON object, received {type(state).__name__}; pass --overwrite to train again"
        )
    return state


def _prepare_output(output_dir, overwrite):
    """Returns True when resuming an interrupted run in `output_dir`."""
    import json

    output_dir = pathlib.Path(output_dir)
    state_path = output_dir / TRAINING_DIR / STATE_FILE
    if not output_dir.exists():
        return False
    if overwrite:
        shutil.rmtree(output_dir)
        return False
    if state_path.is_file():
        state = _read_state(state_path)
        if state.get("finished"):
            raise FileExistsError(
                f"{output_dir} holds a finished training run; pass --overwrite to train again"
            )
        return True
    if output_dir.is_dir() and not any(output_dir.iterdir()):
        return False
    raise FileExistsError(
        f"{output_dir} exists and is not a resumable training directory; "
        "pass --overwrite to replace it or choose another --output"
    )


def run_training(
    output_dir,
    preset="small",
    train_src=None,
    train_tgt=None,
    valid_src=None,
    valid_tgt=None,
    vocabulary_size=None,
    tokens_per_batch=25000,
    steps=None,
    epochs=None,
    max_length=128,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    label_smoothing=0.1,
    gradient_accumulation_steps=None,
    checkpoint_every=500,
    keep_checkpoints=5,
    average_last=5,
    strategy="auto",
    mixed_precision=None,
    jit_compile="auto",
    bleu_beam_size=4,
    seed=0,
    overwrite=False,
    verbose=None,
    model_overrides=None,
    tokenizer_max_sentences=None,
):
    """Trains a Transformer on parallel text and writes a preset directory.

    Without data paths it trains on the bundled LibreOffice English-German
    corpus. A killed run resumes from its last backup when started again with
    the same `output_dir` (`keras.callbacks.BackupAndRestore`, every
    `checkpoint_every` steps).

    Args:
        output_dir: where the preset (config.json, model.weights.h5 with
            the averaged weights, tokenizer.model, metadata.json) is written;
            `output_dir/training/` keeps checkpoints and resume state.
        preset: architecture preset name (or a preset directory to fine-tune).
        train_src, train_tgt, valid_src, valid_tgt: parallel text files.
        vocabulary_size: shared subword vocabulary; default: the preset's.
        tokens_per_batch: token budget per side of a batch (paper: ~25000).
        steps, epochs: training length (exactly one may be given; default
            10 epochs), rounded up to a multiple of `checkpoint_every`.
        max_length: longest sequence in tokens; longer pairs are dropped.
        warmup_steps, learning_rate_scale: the paper's schedule.
        label_smoothing: epsilon_ls.
        gradient_accumulation_steps: optional int.
        checkpoint_every: steps between checkpoints (and resume points).
        keep_checkpoints: checkpoints kept on disk.
        average_last: average the last K checkpoints into the final weights
            (paper: 5 for base, 20 for big).
        strategy: see `resolve_strategy`.
        mixed_precision: None, "mixed_bfloat16" or "mixed_float16" (loss
            scaling is added by Keras for float16).
        jit_compile: see `compile_model`.
        bleu_beam_size: beam for the validation BLEU at the end.
        seed: data shuffling and initialisation seed.
        overwrite: replace an existing non-resumable `output_dir`.
        verbose: passed to `model.fit`; default: a progress bar on a
            terminal, one line per interval otherwise.
        model_overrides: optional dict of TransformerModel arguments.
        tokenizer_max_sentences: optional int: train the shared vocabulary on
            a reproducible sample of this many sentences (source and target
            lines together) instead of all of them; a few million are plenty
            for WMT-sized corpora.

    Returns:
        dict: the metadata written to `metadata.json`.
    """
    import json
    import time

    from keras_transformer import data as data_lib
    from keras_transformer import datasets
    from keras_transformer.model import TransformerModel
    from keras_transformer.presets import PRESETS
    from keras_transformer.tokenizer import Tokenizer, train_tokenizer

    if steps is not None and epochs is not None:
        raise ValueError(f"Pass steps or epochs, not both (received steps={steps}, epochs={epochs})")
    if (train_src is None) != (train_tgt is None) or (valid_src is None) != (valid_tgt is None):
        raise ValueError("Pass --train-src with --train-tgt, and --valid-src with --valid-tgt")
    if mixed_precision not in (None, "mixed_bfloat16", "mixed_float16"):
        raise ValueError(f"mixed_precision={mixed_precision!r} must be None, 'mixed_bfloat16' or 'mixed_float16'")
    output_dir = pathlib.Path(output_dir)
    resuming = _prepare_output(output_dir, overwrite)
    work = output_dir / TRAINING_DIR
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    # Data.
    if train_src is None:
        train_src, train_tgt = datasets.bundled_paths("train")
        if valid_src is None:
            valid_src, valid_tgt = datasets.bundled_paths("valid")
    train_sources, train_targets = data_lib.read_parallel(train_src, train_tgt)
    valid_sources, valid_targets = (
        data_lib.read_parallel(valid_src, valid_tgt) if valid_src is not None else ([], [])
    )
    if isinstance(preset, str) and preset in PRESETS:
        vocabulary_size = vocabulary_size or PRESETS[preset]["config"]["vocabulary_size"]
    tokenizer_path = work / "tokenizer.model"
    if resuming and tokenizer_path.is_file():
        tokenizer = Tokenizer.load(work)
        logger.info("Resuming in %s", output_dir)
    else:
        logger.info("Training a %s-token shared vocabulary on %d sentence pairs", vocabulary_size, len(train_sources))
        tokenizer = train_tokenizer(
            train_sources + train_targets, vocabulary_size=vocabulary_size, max_sentences=tokenizer_max_sentences
        )
        tokenizer.save(work)
    train_ids = data_lib.encode_pairs(tokenizer, train_sources, train_targets, max_length)
    train_data = data_lib.make_dataset(*train_ids, tokens_per_batch=tokens_per_batch, seed=seed, max_length=max_length)
    batches_per_epoch = int(train_data.cardinality())
    total_steps = steps if steps is not None else (epochs or 10) * batches_per_epoch
    interval = max(1, min(checkpoint_every, total_steps))
    fit_epochs = -(-total_steps // interval)
    # Keras runs whole "epochs" of `interval` steps (the resume points), so
    # the total is rounded up to a multiple of the checkpoint interval.
    total_steps = fit_epochs * interval
    train_data = data_lib.make_dataset(
        *train_ids, tokens_per_batch=tokens_per_batch, seed=seed, repeat=True, max_length=max_length
    )
    valid_data = None
    if valid_sources:
        valid_ids = data_lib.encode_pairs(tokenizer, valid_sources, valid_targets, max_length)
        valid_data = data_lib.make_dataset(*valid_ids, tokens_per_batch=tokens_per_batch, shuffle=False, max_length=max_length)

    state = {
        "preset": str(preset), "train_src": str(train_src), "train_tgt": str(train_tgt),
        "valid_src": str(valid_src), "valid_tgt": str(valid_tgt), "steps": total_steps,
        "tokens_per_batch": tokens_per_batch, "max_length": max_length, "finished": False,
    }
    (work / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    # Model. A mixed-precision policy is global in Keras: it is set for this
    # run only, and the written preset is float32 (the compute dtype is the
    # user's choice when loading it, not a leftover of how it was trained).
    previous_policy = keras.mixed_precision.global_policy()
    try:
        if mixed_precision:
            keras.mixed_precision.set_global_policy(mixed_precision)
        keras.utils.set_random_seed(seed)
        strategy_name, scope = resolve_strategy(strategy)
        overrides = dict(model_overrides or {})
        overrides.setdefault("vocabulary_size", tokenizer.vocabulary_size)
        overrides.setdefault("max_sequence_length", max(max_length, 8))
        with scope:
            model = TransformerModel.from_preset(preset, **overrides)
            compile_model(
                model,
                warmup_steps=warmup_steps,
                learning_rate_scale=learning_rate_scale,
                label_smoothing=label_smoothing,
                gradient_accumulation_steps=gradient_accumulation_steps,
                jit_compile=jit_compile,
                strategy_name=strategy_name,
            )
        nan_guard = StopOnNaN()
        callbacks = [
            keras.callbacks.BackupAndRestore(str(work / "backup"), save_freq="epoch", delete_checkpoint=False),
            PeriodicCheckpoint(work / "checkpoints", every_steps=interval, keep=max(keep_checkpoints, average_last)),
            nan_guard,
            keras.callbacks.CSVLogger(str(work / "log.csv"), append=True),
        ]
        logger.info(
            "Training %s (%d parameters) for %d steps (%d batches per pass over the data), strategy=%s",
            preset, model.count_params(), total_steps, batches_per_epoch, strategy_name,
        )
        if verbose is None:
            import sys

            verbose = 1 if sys.stderr.isatty() else 2
        history = model.fit(
            train_data,
            epochs=fit_epochs,
            steps_per_epoch=interval,
            validation_data=valid_data,
            callbacks=callbacks,
            shuffle=False,  # the tf.data pipeline shuffles
            verbose=verbose,
        )
        if nan_guard.bad_step is not None:
            raise FloatingPointError(
                f"The training loss became NaN or infinite at step {nan_guard.bad_step}. Lower the "
                "learning rate (--learning-rate-scale), use float32, or check the data. "
                f"Checkpoints before that step are in {work / 'checkpoints'}."
            )

        # Average the last checkpoints (paper section 6.1) into a fresh, uncompiled model.
        checkpoints = list_checkpoints(work / "checkpoints")[-average_last:]
        config = model.get_config()
        config["dtype"] = "float32"
        final = TransformerModel.from_config(config)
        if checkpoints:
            averaged_path = work / "averaged.weights.h5"
            average_checkpoints(checkpoints, averaged_path)
            model.load_weights(str(averaged_path))
        final.set_weights(model.get_weights())
        final.tokenizer = tokenizer

        metadata = {
            "preset": str(preset),
            "data": {"train": [str(train_src), str(train_tgt)], "valid": [str(valid_src), str(valid_tgt)],
                     "train_pairs": len(train_ids[0])},
            "steps": total_steps,
            "tokens_per_batch": tokens_per_batch,
            "hyperparameters": {
                "warmup_steps": warmup_steps, "learning_rate_scale": learning_rate_scale,
                "label_smoothing": label_smoothing, "gradient_accumulation_steps": gradient_accumulation_steps,
                "checkpoint_every": interval, "average_last": average_last, "max_length": max_length,
                "seed": seed,
            },
            "averaged_checkpoints": [p.name for p in checkpoints],
            "backend": keras.backend.backend(),
            "strategy": strategy_name,
            "mixed_precision": mixed_precision,
            "train_seconds_this_run": round(time.time() - started, 1),
            "final_train_loss": float(history.history["loss"][-1]) if history.history.get("loss") else None,
        }
        if valid_data is not None:
            results = model.evaluate(valid_data, verbose=0, return_dict=True)
            metadata["valid_loss"] = float(results["loss"])
            metadata["valid_token_accuracy"] = float(results["masked_accuracy"])
            metadata.update(_validation_bleu(final, tokenizer, valid_sources, valid_targets, bleu_beam_size))
        _write_preset_files(final, output_dir, metadata)
        state["finished"] = True
        (work / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        logger.info("Wrote %s: %s", output_dir, {k: v for k, v in metadata.items() if k.startswith("valid")})
        return metadata
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def _validation_bleu(model, tokenizer, sources, references, beam_size):
    """sacreBLEU and chrF of the averaged model on the validation split."""
    from keras_transformer.evaluate import evaluate
    from keras_transformer.translator import Translator

    result = evaluate(Translator(model, tokenizer), sources, references, beam_size=beam_size)
    return {
        "valid_bleu": round(result["bleu"], 2),
        "valid_chrf": round(result["chrf"], 2),
        "valid_bleu_signature": result["bleu_signature"],
    }


def _write_preset_files(model, output_dir, metadata):
    """save_to_preset into a staging directory, then move each file into place atomically."""
    staging = output_dir / f".preset-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    model.save_to_preset(staging, metadata=metadata)
    for name in os.listdir(staging):
        os.replace(staging / name, output_dir / name)
    staging.rmdir()
