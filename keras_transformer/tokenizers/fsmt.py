"""The tokenizer of FSMT checkpoints (fairseq's WMT19 models, `"model_type": "fsmt"`), in this package's ids.

An FSMT checkpoint tokenizes as fairseq did for WMT19: Moses punctuation
normalisation and tokenization (`sacremoses`, in the source language), then
BPE with subword-nmt's merges (`merges.txt`; a word's last symbol ends in
`</w>`), and numbers the pieces with two vocabularies, `vocab-src.json` for
the encoder and `vocab-tgt.json` for the decoder, each fairseq's dictionary:
`<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the pieces. A source is
`tokens </s>`; the decoder starts from `</s>`. Decoding joins the pieces,
makes each `</w>` a space and detokenizes with Moses in the target language.

`FsmtTokenizer` gives the same pieces as Hugging Face's `FSMTTokenizer` but
numbers them as every other part of this package expects: pad = 0, unk = 1,
start = 2, end = 3, the other pieces of each vocabulary in checkpoint order
from id 4 on (`<s>` is an ordinary id). As for NLLB, the decoder's start
token is the end token, which our search cannot tell apart, so the start id
is one added piece whose embedding the importer copies from `</s>`'s row:
`checkpoint_ids` (target) and `source_checkpoint_ids` (source) are the
checkpoint ids behind ours.

Hugging Face's `FSMTTokenizer` numbers any text with the source vocabulary;
`encode(..., target=True)` (training targets, a target prefix) uses the
target vocabulary and the target language's Moses rules, as fairseq
prepared its target side.

Only NumPy, sacremoses and the standard library are imported.

Example:

```python
tokenizer = FsmtTokenizer.load("preset_dir")
ids = tokenizer.encode(["A sentence."])        # [[..., tokenizer.end_id]]
tokenizer.decode(ids)
```
"""

import os
import re
import unicodedata

import numpy as np

from keras_transformer.token_ids import END_ID, text_list
from keras_transformer.tokenizers.base import RenumberedTokenizer, json_bytes
from keras_transformer.utils import read_json_file

SOURCE_VOCAB_FILE = "vocab-src.json"
TARGET_VOCAB_FILE = "vocab-tgt.json"
MERGES_FILE = "merges.txt"
# Ours: the language pair and the special pieces (Hugging Face keeps them in config.json and
# tokenizer_config.json, which a preset directory does not have).
SPECIALS_FILE = "fsmt_tokenizer.json"
FILES = (SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE, MERGES_FILE, SPECIALS_FILE)
END_OF_WORD = "</w>"
ADDED_START_PIECES = ("<decoder_start>", "<start>", "<fsmt_start>")
# moses' replace-unicode-punctuation.perl, as Hugging Face's FSMTTokenizer applies it before normalising.
UNICODE_PUNCTUATION = {
    "，": ",", "、": ",", "”": '"', "“": '"', "∶": ":", "：": ":", "？": "?", "《": '"', "》": '"', "）": ")",
    "！": "!", "（": "(", "；": ";", "１": "1", "」": '"', "「": '"', "０": "0", "３": "3", "２": "2", "５": "5",
    "６": "6", "９": "9", "７": "7", "８": "8", "４": "4", "～": "~", "’": "'", "…": "...", "━": "-", "〈": "<",
    "〉": ">", "【": "[", "】": "]", "％": "%",
}


def replace_unicode_punctuation(text):
    """moses' replace-unicode-punctuation.perl: the two full stops (with the spaces after them), then one by one."""
    text = re.sub(r"。\s*", ". ", text)
    text = re.sub(r"．\s*", ". ", text)
    return "".join(UNICODE_PUNCTUATION.get(char, char) for char in text)


def remove_non_printing_characters(text):
    """moses' remove-non-printing-char.perl: drops every character of a Unicode category C*."""
    return "".join(char for char in text if not unicodedata.category(char).startswith("C"))


def bpe_pieces(word, ranks):
    """The BPE pieces of one Moses token: subword-nmt's merges, lowest rank first, `</w>` on the last symbol."""
    symbols = list(word[:-1]) + [word[-1] + END_OF_WORD]
    while len(symbols) > 1:
        pairs = set(zip(symbols, symbols[1:]))
        best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(symbols):
            if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def _check_vocab(vocab, name):
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{name} must map each piece to one of the ids 0 .. len - 1")


def _renumbered(vocab, specials, start_piece, start_row):
    """`(pieces, checkpoint_ids)`: our ids' pieces (pad, unk, start, end, then checkpoint order) and their rows."""
    pad, unk, end = (vocab[specials[name]] for name in ("pad_token", "unk_token", "end_token"))
    ordinary = [piece for piece in sorted(vocab, key=vocab.get) if vocab[piece] not in (pad, unk, end)]
    pieces = [specials["pad_token"], specials["unk_token"], start_piece, specials["end_token"]] + ordinary
    rows = np.array([pad, unk, start_row, end] + [vocab[piece] for piece in ordinary], dtype=np.int64)
    return pieces, rows


class FsmtTokenizer(RenumberedTokenizer):
    """Moses + BPE with fairseq's two dictionaries, renumbered to our ids.

    Args:
        source_vocab: dict piece -> checkpoint id (`vocab-src.json`).
        target_vocab: dict piece -> checkpoint id (`vocab-tgt.json`).
        merges: list of (str, str) pairs, the BPE merges in rank order.
        languages: (source, target) language codes (config.json's `langs`),
            which choose Moses' rules.
        do_lower_case: bool, lowercase texts before tokenizing.
        pad_token, unk_token, end_token, bos_token: the special pieces of both
            vocabularies (`bos_token` is an ordinary id here, dropped by
            `decode`).

    Raises:
        ValueError: naming the problem: ids that are not 0 .. len - 1, a
            special piece missing from a vocabulary, or `languages` that are
            not two codes.
    """

    format = "fsmt"
    FILES = FILES
    source_input = ": Moses-tokenized BPE pieces (vocab-src.json's)"  # renumbered (`checkpoint_ids`)
    label, article = "FSMT", "an"

    def __init__(self, source_vocab, target_vocab, merges, languages, do_lower_case=False, pad_token="<pad>",
                 unk_token="<unk>", end_token="</s>", bos_token="<s>"):
        _check_vocab(source_vocab, SOURCE_VOCAB_FILE)
        _check_vocab(target_vocab, TARGET_VOCAB_FILE)
        if not (isinstance(languages, (list, tuple)) and len(languages) == 2
                and all(isinstance(code, str) and code.strip() for code in languages)):
            raise ValueError(f"langs={languages!r} must be two language codes (source, target), e.g. ['en', 'de']")
        self._specials = {"pad_token": pad_token, "unk_token": unk_token, "end_token": end_token,
                          "bos_token": bos_token}
        if len(set(self._specials.values())) != len(self._specials):
            raise ValueError(f"the special pieces {self._specials} must be distinct")
        for name, piece in self._specials.items():
            for file, vocab in ((SOURCE_VOCAB_FILE, source_vocab), (TARGET_VOCAB_FILE, target_vocab)):
                if piece not in vocab:
                    raise ValueError(f"{name}={piece!r} is not in {file}")
        self._source_vocab, self._target_vocab = dict(source_vocab), dict(target_vocab)
        self._merges = [tuple(pair) for pair in merges]
        self._ranks = {pair: rank for rank, pair in enumerate(self._merges)}  # a repeated pair: its last rank, as HF
        self.languages = tuple(languages)
        self.do_lower_case = bool(do_lower_case)
        self.added_start_token = next(
            piece for piece in ADDED_START_PIECES if piece not in target_vocab and piece not in source_vocab)
        # The decoder starts from </s>: our added start id takes its row. The encoder never reads the start id.
        self._pieces, self.checkpoint_ids = _renumbered(target_vocab, self._specials, self.added_start_token,
                                                        target_vocab[end_token])
        self._source_pieces, self.source_checkpoint_ids = _renumbered(source_vocab, self._specials,
                                                                      self.added_start_token, source_vocab[pad_token])
        self._ids = {piece: i for i, piece in enumerate(self._source_pieces)}
        self._target_ids = {piece: i for i, piece in enumerate(self._pieces)}
        self._bos_id = self._target_ids[bos_token]
        self._moses = {}
        self._cache = ({}, {})

    @property
    def source_vocabulary_size(self):
        """Our source ids (`TransformerModel(source_vocabulary_size=...)`)."""
        return len(self._source_pieces)

    def _sacremoses(self, kind, language):
        if (kind, language) not in self._moses:
            try:
                import sacremoses
            except ModuleNotFoundError:
                raise ModuleNotFoundError("The FSMT tokenizer needs sacremoses (Moses' rules): "
                                          "pip install \"keras-aiayn[hub]\"", name="sacremoses") from None
            self._moses[kind, language] = getattr(sacremoses, kind)(lang=language)
        return self._moses[kind, language]

    def source_pieces(self, text):
        """The BPE pieces of one source text (str), without the end piece, as `encode` cuts them."""
        return self.pieces_of(text)

    def pieces_of(self, text, target=False):
        """The BPE pieces of one text (str): Moses in the source (or `target`) language, then BPE."""
        language = self.languages[1 if target else 0]
        if self.do_lower_case:
            text = text.lower()
        text = replace_unicode_punctuation(text)
        text = self._sacremoses("MosesPunctNormalizer", language).normalize(text)
        text = remove_non_printing_characters(text)
        words = self._sacremoses("MosesTokenizer", language).tokenize(
            text, aggressive_dash_splits=True, return_str=False, escape=True)
        cache = self._cache[bool(target)]
        pieces = []
        for word in words:
            if word:
                if word not in cache:
                    cache[word] = bpe_pieces(word, self._ranks)
                pieces.extend(cache[word])
        return pieces

    def encode(self, texts, add_start=False, add_end=True, target=False):
        """Text to our ids, as Hugging Face's `FSMTTokenizer` tokenizes (then renumbered).

        Args:
            texts: list of str (a single str is a list of one).
            add_start: bool, prepend the start id (training targets).
            add_end: bool, append the end id.
            target: bool, the texts are in the target language (its Moses
                rules and vocabulary).

        Returns:
            list of lists of int, one per text, unpadded.
        """
        return [self._numbered(self.pieces_of(text, target=target), add_start, add_end, target)
                for text in text_list(texts)]

    def decode(self, ids):
        """Our ids to target text, as `FSMTTokenizer.batch_decode(..., skip_special_tokens=True)`.

        Each sequence is cut at its first end id; the special pieces (pad,
        unk, start, `<s>`) are dropped; the rest is joined, each `</w>` made
        a space, and detokenized by Moses in the target language.
        """
        detokenizer = self._sacremoses("MosesDetokenizer", self.languages[1])
        kept = self._kept_pieces(ids, lambda token: END_ID < token < len(self._pieces) and token != self._bos_id)
        return [detokenizer.detokenize("".join(piece.replace(" ", "").replace(END_OF_WORD, " ") for piece in pieces)
                                       .split()) for pieces in kept]

    def specials(self):
        """What `SPECIALS_FILE` holds."""
        return {"format": self.format, "languages": list(self.languages), "do_lower_case": self.do_lower_case,
                **self._specials}

    def _file_contents(self):
        """vocab-src.json, vocab-tgt.json, merges.txt and fsmt_tokenizer.json, for `save`."""
        return {
            SOURCE_VOCAB_FILE: json_bytes(self._source_vocab, ensure_ascii=False),
            TARGET_VOCAB_FILE: json_bytes(self._target_vocab, ensure_ascii=False),
            MERGES_FILE: "".join(f"{first} {second}\n" for first, second in self._merges).encode("utf-8"),
            SPECIALS_FILE: json_bytes(self.specials(), ensure_ascii=False),
        }

    @classmethod
    def load(cls, directory, specials=None):
        """Reads a directory written by `save` (or a checkpoint's files, given `specials`).

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: naming the file that cannot be used.
        """
        directory = os.fspath(directory)
        specials = cls._description(directory, specials)
        vocabs = [read_json_file(os.path.join(directory, name)) for name in (SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE)]
        merges = read_merges(os.path.join(directory, MERGES_FILE))
        names = ("pad_token", "unk_token", "end_token", "bos_token")
        return cls._loaded(directory, *vocabs, merges, specials.get("languages"),
                           do_lower_case=specials.get("do_lower_case", False),
                           **{name: specials[name] for name in names if specials.get(name) is not None})


def read_merges(path):
    """The merges of a `merges.txt` (one `first second` pair a line, in rank order), as FSMTTokenizer reads them."""
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8").split("\n")[:-1]
    return [tuple(line.split()[:2]) for line in lines]
