"""What every exporter shares: loading, the output check, staging, the command line, the validation sample.

CTranslate2's converters (`ctranslate2/converters/converter.py`) are the
model: one base owns the plumbing and each format only writes and checks
its files. Here an `Exporter` value describes a format (its name, its
command, how to recognise an earlier export of it) and does, the same way
for ONNX, CTranslate2, the SavedModel and the Hugging Face checkpoint:

- `load_model`: a preset (name, directory, `hf://` handle) loaded with
  dropout off, or a `TransformerModel` with its LoRA adapters merged;
  refused in one line when the backend, the model or its Keras
  quantization cannot be exported;
- `check_output` and `staged`: the output is refused when it is (or holds)
  the preset, when it exists without `overwrite`, and when it holds files
  but is not an earlier export of the same format; the export is written
  into a temporary sibling, validated there, checked again and renamed into
  place, so nothing a user wrote is replaced and a failed export leaves
  nothing behind;
- `parser` and `main`: the common arguments (`--preset`, `--output`,
  `--overwrite`, `--verbose`), one logging setup, and one line with exit
  status 2 (a refused output) or 1 (bad input) instead of a traceback;
- `validation_sources` and `keras_outputs`: the sentences an export's
  validation translates, and Keras' greedy or beam outputs for them.

Example (the shape of `export/ctranslate2.py`):

```python
EXPORTER = Exporter("CTranslate2", "python -m export.ctranslate2", "a CTranslate2 model", is_ctranslate2_export)


def export_ctranslate2(preset, output, overwrite=False):
    output = EXPORTER.check_output(output, overwrite, preset)
    model = EXPORTER.load_model(preset)
    with EXPORTER.staged(output, overwrite, preset) as staging:
        ...  # write, then validate, into `staging`
    return output
```
"""

import argparse
import contextlib
import dataclasses
import logging
import os
from typing import Callable, Optional

import numpy as np

from keras_transformer import cli
from keras_transformer.token_ids import encoder_vocabulary_size
from keras_transformer.utils import atomic_directory, check_output_directory, is_integer

# What `--preset` of every exporter takes.
PRESET_HELP = "built-in preset name, preset directory, Marian checkpoint directory or hf://org/name"
# Output tokens beyond the source length: the paper's maximum output length (source length + 50).
MAX_EXTRA_LENGTH = 50
# How `check_output` spells `overwrite` for a caller of the library functions.
OVERWRITE_ARGUMENT = "overwrite=True (--overwrite)"


@dataclasses.dataclass(frozen=True)
class Exporter:
    """One export format's plumbing.

    Attributes:
        target: the format's name in messages ("ONNX", "SavedModel").
        command: its command ("python -m export.onnx").
        kind: an earlier export of it, for the output check's message
            ("an ONNX export"; the command is added).
        is_export: `pathlib.Path -> bool`, whether a directory is an earlier
            export of the format, which `overwrite` may replace.
        tensorflow_because: why the export needs the TensorFlow backend (a
            clause for the message), or None: it runs on every backend.
        int8_instead: what to run for an int8 export of this format, for
            the message that refuses a model Keras quantized (None: nothing).
        dropout: the dropout a preset is loaded with: 0.0 (inactive at
            inference, kept out of traced graphs), or None to keep the
            preset's (a checkpoint that records it for fine-tuning).
        cli_errors: the exceptions `main` reports in one line (exit 1).
        languages: whether the format carries a multilingual model's
            language codes (an imported NLLB-200 one; `contract.check_exportable`).
    """

    target: str
    command: str
    kind: str
    is_export: Callable
    tensorflow_because: Optional[str] = None
    int8_instead: Optional[str] = None
    dropout: Optional[float] = 0.0
    cli_errors: tuple = (FileNotFoundError, ValueError, ImportError)
    languages: bool = False

    @property
    def logger(self):
        # Named after the command's module, so that `python -m export.NAME` logs under the same name.
        return logging.getLogger(self.command.rsplit(" ", 1)[-1])

    # ------------------------------------------------------------------ #
    # The output directory
    # ------------------------------------------------------------------ #
    def check_output(self, output, overwrite, preset=None, flag=OVERWRITE_ARGUMENT):
        """`utils.check_output_directory` for this format: only an earlier export of it is replaced.

        Returns:
            `output` as a `pathlib.Path`.

        Raises:
            FileExistsError: `output` exists and `overwrite` is False.
            ValueError: `output` is (or holds) the preset's directory, is a
                file, or holds files but is not an earlier export.
        """
        return check_output_directory(
            output, overwrite, self.is_export, f"{self.kind} ({self.command})",
            source=preset if isinstance(preset, (str, os.PathLike)) else None, flag=flag,
        )

    @contextlib.contextmanager
    def staged(self, output, overwrite, preset=None):
        """Yields an empty temporary sibling of `output`; installs it as `output` when the block succeeds.

        The block writes and validates the export there. `output` is checked
        again before it is replaced (an export takes minutes, in which a
        user may have written there); on any error the staging directory is
        removed and `output` is left as it was.
        """
        with atomic_directory(output) as staging:
            yield staging
            self.check_output(output, overwrite, preset)
        self.logger.info("Exported %s", output)

    # ------------------------------------------------------------------ #
    # The model
    # ------------------------------------------------------------------ #
    def load_model(self, preset, argument="preset"):
        """The `TransformerModel` to export, checked for this format.

        Args:
            preset: a built-in preset name, a preset directory, a Marian
                checkpoint directory or `hf://` handle (loaded with
                `dropout`), or a `TransformerModel` (its LoRA adapters
                merged into the kernels).
            argument: the caller's name for `preset`, for the messages.

        Raises:
            RuntimeError: the format needs TensorFlow and the backend is another.
            TypeError: `preset` is neither a path, a name nor a model.
            UnsupportedModelError: no exporter carries the model yet (`contract.check_exportable`).
            ValueError: Keras quantized the model (`quantization.refuse_quantized`).
        """
        import keras

        from export import contract
        from keras_transformer.lora import merged_model
        from keras_transformer.model import TransformerModel
        from keras_transformer.quantization import refuse_quantized

        backend = keras.backend.backend()
        if self.tensorflow_because is not None and backend != "tensorflow":
            raise RuntimeError(
                f"{self.target} export runs on the TensorFlow backend ({self.tensorflow_because}); "
                f"KERAS_BACKEND is {backend!r}. Run with KERAS_BACKEND=tensorflow."
            )
        if isinstance(preset, TransformerModel):
            model = merged_model(preset)
        elif isinstance(preset, (str, os.PathLike)):
            overrides = {} if self.dropout is None else {"dropout": self.dropout}
            model = TransformerModel.from_preset(preset, **overrides)
        else:
            raise TypeError(
                f"{argument} must be a preset name, a preset directory or a TransformerModel, "
                f"received {type(preset).__name__}"
            )
        contract.check_exportable(model, self.target, self.languages)
        refuse_quantized(model, self.command, self.int8_instead)
        return model

    # ------------------------------------------------------------------ #
    # The command line
    # ------------------------------------------------------------------ #
    def parser(self, description, preset_help=PRESET_HELP):
        """An `argparse` parser with the common arguments: `--preset`, `--output`, `--overwrite`, `--verbose`."""
        parser = argparse.ArgumentParser(prog=self.command, description=description)
        parser.add_argument("--preset", required=True, help=preset_help)
        parser.add_argument("--output", required=True, help="directory to create")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        cli.add_verbose_argument(parser)
        return parser

    def main(self, parser, argv, export):
        """Parses `argv`, sets up logging, checks the output, then calls `export(args)`; returns 0.

        A refused output exits with status 2, bad input (`cli_errors`) with
        status 1, each as one line `error: ...`.
        """
        args = parser.parse_args(argv)
        # Our progress at INFO; the frameworks' INFO lines are noise here.
        cli.setup_logging(args.verbose)
        logging.getLogger("export").setLevel(logging.INFO)
        try:
            self.check_output(args.output, args.overwrite, args.preset, flag="--overwrite")
        except (FileExistsError, ValueError) as error:
            parser.exit(2, f"error: {error}\n")
        try:
            export(args)
        except self.cli_errors as error:
            parser.exit(1, f"error: {error}\n")
        return 0


# ---------------------------------------------------------------------- #
# Checks and weights
# ---------------------------------------------------------------------- #
def check_sentences(value, name="validation_sentences"):
    """Raises `ValueError` unless `value` is an integer >= 1 (a number of validation sentences)."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


def float32(variable):
    """A Keras variable (any backend) as a float32 NumPy array."""
    from keras import ops

    return np.asarray(ops.convert_to_numpy(variable), dtype=np.float32)


# ---------------------------------------------------------------------- #
# The validation sample
# ---------------------------------------------------------------------- #
# The language pair a multilingual model (NLLB-200) is validated on: the bundled corpus's (English -> German).
VALIDATION_LANGUAGES = ("eng_Latn", "deu_Latn")


def validation_tokenizer(model):
    """The model's tokenizer as validation uses it: a multilingual one bound to `VALIDATION_LANGUAGES`.

    (Or to its first two codes when it lacks them.) None without a tokenizer.
    """
    from keras_transformer.translator import bind_languages

    tokenizer = model.tokenizer
    if tokenizer is None or not hasattr(tokenizer, "with_languages"):
        return tokenizer
    codes = tokenizer.language_codes
    pair = VALIDATION_LANGUAGES if set(VALIDATION_LANGUAGES) <= set(codes) else tuple(codes[:2])
    return bind_languages(tokenizer, *pair)


def validation_sources(model, count, seed=0):
    """`(texts or None, piece ids without the end id)` of `count` sources.

    With a tokenizer: sentences spread evenly over the bundled test split
    (for a multilingual Marian vocabulary, each led by one of its `>>xx<<`
    target-language codes in turn, as its tokenizer requires; a multilingual
    NLLB-200 one encodes them in `validation_tokenizer`'s pair); without:
    random ordinary ids (`[FIRST_ORDINARY_ID, V)`) of lengths 1-24.
    """
    from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID

    limit = model.max_sequence_length - 1  # room for the end id
    tokenizer = validation_tokenizer(model)
    if tokenizer is not None:
        from keras_transformer.datasets import load_bundled

        english, _ = load_bundled("test")
        picks = np.linspace(0, len(english) - 1, min(count, len(english))).round().astype(int)
        texts = [english[i] for i in picks]
        if tokenizer.language_codes and not hasattr(tokenizer, "with_languages"):
            codes = tokenizer.language_codes
            texts = [f"{codes[i % len(codes)]} {text}" for i, text in enumerate(texts)]
        ids = [row[:limit] for row in tokenizer.encode(texts, add_end=False)]
        return texts, ids
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, min(24, limit) + 1, size=count)
    size = encoder_vocabulary_size(model)
    return None, [rng.integers(FIRST_ORDINARY_ID, size, size=n).tolist() for n in lengths]


def keras_outputs(model, ids, beam_size, length_penalty, max_extra_length=MAX_EXTRA_LENGTH, prefix=None):
    """Our search on `ids` (rows without the end id): generated ids without start and end, per row.

    `prefix`: None, or ids every output starts with (a multilingual model's
    target-language code, `translator.forced_prefix`): then the search of
    `generate_hypotheses` with it as every row's target prefix, as
    `Translator` runs it.
    """
    batch = np.zeros((len(ids), max(len(row) for row in ids) + 1), np.int32)  # [B, S]
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
        batch[i, len(row)] = model.end_id
    if prefix is None:
        generated = model.generate(
            batch, beam_size=beam_size, length_penalty=length_penalty, max_extra_length=max_extra_length
        )
    else:
        from keras_transformer.generation import generate_hypotheses

        generated = generate_hypotheses(
            model, batch, beam_size=beam_size, length_penalty=length_penalty, max_extra_length=max_extra_length,
            target_prefix=[list(prefix)] * len(ids),
        ).sequences[:, 0]
    outputs = []
    for row in np.asarray(generated).tolist():
        row = row[1:]
        outputs.append(row[: row.index(model.end_id)] if model.end_id in row else row)
    return outputs
