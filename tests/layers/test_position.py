import math

import numpy as np
import pytest

from conftest import to_numpy
from keras_transformer.layers import LearnedPositionEmbedding, SinusoidalPositionEncoding


def test_sinusoids_match_the_paper_formula():
    d_model, length = 16, 50
    table = to_numpy(SinusoidalPositionEncoding(100)(np.zeros((1, length, d_model), "float32")))[0]
    expected = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(d_model // 2):
            expected[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d_model))
            expected[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    np.testing.assert_allclose(table, expected, atol=2e-5)


def test_fairseq_sinusoids_match_fairseqs_formula_from_position_two():
    """fairseq's table (NLLB-200, M2M-100): sin | cos halves, 10000^(-i / (d/2 - 1)), our position 0 is its row 2."""
    d_model, length, half = 16, 50, 8
    layer = SinusoidalPositionEncoding(100, layout="fairseq")
    table = to_numpy(layer(np.zeros((1, length, d_model), "float32")))[0]
    expected = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(half):
            angle = (pos + 2) * math.exp(-i * math.log(10000) / (half - 1))
            expected[pos, i], expected[pos, half + i] = math.sin(angle), math.cos(angle)
    np.testing.assert_allclose(table, expected, atol=2e-5)
    step = to_numpy(layer(np.zeros((1, 1, d_model), "float32"), start_index=7))[0, 0]
    np.testing.assert_allclose(step, table[7], atol=1e-6)


def test_start_index_shifts_positions():
    layer = SinusoidalPositionEncoding(100)
    full = to_numpy(layer(np.zeros((2, 10, 8), "float32")))
    step = to_numpy(layer(np.zeros((2, 1, 8), "float32"), start_index=7))
    np.testing.assert_allclose(step[:, 0], full[:, 7], atol=1e-6)


def test_learned_positions_slice_the_table():
    layer = LearnedPositionEmbedding(20)
    out = to_numpy(layer(np.zeros((3, 5, 4), "float32"), start_index=2))
    table = to_numpy(layer.position_embeddings)
    assert out.shape == (3, 5, 4)
    np.testing.assert_allclose(out[1], table[2:7])


@pytest.mark.parametrize("layer_class", [SinusoidalPositionEncoding, LearnedPositionEmbedding])
def test_too_long_input_is_a_clear_error(layer_class):
    with pytest.raises(ValueError, match="max_sequence_length=8"):
        layer_class(8)(np.zeros((1, 9, 4), "float32"))


def test_odd_hidden_size_is_rejected():
    with pytest.raises(ValueError, match="even hidden size"):
        SinusoidalPositionEncoding(8)(np.zeros((1, 3, 5), "float32"))


@pytest.mark.parametrize("layer_class", [SinusoidalPositionEncoding, LearnedPositionEmbedding])
def test_config_round_trip(layer_class):
    layer = layer_class(32)
    assert layer_class.from_config(layer.get_config()).get_config() == layer.get_config()
