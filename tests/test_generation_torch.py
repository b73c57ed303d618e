"""PyTorch: the search step captured with torch.export and compiled with torch.compile.

`generation.TORCH_COMPILE_BACKEND` is opt-in; these tests use "export"
(the captured graph run as it is, without torch.compile), which checks the
capture (tokens, scores, one graph per shape, weight updates) in seconds.
`benchmarks/generate.py --torch-compile inductor` checks inductor's tokens
against the eager loop and times it (a minute of compiling per shape).
"""

import logging

import numpy as np
import pytest

from conftest import BACKEND, tiny_model, to_numpy
from keras_transformer import generation
from keras_transformer.generation import generate
from test_generation import EXTRA, LENGTHS, sources

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the PyTorch compile path")

CAPTURE = "Capturing the PyTorch"


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


@pytest.fixture
def src(rng):
    return sources(rng, LENGTHS)


@pytest.fixture
def torch_compile(monkeypatch):
    monkeypatch.setattr(generation, "TORCH_COMPILE_BACKEND", "export")


def captures(caplog):
    return sum(CAPTURE in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compiled_step_gives_the_eager_tokens_and_scores(model, src, beam_size, torch_compile, caplog):
    eager, eager_scores = generate(model, src, beam_size=beam_size, max_extra_length=EXTRA, compile=False,
                                   return_scores=True)
    with caplog.at_level(logging.INFO, logger="keras_transformer.generation"):
        for _ in range(2):  # the second call reuses the graph
            ids, scores = generate(model, src, beam_size=beam_size, max_extra_length=EXTRA, return_scores=True)
            np.testing.assert_array_equal(ids, eager)
            np.testing.assert_allclose(scores, eager_scores, rtol=1e-6, atol=1e-6)
    assert captures(caplog) == 1


def test_compiled_step_sees_new_weights(model, src, torch_compile, caplog):
    before = generate(model, src, beam_size=4, max_extra_length=EXTRA)  # compiled by the test above
    table = [w for w in model.weights if "token_embedding" in w.path][0]
    original = to_numpy(table)
    table.assign(original[::-1] * 3.0)
    try:
        with caplog.at_level(logging.INFO, logger="keras_transformer.generation"):
            after = generate(model, src, beam_size=4, max_extra_length=EXTRA)
        assert captures(caplog) == 0  # same shapes: the same graph, the new weights as its inputs
        np.testing.assert_array_equal(after, generate(model, src, beam_size=4, max_extra_length=EXTRA, compile=False))
        assert not np.array_equal(before, after)
    finally:
        table.assign(original)


def test_the_eager_loop_is_the_default(model, src, caplog):
    assert generation.TORCH_COMPILE_BACKEND is None
    with caplog.at_level(logging.INFO, logger="keras_transformer.generation"):
        generate(model, src[:1], beam_size=1, max_extra_length=EXTRA)
    assert captures(caplog) == 0


def test_a_model_without_keras_variables_runs_eagerly(model, src, torch_compile, caplog):
    from test_generation import NumpyProtocol

    expected = generate(model, src[:1], beam_size=1, max_extra_length=EXTRA, compile=False)
    with caplog.at_level(logging.INFO, logger="keras_transformer.generation"):
        ids = generate(NumpyProtocol(model), src[:1], beam_size=1, max_extra_length=EXTRA)
    np.testing.assert_array_equal(ids, expected)
    assert captures(caplog) == 0


def test_torch_compile_compiles_one_graph_per_shape(src, monkeypatch):
    """torch.compile itself (its "eager" backend: TorchDynamo without code generation) on a 1-layer model."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(generation, "TORCH_COMPILE_BACKEND", "eager")
    model = tiny_model(seed=7, num_layers=1)
    eager = generate(model, src, beam_size=1, max_extra_length=EXTRA, compile=False)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        np.testing.assert_array_equal(generate(model, src, beam_size=1, max_extra_length=EXTRA), eager)
    # One graph serves every step and call: the index is an input, the start state has the steps' strides.
    assert counters["stats"]["unique_graphs"] == graphs + 1
