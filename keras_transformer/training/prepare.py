"""The stages of `run_training` that only read: the run (stage 1) and its data (stage 2).

Stage 1 (`_prepare`) chooses where the run trains, reads the text and the
interrupted run's state, and decides whether to resume. Stage 2
(`_prepare_data`) gives the tokenizer, the model to fine-tune, the batches and
the run's length in updates. Every problem is raised before the run writes.
"""

import dataclasses
import json
import logging
import pathlib

from keras_transformer import data as data_lib
from keras_transformer import datasets
from keras_transformer.model import TransformerModel
from keras_transformer.presets import jsonable_config
from keras_transformer.tokenizers.sentencepiece import load_tokenizer, train_tokenizer
from keras_transformer.training.config import TrainingConfig, _check_init_directory
from keras_transformer.training.errors import BadArgumentError, OutputDirectoryError
from keras_transformer.training.resume import RESUMABLE_CHANGES, RESUME_FILE, read_resume_point
from keras_transformer.training.run_directory import (
    MODEL_CONFIG_FILE,
    TRAINING_DIR,
    _choose_work_root,
    _describe_changes,
    _format_changes,
    _read_run_file,
)

logger = logging.getLogger("keras_transformer.training")  # one logger for the whole package


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
