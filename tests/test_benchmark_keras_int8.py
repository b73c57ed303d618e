"""The pieces of `python -m benchmarks.keras_int8` (the measurement itself is benchmarks/README.md's)."""

import numpy as np

from benchmarks import keras_int8
from conftest import tiny_model


def test_generated_tokens_count_after_the_start_id_with_the_end_id():
    ids = np.array([[2, 7, 8, 3, 0], [2, 3, 0, 0, 0], [2, 9, 9, 9, 3]], "int32")
    assert keras_int8.generated_tokens(ids, start_id=2, end_id=3) == 3 + 1 + 4


def test_batches_pad_each_batch_to_its_longest_row_in_order():
    batches = keras_int8._batches([[5, 3], [6, 7, 8, 3], [9, 3]], 2)
    assert [b.tolist() for b in batches] == [[[5, 3, 0, 0], [6, 7, 8, 3]], [[9, 3]]]
    assert all(b.dtype == np.int32 for b in batches)


def test_weight_bytes_are_a_quarter_for_int8_kernels_plus_float32_scales_and_the_rest():
    model = tiny_model()
    assert keras_int8.weight_bytes(model) == 4 * model.count_params()
    matrices = [w for w in model.weights if len(w.shape) == 2]  # the 32 kernels and the embedding
    model.quantize("int8")
    scales = sum(int(w.shape[-1]) for w in matrices[1:]) + model.vocabulary_size  # per output column; per token
    expected = 4 * (tiny_model().count_params()) - 3 * sum(int(np.prod(w.shape)) for w in matrices) + 4 * scales
    assert keras_int8.weight_bytes(model) == expected


def test_table_row_gives_times_ratios_bleu_difference_and_sizes():
    result = {
        "backend": "jax", "int8_over_float32_batch_1": 1.5, "int8_over_float32_batch_32": 0.5,
        "models": {
            "float32": {"ms_per_token_batch_1": 2.0, "ms_per_token_batch_32": 1.0, "bleu": 28.0,
                        "weight_bytes": 4 * 2**20},
            "int8": {"ms_per_token_batch_1": 3.0, "ms_per_token_batch_32": 0.5, "bleu": 27.75, "weight_bytes": 2**20},
        },
    }
    assert keras_int8.table_row(result) == (
        "| jax | 2.00 / 3.00 (1.50x) | 1.00 / 0.50 (0.50x) | 28.00 / 27.75 (-0.25) | 4.0 / 1.0 MiB |"
    )
