"""Text in, text out: tokenizer + model + search.

No training framework is imported here: the ONNX Runtime server
(`export.runtime.OnnxTranslator`) uses this class too.
"""

import logging
import os

import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


class Translator:
    """Translates sentences with a model and its tokenizer.

    Sentences are tokenized as the training pipeline does for sources
    (tokens + end id, no start id), sorted by length into batches (less
    padding, fewer distinct shapes to compile), searched with
    the model's `generate` (`TransformerModel.generate`, or
    `OnnxSeq2Seq.generate` with the same arguments and tokens), decoded, and
    returned in the input order. Empty (or whitespace-only) strings give empty strings
    without running the model.

    The model may be a `TransformerModel`, the ONNX Runtime
    `export.runtime.OnnxSeq2Seq`, or any object implementing the decoding
    protocol of `keras_transformer.generation` (searched with its
    `generate`), so one class serves them all.

    Args:
        model: a `TransformerModel` or another decoding-protocol object.
        tokenizer: a `keras_transformer.tokenizer.Tokenizer` whose vocabulary
            and special ids match the model's.

    Example:
    >>> translator = Translator.from_preset("path/to/preset")
    >>> translator.translate(["A sentence."], beam_size=4)
    ['Ein Satz.']
    """

    def __init__(self, model, tokenizer):
        if tokenizer is None:
            raise ValueError("Translator needs a tokenizer, received None")
        if tokenizer.vocabulary_size != model.vocabulary_size:
            raise ValueError(
                f"The tokenizer has {tokenizer.vocabulary_size} pieces but the model's "
                f"vocabulary_size is {model.vocabulary_size}; use the tokenizer the model was trained with"
            )
        for name in ("pad_id", "start_id", "end_id"):
            if getattr(tokenizer, name) != getattr(model, name):
                raise ValueError(
                    f"The tokenizer's {name}={getattr(tokenizer, name)} differs from the model's "
                    f"{name}={getattr(model, name)}"
                )
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def from_preset(cls, preset, **overrides):
        """A translator from a preset directory or a pretrained checkpoint, with its tokenizer.

        Args:
            preset: a directory written by `TransformerModel.save_to_preset`
                with a tokenizer, a named pretrained preset (e.g.
                "opus_mt_en_de"), a Hugging Face Marian checkpoint directory or
                an "hf://org/name" handle (see `TransformerModel.from_preset`).
            **overrides: passed to `TransformerModel.from_preset`.

        Raises:
            ValueError: when the preset has no tokenizer (built-in preset
                names such as "base" have none).
        """
        from keras_transformer.model import TOKENIZER_FILE, TransformerModel

        model = TransformerModel.from_preset(preset, **overrides)
        if model.tokenizer is None:
            where = (
                f"the directory {os.fspath(preset)!r} has no tokenizer ({TOKENIZER_FILE})"
                if os.path.isdir(preset)
                else f"{preset!r} is a built-in architecture preset (random weights, no tokenizer)"
            )
            raise ValueError(
                f"Cannot translate with preset {os.fspath(preset)!r}: {where}. Use a directory "
                "written by save_to_preset(directory, tokenizer=...)."
            )
        return cls(model, model.tokenizer)

    def encode(self, texts):
        """Source ids as training sees them: tokens + end id, no start id.

        Sources longer than the model's `max_sequence_length` are cut (the
        end id kept) with a warning.

        Returns:
            list of lists of int.
        """
        sources = self.tokenizer.encode(list(texts), add_start=False, add_end=True)
        limit = getattr(self.model, "max_sequence_length", None)
        if limit is not None:
            for i, ids in enumerate(sources):
                if len(ids) > limit:
                    logger.warning(
                        "Sentence %d has %d tokens; keeping the first %d (max_sequence_length=%d)",
                        i, len(ids), limit - 1, limit,
                    )
                    sources[i] = ids[: limit - 1] + [self.tokenizer.end_id]
        return sources

    def _generate(self, ids, **search):
        if callable(getattr(self.model, "generate", None)):
            return self.model.generate(ids, **search)
        from keras_transformer.generation import generate

        return generate(self.model, ids, **search)

    def translate(
        self,
        texts,
        beam_size=4,
        batch_size=32,
        length_penalty=0.6,
        max_extra_length=50,
        progress=False,
    ):
        """Translates a list of sentences.

        Args:
            texts: list of str (a single str is treated as a list of one).
            beam_size: int >= 1; 1 is greedy search. Defaults to 4.
            batch_size: int >= 1, sentences per search. Defaults to 32.
            length_penalty: float alpha >= 0. Defaults to 0.6.
            max_extra_length: int >= 0, output tokens beyond the source
                length. Defaults to 50.
            progress: bool, show a tqdm progress bar (on stderr).

        Returns:
            list of str, in the order of `texts`.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, received {type(text).__name__}: {text!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")

        results = [""] * len(texts)
        sources = self.encode(texts)
        # Empty strings (nothing but the end id) translate to empty strings.
        todo = [i for i, ids in enumerate(sources) if len(ids) > 1 and texts[i].strip()]
        # Longest first: the slowest batch (and any out-of-memory) comes first.
        order = sorted(todo, key=lambda i: len(sources[i]), reverse=True)
        batches = [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
        with tqdm(total=len(order), desc="Translating", unit=" sentences", disable=not progress) as bar:
            for batch in batches:
                ids = np.zeros((len(batch), max(len(sources[i]) for i in batch)), "int32")
                for row, i in enumerate(batch):
                    ids[row, : len(sources[i])] = sources[i]
                outputs = self._generate(
                    ids,
                    beam_size=beam_size,
                    length_penalty=length_penalty,
                    max_extra_length=max_extra_length,
                )
                for i, text in zip(batch, self.tokenizer.decode(outputs)):
                    results[i] = text
                bar.update(len(batch))
        return results
