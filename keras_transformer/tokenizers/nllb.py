"""The tokenizer of NLLB-200 and M2M-100-architecture checkpoints (`NllbTokenizer`), in this package's ids.

An NLLB checkpoint tokenizes with one SentencePiece model,
`sentencepiece.bpe.model`, for every language, and numbers its pieces as
fairseq does: `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the pieces with
SentencePiece's id + 1 (fairseq's offset; SentencePiece's own first three
ids are its `<unk>`, `<s>`, `</s>`), then one token per language
(`eng_Latn`, `fra_Latn`, ...; 202 in NLLB-200) and `<mask>`. The embedding
table may have a few rows beyond these (NLLB-200: 256,206 rows for 256,204
tokens). A source is `[source language] tokens </s>` (`legacy_behaviour`:
`tokens </s> [source language]`); the decoder starts from `</s>` and its
first output is forced to the target language (Hugging Face's
`forced_bos_token_id`).

`NllbTokenizer` gives the same pieces as Hugging Face's `NllbTokenizer` but
numbers them as every other part of this package expects: pad = 0, unk = 1,
start = 2, end = 3, the other rows in checkpoint order from id 4 on (`<s>`
is an ordinary id). As for Marian, the decoder's start token is the end
token, which our search cannot tell apart, so the start id is one added
piece whose embedding the importer copies from `</s>`'s row:
`checkpoint_ids` is the checkpoint id behind each of our ids.

The languages are chosen per call: `with_languages("eng_Latn", "fra_Latn")`
is the same tokenizer bound to a pair. Its sources are `[eng_Latn] tokens
</s>`; its targets (training, scoring, a target prefix) are `[fra_Latn]
tokens </s>`, what the decoder produces after the start id; `decode` drops
the language tokens as `skip_special_tokens=True` does.

Only NumPy, SentencePiece and the standard library are imported.

Example:

```python
tokenizer = NllbTokenizer.load("preset_dir").with_languages("eng_Latn", "fra_Latn")
ids = tokenizer.encode(["A sentence."])        # [[id of eng_Latn, ..., tokenizer.end_id]]
tokenizer.decode([[2, tokenizer.id_of("fra_Latn"), ...]])
```
"""

import copy
import os

import numpy as np
import sentencepiece as spm

from keras_transformer.token_ids import END_ID, START_ID, UNK_ID, text_list
from keras_transformer.tokenizers.base import RenumberedTokenizer, json_bytes

SPM_FILE = "sentencepiece.bpe.model"
# Ours: the checkpoint's added tokens and sizes (Hugging Face keeps them in tokenizer.json and
# tokenizer_config.json, which a preset directory does not have).
SPECIALS_FILE = "nllb_tokenizer.json"
FILES = (SPM_FILE, SPECIALS_FILE)
SPIECE_UNDERLINE = "\u2581"
# fairseq's dictionary: these four first, then SentencePiece's pieces shifted by one.
FAIRSEQ_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
FAIRSEQ_OFFSET = 1
ADDED_START_PIECES = ("<start>", "<decoder_start>", "<nllb_start>")


class NllbTokenizer(RenumberedTokenizer):
    """NLLB's SentencePiece model, fairseq's ids and the language tokens, renumbered to ours.

    Args:
        proto: bytes, the serialized `sentencepiece.bpe.model`.
        added_tokens: dict token -> checkpoint id for the tokens after the
            pieces: the language codes and `<mask>` (tokenizer.json's
            `added_tokens`).
        language_codes: the language tokens among `added_tokens`, in
            checkpoint order.
        vocabulary_size: the checkpoint's rows (config.json's `vocab_size`),
            at least the tokens; rows beyond them are unused pieces.
        legacy_behaviour: bool, sources as `tokens </s> [language]`.
        start_id: the checkpoint id the decoder starts from (`</s>`, 2).

    Raises:
        ValueError: naming the problem: a proto SentencePiece cannot read or
            whose first three pieces are not its specials, added tokens
            that are not the ids after the pieces, too few rows.
    """

    format = "nllb"
    FILES = FILES
    source_input = ": the source language code first; target_prefix: the target language code"  # fairseq's, renumbered
    label, article = "NLLB", "an"

    def __init__(self, proto, added_tokens, language_codes, vocabulary_size, legacy_behaviour=False, start_id=2):
        try:
            processor = spm.SentencePieceProcessor(model_proto=bytes(proto))
        except RuntimeError:
            raise ValueError(f"{SPM_FILE} is not a SentencePiece model ({len(proto)} bytes it cannot parse)") from None
        size = processor.get_piece_size()
        if size < 4 or not all(processor.is_control(i) or processor.is_unknown(i) for i in range(3)):
            raise ValueError(f"{SPM_FILE}: its first three pieces must be <unk>, <s> and </s> (fairseq's layout)")
        first_added = size + FAIRSEQ_OFFSET
        if not isinstance(added_tokens, dict) or sorted(added_tokens.values()) != list(
                range(first_added, first_added + len(added_tokens))):
            raise ValueError(f"the language codes and <mask> must take the ids {first_added} .. after the "
                             f"{size} pieces of {SPM_FILE}, each once; received {len(added_tokens)} tokens")
        unknown = [code for code in language_codes if code not in added_tokens]
        if unknown or not language_codes:
            raise ValueError(f"language codes {unknown[:3] or '(none)'} are not among the added tokens")
        tokens = first_added + len(added_tokens)
        if not isinstance(vocabulary_size, int) or vocabulary_size < tokens:
            raise ValueError(f"vocab_size={vocabulary_size!r} is below the tokenizer's {tokens} tokens")
        if start_id not in FAIRSEQ_SPECIALS.values():
            raise ValueError(f"decoder_start_token_id={start_id!r} must be one of fairseq's special ids 0-3")
        self._proto, self._processor = bytes(proto), processor
        self._added = dict(added_tokens)
        self.language_codes = list(language_codes)
        self.checkpoint_vocabulary_size = vocabulary_size
        self.legacy_behaviour = bool(legacy_behaviour)
        self.checkpoint_start_id = start_id
        self.source_language = self.target_language = None

        # The piece of each checkpoint id.
        by_id = list(FAIRSEQ_SPECIALS) + [processor.id_to_piece(i) for i in range(3, size)]
        by_id += sorted(added_tokens, key=added_tokens.get)
        by_id += [f"<unused{i}>" for i in range(vocabulary_size - tokens)]
        taken = set(by_id)
        self.added_start_token = next(piece for piece in ADDED_START_PIECES if piece not in taken)
        pad, unk, end = FAIRSEQ_SPECIALS["<pad>"], FAIRSEQ_SPECIALS["<unk>"], FAIRSEQ_SPECIALS["</s>"]
        # checkpoint_ids[i]: the checkpoint id (embedding row) of our id i; the added start id takes start_id's row.
        ordinary = [i for i in range(vocabulary_size) if i not in (pad, unk, end)]
        self.checkpoint_ids = np.array([pad, unk, start_id, end] + ordinary, dtype=np.int64)
        self._pieces = [by_id[pad], by_id[unk], self.added_start_token, by_id[end]] + [by_id[i] for i in ordinary]
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        self._source_pieces, self._target_ids = self._pieces, self._ids  # one vocabulary for every language
        # SentencePiece id -> our id: its unk is <unk>; piece k >= 3 is checkpoint id k + 1.
        ours = np.empty(vocabulary_size, np.int64)
        others = np.flatnonzero(np.arange(len(self.checkpoint_ids)) != START_ID)  # each row once: the start id is added
        ours[self.checkpoint_ids[others]] = others
        self._ours_of_checkpoint = ours
        self._ours_of_piece = np.concatenate([[UNK_ID] * 3, ours[np.arange(3, size) + FAIRSEQ_OFFSET]]).astype(np.int64)
        # What decode drops, as skip_special_tokens=True: the specials, the language codes, <mask>, unused rows.
        self._dropped = np.zeros(len(self._pieces), bool)
        self._dropped[:4] = True
        self._dropped[ours[FAIRSEQ_SPECIALS["<s>"]]] = True
        self._dropped[ours[first_added:]] = True

    @property
    def proto(self):
        return self._proto

    source_proto = target_proto = proto  # one SentencePiece model for every language

    @property
    def added_tokens(self):
        """The language codes and `<mask>` with their checkpoint ids."""
        return dict(self._added)

    def describe_languages(self, limit=None):
        codes = self.language_codes if limit is None else self.language_codes[:limit]
        more = f", ... ({len(self.language_codes)} in all)" if limit is not None and len(self.language_codes) > limit else ""
        return ", ".join(codes) + more

    def check_language(self, name, code):
        """Raises a one-line `ValueError` unless `code` is one of the model's language codes."""
        if code is None:
            raise ValueError(f"this model translates between {len(self.language_codes)} languages: name the "
                             f"{name} (e.g. source_language='eng_Latn', target_language='fra_Latn'); the codes: "
                             f"{self.describe_languages()}")
        if code not in self._added or code not in self.language_codes:
            raise ValueError(f"{name}={code!r} is not one of this model's {len(self.language_codes)} language "
                             f"codes: {self.describe_languages()}")

    def with_languages(self, source_language=None, target_language=None):
        """This tokenizer bound to a language pair (either may stay None); checked against the codes."""
        for name, code in (("source_language", source_language), ("target_language", target_language)):
            if code is not None:
                self.check_language(name, code)
        bound = copy.copy(self)
        bound.source_language, bound.target_language = source_language, target_language
        return bound

    def source_pieces(self, text):
        """The pieces of one source text (str) as CTranslate2 is given them: no end piece (it appends it).

        Bound to a source language (`with_languages`), the language code
        first, as `encode` puts it; unbound, the text's pieces alone.
        """
        pieces = self._processor.encode(text, out_type=str)
        if self.source_language is None or self.legacy_behaviour:
            return pieces
        return [self.source_language] + pieces

    def encode(self, texts, add_start=False, add_end=True, target=False):
        """Text to our ids, as Hugging Face's `NllbTokenizer` with the bound languages (then renumbered).

        A source is `[source_language] tokens </s>` (`legacy_behaviour`:
        `tokens </s> [source_language]`); a target `[target_language]
        tokens </s>` (the decoder's output after its start token, in both
        layouts). `add_end=False` leaves out `</s>` (and, in the legacy
        layout, the language token after it).

        Args:
            texts: list of str (a single str is a list of one).
            add_start: bool, prepend the start id (training targets).
            add_end: bool, append the end id.
            target: bool, the texts are in the target language.

        Raises:
            ValueError: the side's language is not bound (`with_languages`).
        """
        texts = text_list(texts)
        name, code = ("target_language", self.target_language) if target else ("source_language", self.source_language)
        self.check_language(name, code)
        language = int(self._ours_of_checkpoint[self._added[code]])
        encoded = []
        for pieces in self._processor.encode(texts, out_type=int):
            ids = self._ours_of_piece[pieces].tolist() if pieces else []
            if self.legacy_behaviour and not target:
                ids = ids + ([END_ID, language] if add_end else [])
            else:
                ids = [language] + ids + ([END_ID] if add_end else [])
            encoded.append(([START_ID] if add_start else []) + ids)
        return encoded

    def decode(self, ids):
        """Our ids to text, as `NllbTokenizer.batch_decode(..., skip_special_tokens=True)`.

        Each sequence is cut at its first end id; the special tokens (pad,
        start, unk, `<s>`, the language codes, `<mask>`) are dropped; the rest
        is joined by the SentencePiece model and stripped (Hugging Face
        keeps the space of a lone first piece "▁" before a dropped `<unk>`).
        """
        kept = self._kept_pieces(ids, lambda token: 0 <= token < len(self._pieces) and not self._dropped[token])
        return [self._processor.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip() for pieces in kept]

    def specials(self):
        """What `SPECIALS_FILE` holds."""
        return {
            "format": self.format,
            "added_tokens": self._added,
            "language_codes": self.language_codes,
            "vocabulary_size": self.checkpoint_vocabulary_size,
            "legacy_behaviour": self.legacy_behaviour,
            "start_id": self.checkpoint_start_id,
        }

    def _file_contents(self):
        """sentencepiece.bpe.model and nllb_tokenizer.json (not the bound languages), for `save`."""
        return {SPM_FILE: self._proto, SPECIALS_FILE: json_bytes(self.specials(), ensure_ascii=False)}

    @classmethod
    def load(cls, directory):
        """Reads a directory written by `save`.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: naming the file that cannot be used.
        """
        directory = os.fspath(directory)
        specials = cls._description(directory)
        with open(os.path.join(directory, SPM_FILE), "rb") as f:
            proto = f.read()
        return cls._loaded(directory, proto, specials.get("added_tokens"), specials.get("language_codes") or [],
                           specials.get("vocabulary_size"), legacy_behaviour=specials.get("legacy_behaviour", False),
                           start_id=specials.get("start_id", 2))
