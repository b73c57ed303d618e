"""The special ids and the range check of token ids, in NumPy only (the ONNX Runtime server uses them without Keras).

The special ids live here, the one home every module (both tokenizers, the
model, the search, the exports) reads them from; `keras_transformer.tokenizers.sentencepiece`
re-exports them.

`keras_transformer.checks.check_token_ids` (the Keras model and the search)
and `export.runtime` (ONNX Runtime) both call `check_id_range`, so an id
outside the vocabulary gets the same message whichever engine runs.
"""

import numpy as np

# pad 0 (the model builds its masks from `ids > 0`), unk 1, start 2, end 3.
PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3
FIRST_ORDINARY_ID = 4  # the first id of an ordinary piece


def id_sequences(ids):
    """`ids` as a list of lists of int: from lists, a 2D array or tensor `[B, L]`, or one flat sequence."""
    if hasattr(ids, "shape"):  # NumPy array or backend tensor.
        ids = np.asarray(ids)
        return ids.tolist() if ids.ndim > 1 else [ids.tolist()]
    ids = list(ids)
    if not ids or not isinstance(ids[0], (list, tuple, np.ndarray)):
        ids = [ids]
    return ids


def text_list(texts):
    """The texts a tokenizer's `encode` takes, as a list of str: one str (or bytes) is a list of one; bytes are UTF-8.

    Raises:
        TypeError: an item that is not text, named.
    """
    if isinstance(texts, (str, bytes)):
        texts = [texts]
    texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in texts]
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"Expected str, received {text!r} of type {type(text).__name__}")
    return texts


def check_id_range(values, name, vocabulary_size):
    """Raises `ValueError` if an id of the NumPy integer array `values` is outside [0, vocabulary_size)."""
    if not np.size(values):
        return
    low, high = int(np.min(values)), int(np.max(values))
    if low < 0 or high >= vocabulary_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} contains token id {bad}, outside [0, {vocabulary_size}) for "
            f"vocabulary_size={vocabulary_size}. Check that the tokenizer and the model "
            "use the same vocabulary."
        )


def encoder_vocabulary_size(model):
    """The source ids a model takes: `encoder_vocabulary_size` (a source table of its own), else `vocabulary_size`."""
    return int(getattr(model, "encoder_vocabulary_size", None) or model.vocabulary_size)
