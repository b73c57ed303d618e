"""`TrainingConfig`: the arguments of a run, their defaults, and their checks (once, when a config is made).

Also the rule between `preset` (an architecture trained from scratch with a
new vocabulary) and `init_from` (a trained model fine-tuned with its own
tokenizer), and what a resume compares (`TrainingConfig.recorded_arguments`).
"""

import dataclasses
import json
import os

import numpy as np

from keras_transformer import lora
from keras_transformer.convert import hf_model_type, is_hf_handle
from keras_transformer.presets import PRESETS, PRETRAINED_PRESETS
from keras_transformer.training.errors import BadArgumentError
from keras_transformer.training.strategy import MIXED_PRECISIONS, STRATEGIES, accumulation_steps


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
