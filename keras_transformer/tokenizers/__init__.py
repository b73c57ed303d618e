"""The tokenizers: ours and those of the imported checkpoints, each in our ids.

- `base.py`: `TokenizerBase` (what every tokenizer answers) and
  `RenumberedTokenizer` (an imported checkpoint's pieces renumbered to our ids);
- `sentencepiece.py`: `Tokenizer`, the paper's one shared SentencePiece
  vocabulary, `train_tokenizer`, and `load_tokenizer`, which reads any of them
  back from a preset directory;
- `marian.py`: `MarianTokenizer` (OPUS-MT checkpoints);
- `nllb.py`: `NllbTokenizer` (NLLB-200 and M2M-100 checkpoints);
- `fsmt.py`: `FsmtTokenizer` (fairseq's WMT19 checkpoints).

The names below are imported on first use, so that `keras_transformer.tokenizers.marian`
imports nothing of `sentencepiece.py`. The old paths (`keras_transformer.tokenizer`,
`tokenizer_base`, `marian_tokenizer`, `nllb_tokenizer`, `fsmt_tokenizer`) re-export these modules.
"""

import importlib

# Public name -> the module that defines it.
_EXPORTS = {
    "TokenizerBase": "keras_transformer.tokenizers.base",
    "RenumberedTokenizer": "keras_transformer.tokenizers.base",
    "Tokenizer": "keras_transformer.tokenizers.sentencepiece",
    "train_tokenizer": "keras_transformer.tokenizers.sentencepiece",
    "load_tokenizer": "keras_transformer.tokenizers.sentencepiece",
    "TOKENIZER_FILENAME": "keras_transformer.tokenizers.sentencepiece",
    "MarianTokenizer": "keras_transformer.tokenizers.marian",
    "NllbTokenizer": "keras_transformer.tokenizers.nllb",
    "FsmtTokenizer": "keras_transformer.tokenizers.fsmt",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_transformer.tokenizers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
