"""The range check of token ids, in NumPy only (the ONNX Runtime server uses it without Keras).

`keras_transformer.checks.check_token_ids` (the Keras model and the search)
and `export.runtime` (ONNX Runtime) both call `check_id_range`, so an id
outside the vocabulary gets the same message whichever engine runs.
"""

import numpy as np


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
