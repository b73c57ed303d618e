"""What every `python -m` entry point does first: quiet framework start-up, one logging setup.

TensorFlow and XLA write start-up messages to stderr from C++ before any
Python code can intervene: "All log messages before absl::InitializeLog()",
"Could not find cuda drivers", the `cpu_feature_guard` and oneDNN notes,
"XLA service ... initialized", and on a machine with CUDA libraries but no GPU
`E ... failed call to cuInit`, which reads like an error and is not one.
A command shows none of them by default; `--verbose` shows them all.

Standard library only: an entry point calls `quiet_startup()` before it
imports anything that imports TensorFlow (the environment variables below are
read when TensorFlow loads), and `setup_logging()` after parsing its
arguments:

```python
from keras_transformer import cli

if __name__ == "__main__":  # a command, not an import
    cli.quiet_startup()

from keras_transformer.training import run_training  # imports TensorFlow


def main(argv=None):
    parser = build_parser()          # with cli.add_verbose_argument(parser)
    args = parser.parse_args(argv)
    cli.setup_logging(args.verbose, level=logging.INFO)
```
"""

import contextlib
import logging
import os
import sys

VERBOSE_FLAG = "--verbose"

# Read by TensorFlow's and XLA's C++ logging when TensorFlow loads. "3" keeps
# FATAL only: INFO (oneDNN, cpu_feature_guard, XLA service), WARNING, and the
# ERROR logged by a CUDA build where no GPU can be used ("failed call to
# cuInit"). Real failures still reach the user as Python exceptions. A value
# the user has set is kept.
QUIET_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "3"}

# Python loggers of the frameworks that report routine start-up as warnings,
# and the level they are raised to without --verbose.
QUIET_LOGGERS = {
    "absl": logging.WARNING,
    "jax._src.xla_bridge": logging.ERROR,  # "An NVIDIA GPU may be present ... Falling back to cpu."
}

# What `--preset` of the commands that translate takes: anything `Translator.from_preset` loads.
PRESET_HELP = (
    "a preset directory with a tokenizer (written by train or save_to_preset), a Hugging Face Marian checkpoint "
    "directory, hf://org/name or a pretrained preset (e.g. opus_mt_en_de)"
)


def add_quantize_argument(parser):
    """`--quantize int8`: the model quantized by Keras after loading (`TransformerModel.quantize`)."""
    from keras_transformer.quantization import QUANTIZATION_MODES

    parser.add_argument(
        "--quantize", choices=QUANTIZATION_MODES, default=None,
        help="quantize the model with Keras' int8 after loading (int8 weights, inputs quantized at run time; "
             "a preset saved int8 is int8 without it)",
    )
    return parser


def add_verbose_argument(parser):
    """Adds `--verbose` (a bool, default False) to an `argparse` parser."""
    parser.add_argument(
        VERBOSE_FLAG,
        action="store_true",
        help="also show the frameworks' start-up and diagnostic messages (TensorFlow, XLA, absl)",
    )
    return parser


def quiet_startup(argv=None):
    """Hides the frameworks' start-up messages, unless `--verbose` is in `argv`.

    Sets `QUIET_ENVIRONMENT` (values the user has set are kept), then imports
    TensorFlow with the process' stderr (file descriptor 2) sent to
    /dev/null: its loader writes the absl and CUDA-stub lines before any
    log level applies. An exception raised by the import is reported as
    usual, once stderr is back; a missing TensorFlow is not an error here. Does nothing to TensorFlow when it is already
    imported (the messages are out).

    Args:
        argv: the command's arguments; default `sys.argv[1:]`.

    Returns:
        bool: whether `--verbose` was given (nothing was changed then).
    """
    argv = sys.argv[1:] if argv is None else argv
    if VERBOSE_FLAG in argv:
        return True
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if "tensorflow" not in sys.modules:
        with _stderr_discarded():
            try:
                import tensorflow  # noqa: F401
            except ModuleNotFoundError as error:
                if error.name != "tensorflow":
                    raise
                # Not installed (e.g. a serving install): nothing to quiet.
    return False


def setup_logging(verbose=False, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"):
    """Configures the root logger once; every record is printed once, to stderr.

    Args:
        verbose: bool. True: INFO from every library; False: `level`, with
            the loggers of `QUIET_LOGGERS` raised.
        level: the command's own level (INFO for commands that report their
            progress through `logging`).
        format: `logging` format string.
    """
    logging.basicConfig(level=min(level, logging.INFO) if verbose else level, format=format)
    # TensorFlow gives its logger a stderr handler of its own when it is
    # imported before the root logger has one; its records then reach stderr
    # twice ("WARNING:tensorflow:..." and through the root handler).
    tensorflow_logger = logging.getLogger("tensorflow")
    for handler in list(tensorflow_logger.handlers):
        if type(handler) is logging.StreamHandler:
            tensorflow_logger.removeHandler(handler)
    if not verbose:
        for name, quiet_level in QUIET_LOGGERS.items():
            logging.getLogger(name).setLevel(quiet_level)


@contextlib.contextmanager
def _stderr_discarded():
    """Points file descriptor 2 at /dev/null (C++ writes included), then restores it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
