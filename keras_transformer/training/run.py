"""`run_training`: parallel text in, a preset directory out, in stages.

Here are the run and its stages that write: `_start` (the run directory's
first writes), `_build_model`, `_fit`, `_average` and `_finalize`. The stages
that only read (`_prepare`, `_prepare_data`) are in `prepare.py`.
"""

import contextlib
import dataclasses
import gc
import json
import logging
import os
import pathlib
import sys
import time

import keras
import numpy as np

from keras_transformer import datasets
from keras_transformer.model import TransformerModel
from keras_transformer.progress import BatchCounter, CountProgress, TrainingProgress
from keras_transformer.training.checkpoints import (
    PeriodicCheckpoint,
    StopOnNaN,
    _atomic_save_weights,
    _load_model_weights,
    average_checkpoints,
    list_checkpoints,
)
from keras_transformer.training.config import TrainingConfig
from keras_transformer.training.errors import _as_input_error
from keras_transformer.training.prepare import _prepare, _prepare_data
from keras_transformer.training.resume import RANDOM_STATE, ResumePoint, load_resume_point
from keras_transformer.training.run_directory import (
    MODEL_CONFIG_FILE,
    STATE_FILE,
    _finish_interrupted_install,
    _format_changes,
    _install_preset,
    _remove_partial_files,
    _write_state,
)
from keras_transformer.training.strategy import (
    accumulation_steps,
    compile_model,
    resolve_mixed_precision,
    resolve_strategy,
)
from keras_transformer.utils import atomic_directory, remove_stale_temporaries

logger = logging.getLogger("keras_transformer.training")  # one logger for the whole package


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

    The work is done in stages, each a function (the first two in
    `prepare.py`, the others below): `_prepare` (the
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
