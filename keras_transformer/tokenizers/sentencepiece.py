"""One shared subword vocabulary for source and target (the paper shares it).

The vocabulary is a SentencePiece model. Its serialized proto is the single
artifact: the Python `sentencepiece` processor encodes and decodes here (fast,
no backend involved), and the same bytes drive the keras-hub tokenizer and the
TensorFlow Text op used inside an exported SavedModel, so all three give the
same ids.

Reserved ids: 0 = padding (the model builds its masks from `ids > 0`),
1 = unknown, 2 = start, 3 = end.
"""

import io
import itertools
import logging
import os
import random
import re

import sentencepiece as spm

from keras_transformer.tokenizers.fsmt import FsmtTokenizer
from keras_transformer.tokenizers.marian import MarianTokenizer
from keras_transformer.tokenizers.nllb import NllbTokenizer
from keras_transformer.textio import iter_lines
from keras_transformer.token_ids import (  # noqa: F401 (re-exported: the special ids' public import path)
    END_ID,
    FIRST_ORDINARY_ID,
    PAD_ID,
    START_ID,
    UNK_ID,
    id_sequences,
    text_list,
)
from keras_transformer.tokenizers.base import TokenizerBase
from keras_transformer.utils import write_bytes_atomically

logger = logging.getLogger(__name__)

TOKENIZER_FILENAME = "tokenizer.model"
MODEL_TYPES = ("bpe", "unigram")
_SAMPLING_SEED = 1234


def _is_file(item):
    if isinstance(item, os.PathLike):
        return True
    return isinstance(item, str) and "\n" not in item and os.path.isfile(item)


def _sentences(texts_or_files):
    """Yields sentences, interleaving the sources line by line.

    Interleaving (one English line, one German line, ...) keeps both
    languages represented however the iteration is cut short.
    """
    if isinstance(texts_or_files, (str, os.PathLike)):
        texts_or_files = [texts_or_files]  # A single path.
        if not _is_file(texts_or_files[0]):
            raise FileNotFoundError(f"No such corpus file: {texts_or_files[0]!r}")
    sources, texts = [], []
    for item in texts_or_files:
        if _is_file(item):
            sources.append(line.strip() for line in iter_lines(item) if line.strip())
        elif isinstance(item, str):
            if item.strip():
                texts.append(item.strip())
        else:
            raise TypeError(
                f"Expected sentences (str) or file paths, received {item!r} "
                f"of type {type(item).__name__}"
            )
    if texts:
        sources.insert(0, iter(texts))
    sentinel = object()
    for group in itertools.zip_longest(*sources, fillvalue=sentinel):
        for sentence in group:
            if sentence is not sentinel:
                yield sentence


def _reservoir_sample(sentences, size, seed=_SAMPLING_SEED):
    """A uniform sample of `size` sentences, in corpus order, reproducibly."""
    rng = random.Random(seed)
    sample = []  # (index, sentence)
    for i, sentence in enumerate(sentences):
        if i < size:
            sample.append((i, sentence))
        else:
            j = rng.randint(0, i)
            if j < size:
                sample[j] = (i, sentence)
    return [sentence for _, sentence in sorted(sample, key=lambda pair: pair[0])]


def train_tokenizer(
    texts_or_files, vocabulary_size=8000, model_type="bpe", max_sentences=None
):
    """Trains one SentencePiece vocabulary shared by both languages.

    Training is deterministic: the same input gives the same proto bytes.
    Nothing is written to disk (the trainer reads an in-memory iterator and
    writes to a buffer).

    Args:
        texts_or_files: an iterable of sentences (str) and/or paths of UTF-8
            text files with one sentence per line (plain or `.gz`), e.g.
            `["train.en", "train.de"]`; lines of several files are
            interleaved. An item that is an `os.PathLike` or a str naming an
            existing file is read as a file; a single str or path is a file.
        vocabulary_size: int. Number of pieces, the 4 reserved ids included.
            Defaults to `8000`.
        model_type: str. `"bpe"` (the paper's byte-pair encoding) or
            `"unigram"`. Defaults to `"bpe"`.
        max_sentences: int or `None`. Train on a uniform, reproducible sample
            of this many sentences (for large corpora such as WMT, e.g.
            `2_000_000`); `None` uses every sentence. Defaults to `None`.

    Returns:
        A `Tokenizer`.

    Example:

    ```python
    tokenizer = train_tokenizer(["train.en.gz", "train.de.gz"], 37000)
    tokenizer.save("preset_dir")
    ```
    """
    if (
        isinstance(vocabulary_size, bool)
        or not isinstance(vocabulary_size, int)
        or vocabulary_size <= FIRST_ORDINARY_ID
    ):
        raise ValueError(
            f"vocabulary_size={vocabulary_size!r} must be an int > {FIRST_ORDINARY_ID} "
            f"(ids 0-{FIRST_ORDINARY_ID - 1} are reserved)"
        )
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} must be one of {MODEL_TYPES}")
    if max_sentences is not None and (
        isinstance(max_sentences, bool)
        or not isinstance(max_sentences, int)
        or max_sentences <= 0
    ):
        raise ValueError(f"max_sentences={max_sentences!r} must be a positive int or None")

    from tqdm.auto import tqdm  # here: the ONNX Runtime server loads this module and never trains

    sentences = tqdm(_sentences(texts_or_files), desc="Reading sentences", unit=" lines", disable=None)
    if max_sentences is not None:
        # SentencePiece's own sampling (`shuffle_input_sentence` with
        # `input_sentence_size`) differs from run to run even with
        # `set_random_generator_seed`, so we sample with a seeded RNG.
        sentences = _reservoir_sample(sentences, max_sentences)
    logger.info(
        "Training a %s vocabulary of %d pieces with SentencePiece", model_type, vocabulary_size
    )
    model = io.BytesIO()
    # SentencePiece turns an exception raised by the iterator (a missing or
    # non-UTF-8 file) into its own RuntimeError; the original is kept here.
    reading_errors = []

    def guarded(sentences):
        try:
            yield from sentences
        except Exception as error:
            reading_errors.append(error)
            raise

    try:
        _train_sentencepiece(guarded(sentences), model, vocabulary_size, model_type)
    except RuntimeError as error:
        if reading_errors:
            raise reading_errors[0] from None
        raise _training_error(error, vocabulary_size) from None
    tokenizer = Tokenizer(model.getvalue())
    logger.info("Trained a vocabulary of %d pieces", tokenizer.vocabulary_size)
    return tokenizer


def _train_sentencepiece(sentences, model_writer, vocabulary_size, model_type):
    # We call SentencePiece directly: keras-hub's `compute_sentence_piece_proto`
    # cannot set the special ids, and we need pad=0, unk=1, start=2, end=3.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model_writer,
        vocab_size=vocabulary_size,
        model_type=model_type,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=START_ID,
        eos_id=END_ID,
        # Every character seen in training gets a piece: German umlauts, ß
        # and French accents must never become <unk>.
        character_coverage=1.0,
        # NFKC (SentencePiece's default): compatibility variants (full-width
        # forms, ligatures, decomposed accents, non-breaking spaces) map to one
        # form, so the same word always gets the same pieces. The rules are
        # stored in the proto, so keras-hub and TF Text apply them identically.
        # Decoding returns the normalized text; NFC input (what corpora and
        # users normally have) round-trips unchanged.
        normalization_rule_name="nmt_nfkc",
        # Reproducibility: one thread, corpus order, no internal sampling.
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,  # SentencePiece's INFO lines are very chatty.
    )


def _training_error(error, vocabulary_size):
    """SentencePiece's INTERNAL errors, as the advice a user can act on."""
    message = str(error)
    too_large = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_large:
        limit = int(too_large.group(2))
        return ValueError(
            f"vocabulary_size={vocabulary_size} is too large for this corpus: SentencePiece can "
            f"build at most {limit} pieces from it. Use a vocabulary of at most {limit} "
            "(--vocabulary-size) or train on more text."
        )
    too_small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)\.", message)
    if too_small:
        # character_coverage=1.0: every character of the corpus (and each special id) needs its own piece.
        needed = int(too_small.group(2))
        return ValueError(
            f"vocabulary_size={vocabulary_size} is too small for this corpus: its distinct characters and "
            f"the special ids need {needed} pieces. Use a vocabulary of at least {needed} (--vocabulary-size)."
        )
    if "sentences_.empty()" in message:
        return ValueError("No sentence to train the vocabulary on: the corpus is empty or has only blank lines")
    return RuntimeError(f"SentencePiece could not train a vocabulary of {vocabulary_size} pieces: {message.strip()}")


class Tokenizer(TokenizerBase):
    """A shared SentencePiece subword vocabulary.

    Wraps the serialized SentencePiece proto. Python-side encoding and
    decoding use the `sentencepiece` processor; `to_keras_hub()` and
    `tf_text_tokenizer()` give in-graph tokenizers built from the same bytes.
    The proto must reserve id 0 for padding and define start and end pieces
    (`train_tokenizer` uses pad=0, unk=1, start=2, end=3).

    Args:
        proto: bytes. A serialized SentencePiece `ModelProto`.

    Example:

    ```python
    tokenizer = Tokenizer.load("preset_dir")
    ids = tokenizer.encode(["A sentence."])        # [[..., tokenizer.end_id]]
    tokenizer.decode(ids)                          # ["A sentence."]
    ```
    """

    # What every tokenizer answers (`tokenizer_base.TokenizerBase`).
    format = "sentencepiece"
    FILES = (TOKENIZER_FILENAME,)
    sentencepiece_ids = True

    def __init__(self, proto):
        if not isinstance(proto, (bytes, bytearray)):
            raise TypeError(
                f"proto must be the serialized SentencePiece model (bytes), "
                f"received {type(proto).__name__}"
            )
        self._proto = bytes(proto)
        try:
            self._processor = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError:  # SentencePiece's "INTERNAL: ... ParseFromArray" says no more.
            raise ValueError(
                f"Not a serialized SentencePiece model: SentencePiece cannot parse these {len(self._proto)} bytes"
            ) from None
        if self.vocabulary_size == 0:
            raise ValueError(f"Not a SentencePiece model: {len(self._proto)} bytes without any piece")
        if self.pad_id != PAD_ID:
            raise ValueError(
                f"The SentencePiece model has pad_id={self.pad_id}; this "
                f"package needs padding at id {PAD_ID}"
            )
        if self.start_id < 0 or self.end_id < 0:
            raise ValueError(
                f"The SentencePiece model has start_id={self.start_id}, "
                f"end_id={self.end_id}; both must be defined (>= 0)"
            )

    @property
    def proto(self):
        """The serialized SentencePiece model (bytes)."""
        return self._proto

    @property
    def source_proto(self):
        """The SentencePiece model of the source side: `proto` (the vocabulary is shared)."""
        return self._proto

    @property
    def target_proto(self):
        """The SentencePiece model of the target side: `proto` (the vocabulary is shared)."""
        return self._proto

    @property
    def language_codes(self):
        """The `>>xx<<` target-language tokens a source text must start with: none."""
        return []

    @property
    def vocabulary_size(self):
        return self._processor.get_piece_size()

    @property
    def pad_id(self):
        return self._processor.pad_id()

    @property
    def unk_id(self):
        return self._processor.unk_id()

    @property
    def start_id(self):
        return self._processor.bos_id()

    @property
    def end_id(self):
        return self._processor.eos_id()

    def encode(self, texts, add_start=False, add_end=True, target=False):
        """Text to ids.

        Args:
            texts: list of str (a single str is treated as a list of one).
            add_start: bool. Prepend the start id. Defaults to `False`.
            add_end: bool. Append the end id. Defaults to `True`.
            target: bool, the texts are in the target language (the same
                vocabulary here: it is shared; a `MarianTokenizer` has two).

        Returns:
            list of lists of int, one per text, unpadded.
        """
        texts = text_list(texts)
        return self._processor.encode(
            texts, out_type=int, add_bos=add_start, add_eos=add_end
        )

    def decode(self, ids):
        """Ids to text.

        Each sequence is cut at its first end id; padding and start ids are
        dropped, so generated rows `[start, ..., end, 0, 0]` decode cleanly.

        Args:
            ids: list of lists of int, or a 2D array or tensor `[B, L]`
                (a flat sequence or 1D array is treated as one sequence).

        Returns:
            list of str, one per sequence.
        """
        ids = id_sequences(ids)
        drop = {self.pad_id, self.start_id}
        sequences = []
        for sequence in ids:
            kept = []
            for token in sequence:
                token = int(token)
                if token == self.end_id:
                    break
                if token not in drop:
                    kept.append(token)
            sequences.append(kept)
        return self._processor.decode(sequences)

    def pieces(self):
        """The piece of each id, in id order."""
        return [self._processor.id_to_piece(i) for i in range(self.vocabulary_size)]

    def source_pieces(self, text):
        """The pieces of one source text (str), without start or end pieces: the SentencePiece model's."""
        return self._processor.encode(text, out_type=str)

    def save(self, directory):
        """Writes `directory/tokenizer.model` atomically; returns its path.

        Args:
            directory: str or path. Created if missing.
        """
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        return write_bytes_atomically(os.path.join(directory, TOKENIZER_FILENAME), self._proto)

    @classmethod
    def load(cls, directory):
        """Reads `directory/tokenizer.model`.

        Args:
            directory: str or path. A directory written by `save` (a preset
                directory).

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: the file is not a usable SentencePiece model (named).
        """
        path = os.path.join(os.fspath(directory), TOKENIZER_FILENAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No tokenizer in {os.fspath(directory)!r}: expected the file {path!r}"
            )
        with open(path, "rb") as f:
            proto = f.read()
        try:
            return cls(proto)
        except ValueError as error:
            raise ValueError(f"Cannot load the tokenizer {path}: {error}") from None

    def to_keras_hub(self):
        """A `keras_hub.tokenizers.SentencePieceTokenizer` on the same proto.

        It neither prepends the start id nor appends the end id.
        """
        import keras_hub

        return keras_hub.tokenizers.SentencePieceTokenizer(proto=self._proto)

    def tf_text_tokenizer(self, add_start=False, add_end=True):
        """A `tensorflow_text.SentencepieceTokenizer` for in-graph use.

        Same ids as `encode` with the same flags; usable inside a
        `tf.function` and exportable in a SavedModel.

        Args:
            add_start: bool. Prepend the start id. Defaults to `False`.
            add_end: bool. Append the end id. Defaults to `True`.
        """
        import tensorflow as tf
        import tensorflow_text

        return tensorflow_text.SentencepieceTokenizer(
            model=self._proto, out_type=tf.int32, add_bos=add_start, add_eos=add_end
        )


def load_tokenizer(directory):
    """The tokenizer stored in a preset (or exported) directory, or None if it has none.

    `tokenizer.model` is a `Tokenizer` (one shared SentencePiece vocabulary);
    `marian_tokenizer.json` with `source.spm`, `target.spm` and `vocab.json`
    is a `MarianTokenizer` (an imported OPUS-MT checkpoint's);
    `nllb_tokenizer.json` with `sentencepiece.bpe.model` an `NllbTokenizer`
    (an imported NLLB-200 checkpoint's); `fsmt_tokenizer.json` with
    `vocab-src.json`, `vocab-tgt.json` and `merges.txt` an `FsmtTokenizer`
    (an imported FSMT checkpoint's). Each class names its files
    (`FILES`), the last the one it is recognised by.
    """
    directory = os.fspath(directory)
    for cls in (Tokenizer, MarianTokenizer, NllbTokenizer, FsmtTokenizer):
        if os.path.isfile(os.path.join(directory, cls.FILES[-1])):
            return cls.load(directory)
    return None
