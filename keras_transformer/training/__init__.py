"""Training: compile and fit under a distribution strategy, checkpoints and averaging, the staged `run_training`.

- `strategy.py`: the distribution strategy, mixed precision, and
  `compile_model` (the paper's Adam, warmup schedule and label smoothing);
- `checkpoints.py`: the checkpoints written during `fit`, listed and averaged
  (`average_checkpoints`, paper section 6.1), and `StopOnNaN`;
- `resume.py`: resume points, the one file a killed run continues from;
- `run_directory.py`: `training/` (state, staging) and the installed preset;
- `config.py`: `TrainingConfig`, a run's arguments and their checks;
- `errors.py`: `UserInputError` and its kinds;
- `prepare.py`: the stages of `run_training` that only read (the run, its data);
- `run.py`: `run_training` and its stages that write (model, fit, average, finalize).

Each module's public names, and the helpers that tests call, are importable
from `keras_transformer.training` itself.
"""

import logging

from keras_transformer.training.checkpoints import (
    CHECKPOINT_PATTERN,
    OPTIMIZER_GROUP,
    PeriodicCheckpoint,
    StopOnNaN,
    _atomic_save_weights,
    _load_model_weights,
    average_checkpoints,
    list_checkpoints,
)
from keras_transformer.training.config import (
    DEFAULT_PRESET,
    DEFAULT_VALIDATION_BLEU_SENTENCES,
    TrainingConfig,
    default_average_last,
)
from keras_transformer.training.errors import (
    BadArgumentError,
    InputFileError,
    OutputDirectoryError,
    UserInputError,
)
from keras_transformer.training.resume import (
    RANDOM_STATE,
    RESUMABLE_CHANGES,
    RESUME_ATTRIBUTE,
    RESUME_FILE,
    ResumePoint,
    load_resume_point,
    read_resume_point,
    save_resume_point,
)
from keras_transformer.training.run import _build_model, _finalize, _fit, _validation_bleu, run_training
from keras_transformer.training.run_directory import (
    MODEL_CONFIG_FILE,
    STATE_FILE,
    TRAINING_DIR,
    _finish_interrupted_install,
)
from keras_transformer.training.strategy import (
    MIXED_PRECISIONS,
    STRATEGIES,
    accumulation_steps,
    compile_model,
    masked_accuracy,
    native_bfloat16,
    resolve_mixed_precision,
    resolve_strategy,
)

logger = logging.getLogger("keras_transformer.training")  # the logger of every module here

__all__ = [
    # strategy.py
    "MIXED_PRECISIONS", "STRATEGIES", "accumulation_steps", "compile_model", "masked_accuracy", "native_bfloat16",
    "resolve_mixed_precision", "resolve_strategy",
    # checkpoints.py
    "CHECKPOINT_PATTERN", "OPTIMIZER_GROUP", "PeriodicCheckpoint", "StopOnNaN", "average_checkpoints",
    "list_checkpoints",
    # resume.py
    "RANDOM_STATE", "RESUMABLE_CHANGES", "RESUME_ATTRIBUTE", "RESUME_FILE", "ResumePoint", "load_resume_point",
    "read_resume_point", "save_resume_point",
    # run_directory.py
    "MODEL_CONFIG_FILE", "STATE_FILE", "TRAINING_DIR",
    # config.py
    "DEFAULT_PRESET", "DEFAULT_VALIDATION_BLEU_SENTENCES", "TrainingConfig", "default_average_last",
    # errors.py
    "BadArgumentError", "InputFileError", "OutputDirectoryError", "UserInputError",
    # run.py
    "run_training",
    # The helpers that tests call through the package (their homes: checkpoints.py, run.py, run_directory.py).
    "_atomic_save_weights", "_load_model_weights", "_build_model", "_fit", "_finalize", "_validation_bleu",
    "_finish_interrupted_install",
]
