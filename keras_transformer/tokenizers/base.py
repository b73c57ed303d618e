"""What every tokenizer answers, written once: the base of `Tokenizer` and of the imported checkpoints' tokenizers.

`TokenizerBase` is what callers ask instead of checking a tokenizer's type.
`RenumberedTokenizer` is the base of `MarianTokenizer`, `NllbTokenizer` and
`FsmtTokenizer`: a checkpoint's pieces renumbered to our ids (pad 0, unk 1,
start 2, end 3, an added start piece), with the accessors, the id lookups,
`save` and the checks of `load` that the three share.

Only the standard library and `token_ids` are imported (the ONNX Runtime
server uses the tokenizers without Keras).
"""

import json
import os

from keras_transformer.token_ids import END_ID, PAD_ID, START_ID, UNK_ID, id_sequences
from keras_transformer.utils import read_json_file, write_bytes_atomically


class TokenizerBase:
    """What every tokenizer answers.

    Attributes:
        format: str, the tokenizer's kind (its description file records it).
        FILES: the file names `save` writes, the last the one
            `load_tokenizer` recognises the tokenizer by.
        sentencepiece_ids: bool, whether its ids are its SentencePiece
            model's own (an in-graph SentencePiece op gives them).
        source_input: str, how `source_pieces` cuts a text, for CTranslate2's
            messages ("" for SentencePiece's pieces, nothing more).
    """

    format = None
    FILES = ()
    sentencepiece_ids = False
    source_input = ""

    def files(self):
        """The file names `save` writes, the last the one `load_tokenizer` recognises the tokenizer by."""
        return self.FILES


def json_bytes(value, **dumps_args):
    """`value` as the UTF-8 bytes of an indented JSON document ending in a newline."""
    return (json.dumps(value, indent=2, **dumps_args) + "\n").encode("utf-8")


class RenumberedTokenizer(TokenizerBase):
    """A checkpoint's tokenizer renumbered to our ids; the subclass tokenizes, this class numbers and stores.

    A subclass sets, in `__init__`: `_pieces` (the piece of each of our
    target ids), `_source_pieces` (of each source id; `_pieces` when the
    vocabulary is shared), `_ids` and `_target_ids` (piece -> our source and
    target id); and writes `_file_contents()` (file name -> bytes, for
    `save`), `specials()` (what its description file, `FILES[-1]`, holds)
    and `load` (through `_description` and `_loaded`). `label` and
    `article` name it in messages ("a Marian tokenizer").
    """

    # The special ids, as `keras_transformer.tokenizers.sentencepiece.Tokenizer` has them.
    pad_id, unk_id, start_id, end_id = PAD_ID, UNK_ID, START_ID, END_ID
    label, article = None, "a"

    @property
    def vocabulary_size(self):
        """Our target ids (the decoder's and the output's; with a shared vocabulary, every id)."""
        return len(self._pieces)

    def pieces(self):
        """The piece of each of our (target) ids, in id order (the added start piece included)."""
        return list(self._pieces)

    def source_vocabulary(self):
        """The piece of each of our source ids, in id order: `pieces()` unless the vocabularies are separate."""
        return list(self._source_pieces)

    def id_of(self, piece, target=False):
        """Our (source, or `target`) id of `piece` (`unk_id` for a piece outside the vocabulary)."""
        return (self._target_ids if target else self._ids).get(piece, UNK_ID)

    def _numbered(self, pieces, add_start=False, add_end=True, target=False):
        """Our ids of a text's `pieces` (unk for a piece outside the vocabulary), with the start and end ids asked."""
        numbers = self._target_ids if target else self._ids
        ids = [numbers.get(piece, UNK_ID) for piece in pieces]
        return ([START_ID] if add_start else []) + ids + ([END_ID] if add_end else [])

    def _kept_pieces(self, ids, keep):
        """Per sequence of `ids` (`id_sequences`), the target pieces before its first end id whose id `keep` takes."""
        kept = []
        for sequence in id_sequences(ids):
            pieces = []
            for token in sequence:
                token = int(token)
                if token == END_ID:
                    break
                if keep(token):
                    pieces.append(self._pieces[token])
            kept.append(pieces)
        return kept

    def save(self, directory):
        """Writes the tokenizer's files (`files()`), each atomically; returns the directory (str)."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        for name, data in self._file_contents().items():
            write_bytes_atomically(os.path.join(directory, name), data)
        return directory

    @classmethod
    def _description(cls, directory, specials=None, files=None):
        """The description file's dict (`specials` when given), once `files` (default `FILES`) are there.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: the description file is not this tokenizer's.
        """
        description_file = cls.FILES[-1]
        for name in files if files is not None else cls.FILES:
            if specials is not None and name == description_file:
                continue
            if not os.path.isfile(os.path.join(directory, name)):
                raise FileNotFoundError(f"No {cls.label} tokenizer in {directory!r}: {name} is missing")
        if specials is not None:
            return specials
        path = os.path.join(directory, description_file)
        specials = read_json_file(path)
        if not isinstance(specials, dict) or specials.get("format") != cls.format:
            raise ValueError(f"{path} is not {cls.article} {cls.label} tokenizer description")
        return specials

    @classmethod
    def _loaded(cls, directory, *args, **kwargs):
        """`cls(*args, **kwargs)`, its `ValueError` naming the directory."""
        try:
            return cls(*args, **kwargs)
        except ValueError as error:
            raise ValueError(f"Cannot load the {cls.label} tokenizer in {directory}: {error}") from None
