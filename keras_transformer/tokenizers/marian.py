"""The tokenizer of Marian / OPUS-MT checkpoints, in this package's ids.

A Marian checkpoint tokenizes with two SentencePiece models, `source.spm`
for the input language and `target.spm` for the output language, and maps the
pieces of both to ids with one vocabulary, `vocab.json` (a piece missing
from it is `<unk>`). Its special ids differ from ours: `</s>` is 0, `<unk>`
1 and `<pad>` the last id, and the decoder starts from `<pad>`.

`MarianTokenizer` gives the same pieces as Hugging Face's `MarianTokenizer`
but numbers them as every other part of this package expects: the
vocabulary is permuted so that pad = 0, unk = 1, start = 2 and end = 3, and
the other pieces keep their Marian order from id 4 on. Because the Marian
decoder starts from the padding token, and our model masks padding, the
start token is one added piece (`<s>`) whose embedding the importer copies
from Marian's `<pad>` row: the model computes exactly what the Marian one
does, and the search, the exports and the server need no other special ids.
`marian_ids` is that permutation (the Marian id behind each of our ids),
which `keras_transformer.convert.marian` applies to the weights.

Newer checkpoints (Tatoeba-Challenge, transformers PR #15831) have separate
vocabularies: `vocab.json` for the source and `target_vocab.json` for the
target (`separate_vocabs: true`). Then source texts are numbered with the
first, target texts with the second, each renumbered the same way
(`source_marian_ids`, `marian_ids`), and decoding reads the target's.

Only NumPy, SentencePiece and the standard library are imported: the ONNX
Runtime server uses this class without Keras.

Example:

```python
from keras_transformer.tokenizers.marian import MarianTokenizer

tokenizer = MarianTokenizer.load("preset_dir")       # or a converted checkpoint's
ids = tokenizer.encode(["A sentence."])               # [[..., tokenizer.end_id]]
tokenizer.decode(ids)                                 # ["A sentence."] (target side)
```
"""

import os

import numpy as np
import sentencepiece as spm

from keras_transformer.token_ids import FIRST_ORDINARY_ID, text_list
from keras_transformer.tokenizers.base import RenumberedTokenizer, json_bytes
from keras_transformer.utils import read_json_file

SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
VOCAB_FILE = "vocab.json"
TARGET_VOCAB_FILE = "target_vocab.json"
# Ours: which pieces of vocab.json are special (Hugging Face keeps this in
# config.json and tokenizer_config.json, which a preset directory does not have).
SPECIALS_FILE = "marian_tokenizer.json"
FILES = (SOURCE_SPM, TARGET_SPM, VOCAB_FILE, SPECIALS_FILE)
SPIECE_UNDERLINE = "\u2581"
ADDED_START_PIECES = ("<s>", "<start>", "<decoder_start>")


def split_language_code(text):
    """`(code, rest)`: a leading `>>xx<<` target-language token and the text after it.

    As Hugging Face's `MarianTokenizer.remove_language_code`: a text that
    starts with ">>" and has a "<<" after it starts with a code (kept whole,
    one piece); otherwise `code` is None.
    """
    if text.startswith(">>"):
        end = text.find("<<")
        if end != -1:
            return text[: end + 2], text[end + 2:]
    return None, text


def _processor(proto, name):
    try:
        return spm.SentencePieceProcessor(model_proto=proto)
    except RuntimeError:
        raise ValueError(f"{name} is not a SentencePiece model ({len(proto)} bytes SentencePiece cannot parse)") from None


def _check_vocab(vocab, name):
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{name} must be a non-empty JSON object of piece -> id")
    marian_ids = sorted(vocab.values()) if all(isinstance(i, int) for i in vocab.values()) else None
    if marian_ids != list(range(len(vocab))):
        raise ValueError(
            f"{name}: the ids must be the integers 0 .. {len(vocab) - 1}, each once "
            "(a vocabulary with gaps or repeated ids cannot be a model's embedding rows)"
        )


def _renumbered(vocab, pad_token, unk_token, end_token, start_piece, start_marian_id):
    """`(pieces, marian_ids)`: our ids' pieces (pad, unk, start, end, then Marian's order) and Marian rows."""
    special = {vocab[pad_token], vocab[unk_token], vocab[end_token], start_marian_id}
    ordinary = [piece for piece in sorted(vocab, key=vocab.get) if vocab[piece] not in special]
    pieces = [pad_token, unk_token, start_piece, end_token] + ordinary
    marian_ids = np.array(
        [vocab[pad_token], vocab[unk_token], start_marian_id, vocab[end_token]] + [vocab[p] for p in ordinary],
        dtype=np.int64,
    )
    return pieces, marian_ids


class MarianTokenizer(RenumberedTokenizer):
    """Source and target SentencePiece models with Marian's vocabulary (or two), in our ids.

    Args:
        source_proto: bytes, the serialized `source.spm`.
        target_proto: bytes, the serialized `target.spm`.
        vocab: dict piece -> Marian id (`vocab.json`), ids 0 .. len - 1.
        pad_token, unk_token, end_token: the special pieces of `vocab`.
        start_token: the piece the Marian decoder starts from; None or equal
            to `pad_token` (Marian's convention) adds a start piece.
        target_vocab: optional dict piece -> Marian id (`target_vocab.json`):
            separate vocabularies. `vocab` then numbers the source only; the
            special pieces are looked up by name in each (the config's ids
            are the target's).

    Raises:
        ValueError: naming the field: ids that are not 0 .. len - 1, a special
            piece missing from `vocab`, two special roles on one piece, or a
            proto SentencePiece cannot read.
    """

    format = "marian"
    FILES = FILES
    source_input = ": source.spm's, after a leading >>xx<< piece"  # looked up in vocab.json, renumbered (`marian_ids`)
    label = "Marian"

    def __init__(self, source_proto, target_proto, vocab, pad_token="<pad>", unk_token="<unk>", end_token="</s>",
                 start_token=None, target_vocab=None, languages=None):
        _check_vocab(vocab, VOCAB_FILE)
        if languages is not None and not (
                isinstance(languages, (list, tuple)) and len(languages) == 2
                and all(isinstance(code, str) and code.strip() for code in languages)):
            raise ValueError(f"languages={languages!r} must be None or two non-empty codes (source, target)")
        if target_vocab is not None:
            _check_vocab(target_vocab, TARGET_VOCAB_FILE)
        start_token = None if start_token == pad_token else start_token
        specials = {"pad_token": pad_token, "unk_token": unk_token, "end_token": end_token}
        if start_token is not None:
            specials["start_token"] = start_token
        for name, piece in specials.items():
            if piece not in (vocab if target_vocab is None else target_vocab):
                file = VOCAB_FILE if target_vocab is None else TARGET_VOCAB_FILE
                raise ValueError(f"{name}={piece!r} is not in {file}")
            if target_vocab is not None and name != "start_token" and piece not in vocab:
                raise ValueError(f"{name}={piece!r} is not in {VOCAB_FILE} (the source vocabulary)")
        if len(set(specials.values())) != len(specials):
            raise ValueError(f"the special pieces {specials} must be distinct")
        self._source = _processor(bytes(source_proto), SOURCE_SPM)
        self._target = _processor(bytes(target_proto), TARGET_SPM)
        self._source_proto, self._target_proto = bytes(source_proto), bytes(target_proto)
        self._vocab = dict(vocab)
        self._target_vocab = None if target_vocab is None else dict(target_vocab)
        self.pad_token, self.unk_token, self.end_token = pad_token, unk_token, end_token
        self.start_token = start_token
        decoder_vocab = vocab if target_vocab is None else target_vocab
        if start_token is None:
            # Marian starts from <pad>; our start id is an added piece with <pad>'s embedding.
            self.added_start_token = next(
                piece for piece in ADDED_START_PIECES if piece not in decoder_vocab and piece not in vocab)
            start_piece, start_marian_id = self.added_start_token, decoder_vocab[pad_token]
        else:
            self.added_start_token = None
            start_piece, start_marian_id = start_token, decoder_vocab[start_token]
        # marian_ids[i]: the Marian id (the decoder's embedding row, logits-bias entry) of our id i.
        self._pieces, self.marian_ids = _renumbered(decoder_vocab, pad_token, unk_token, end_token, start_piece,
                                                    start_marian_id)
        self._target_ids = {piece: i for i, piece in enumerate(self._pieces)}
        if target_vocab is None:
            self._source_pieces, self.source_marian_ids = self._pieces, self.marian_ids
        else:
            # The encoder never reads the start id: its row is the source <pad>'s (as the shared case's).
            self._source_pieces, self.source_marian_ids = _renumbered(
                vocab, pad_token, unk_token, end_token, start_piece, vocab[pad_token])
        self._ids = {piece: i for i, piece in enumerate(self._source_pieces)}
        self.language_codes = sorted(piece for piece in vocab if piece.startswith(">>") and piece.endswith("<<"))
        # The checkpoint's `source_lang` / `target_lang` (tokenizer_config.json), for the model card of an export.
        self.languages = None if languages is None else tuple(languages)

    @property
    def separate_vocabs(self):
        """Whether the source and the target have vocabularies of their own (`target_vocab.json`)."""
        return self._target_vocab is not None

    @property
    def source_vocabulary_size(self):
        """Our source ids with separate vocabularies (`TransformerModel(source_vocabulary_size=...)`), else None."""
        return len(self._source_pieces) if self.separate_vocabs else None

    @property
    def vocab(self):
        """Marian's `vocab.json` (piece -> Marian id), as loaded: the source's with separate vocabularies."""
        return dict(self._vocab)

    @property
    def target_vocab(self):
        """Marian's `target_vocab.json` (piece -> Marian id) with separate vocabularies, else None."""
        return None if self._target_vocab is None else dict(self._target_vocab)

    @property
    def source_proto(self):
        return self._source_proto

    @property
    def target_proto(self):
        return self._target_proto

    def source_pieces(self, text):
        """The pieces of one source text (str), without start or end pieces, as `encode` cuts them.

        A leading `>>xx<<` is one piece, then `source.spm`'s pieces of the rest
        (a piece outside `vocab.json` stays as it is; `encode` makes it unk).
        """
        code, rest = split_language_code(text)
        return ([code] if code is not None else []) + self._source.encode(rest, out_type=str)

    def files(self):
        """The file names `save` writes, the last the one `load_tokenizer` recognises the tokenizer by."""
        return self.FILES[:-1] + (TARGET_VOCAB_FILE,) + self.FILES[-1:] if self.separate_vocabs else self.FILES

    def encode(self, texts, add_start=False, add_end=True, target=False):
        """Text to our ids, as Hugging Face's `MarianTokenizer` tokenizes (then renumbered).

        A leading `>>xx<<` language code is one piece; the rest is cut into
        pieces by `source.spm` (`target.spm` with `target=True`, for training
        targets); a piece outside `vocab.json` is unk.

        Args:
            texts: list of str (a single str is a list of one).
            add_start: bool, prepend the start id (training targets).
            add_end: bool, append the end id.
            target: bool, the texts are in the target language.

        Returns:
            list of lists of int, one per text, unpadded.

        Raises:
            ValueError: the model translates into several languages (its
                vocabulary has `>>xx<<` codes) and a source text does not
                start with one.
        """
        texts = text_list(texts)
        processor = self._target if target else self._source
        encoded = []
        for index, text in enumerate(texts):
            code, rest = split_language_code(text)
            if not target and self.language_codes and code not in self.language_codes and text.strip():
                shown = ", ".join(self.language_codes[:5]) + (", ..." if len(self.language_codes) > 5 else "")
                raise ValueError(
                    f"texts[{index}] does not start with a target-language token: this model translates into "
                    f"{len(self.language_codes)} languages; start each text with one of {shown} "
                    f"(e.g. '{self.language_codes[0]} {text[:30]}')"
                )
            pieces = ([code] if code is not None else []) + processor.encode(rest, out_type=str)
            encoded.append(self._numbered(pieces, add_start, add_end, target))
        return encoded

    def decode(self, ids):
        """Our ids to target text, as `MarianTokenizer.batch_decode(..., skip_special_tokens=True)`.

        Each sequence is cut at its first end id; the special pieces (pad,
        start, unk) are dropped; the rest is joined by `target.spm`, with
        any "▁" left (pieces `target.spm` does not know) made a space, and
        the ends stripped.

        Args:
            ids: list of lists of int, or a 2D array `[B, L]` (a flat sequence
                is one sequence).

        Returns:
            list of str.
        """
        return [self._target.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()
                for pieces in self._kept_pieces(ids, lambda token: token >= FIRST_ORDINARY_ID)]

    def specials(self):
        """What `SPECIALS_FILE` holds: the special pieces and the added start piece."""
        specials = {
            "format": self.format,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "end_token": self.end_token,
            "start_token": self.start_token,
        }
        if self.separate_vocabs:  # only then: the files of a shared vocabulary are unchanged
            specials["separate_vocabs"] = True
        if self.languages is not None:  # likewise
            specials["languages"] = list(self.languages)
        return specials

    def _file_contents(self):
        """source.spm, target.spm, vocab.json (target_vocab.json) and marian_tokenizer.json, for `save`."""
        contents = {
            SOURCE_SPM: self._source_proto,
            TARGET_SPM: self._target_proto,
            VOCAB_FILE: json_bytes(self._vocab, ensure_ascii=False),
            SPECIALS_FILE: json_bytes(self.specials(), sort_keys=True),
        }
        if self.separate_vocabs:
            contents[TARGET_VOCAB_FILE] = json_bytes(self._target_vocab, ensure_ascii=False)
        return contents

    @classmethod
    def load(cls, directory, specials=None):
        """Reads a directory written by `save` (or a Marian checkpoint's files, given `specials`).

        Args:
            directory: str or path.
            specials: optional dict with pad_token, unk_token, end_token,
                start_token, separate_vocabs and languages; read from
                marian_tokenizer.json when None.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: naming the file that cannot be used.
        """
        directory = os.fspath(directory)
        specials = cls._description(directory, specials)
        vocab = read_json_file(os.path.join(directory, VOCAB_FILE))
        target_vocab = None
        if specials.get("separate_vocabs"):
            path = os.path.join(directory, TARGET_VOCAB_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"No Marian tokenizer in {directory!r}: {TARGET_VOCAB_FILE} is missing "
                                        "(separate_vocabs is true)")
            target_vocab = read_json_file(path)
        protos = []
        for name in (SOURCE_SPM, TARGET_SPM):
            with open(os.path.join(directory, name), "rb") as f:
                protos.append(f.read())
        return cls._loaded(
            directory, *protos, vocab,
            pad_token=specials.get("pad_token", "<pad>"), unk_token=specials.get("unk_token", "<unk>"),
            end_token=specials.get("end_token", "</s>"), start_token=specials.get("start_token"),
            target_vocab=target_vocab, languages=specials.get("languages"),
        )
