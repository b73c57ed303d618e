"""ONNX export (export/onnx.py), validation (export/validate.py) and ONNX Runtime (export/runtime.py)."""

import io
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

from conftest import TINY_VOCABULARY_SIZE, tiny_export_model, to_numpy

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="ONNX export runs on the TensorFlow backend"
)

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")

import keras_transformer as kt  # noqa: E402
from export import contract, graphs  # noqa: E402
from export import onnx as onnx_export  # noqa: E402
from export.runtime import OnnxSeq2Seq, OnnxTranslator, read_config  # noqa: E402
from export.validate import ValidationError, validate_onnx  # noqa: E402
from keras_transformer.translator import Translator  # noqa: E402

VOCABULARY_SIZE = TINY_VOCABULARY_SIZE
START, END = 2, 3
GRAPH_FILES = [f"{graph}.onnx" for graph in contract.ONNX.graphs]
small_model = tiny_export_model  # the exported preset's model (seed 1234), or another seed's


def sources(rng, lengths):
    """Rows of `tokens + [end]` with the given lengths (end included), 0-padded."""
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = rng.integers(4, VOCABULARY_SIZE, n - 1)
        ids[row, n - 1] = END
    return ids


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def preset_dir(tiny_preset_dir):
    return tiny_preset_dir


@pytest.fixture(scope="module")
def exported(tiny_onnx_export):
    return tiny_onnx_export


@pytest.fixture(scope="module")
def onnx_model(exported):
    return OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])


def copy_of(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    return copy


# --------------------------------------------------------------------------- #
# The exported directory
# --------------------------------------------------------------------------- #
def test_export_writes_a_self_contained_directory(exported, preset_dir):
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        GRAPH_FILES + ["config.json", "tokenizer.model", "weights.bin"]
    )
    assert (exported / "tokenizer.model").read_bytes() == (preset_dir / "tokenizer.model").read_bytes()
    config = json.loads((exported / "config.json").read_text())
    assert (config["format"], config["format_version"]) == ("keras_transformer.onnx", 9)
    assert config["opset"] == onnx_export.DEFAULT_OPSET == 17
    assert config["quantization"] is None
    assert (config["pad_id"], config["unk_id"], config["start_id"], config["end_id"]) == (0, 1, 2, 3)
    assert (config["vocabulary_size"], config["hidden_dim"], config["num_decoder_layers"]) == (60, 16, 2)
    assert (config["num_heads"], config["head_key_dim"], config["head_value_dim"]) == (4, 4, 4)
    assert set(config["versions"]) >= {"keras_transformer", "keras", "tensorflow", "tf2onnx", "onnx"}
    assert config["versions"]["keras_transformer"] == kt.__version__
    # Written next to its place and renamed: no staging directory is left.
    assert [p.name for p in exported.parent.iterdir()] == ["model"]


def test_graphs_are_the_contract_table(exported):
    """Each graph's inputs and outputs, in order: the contract's names, dtypes, dynamic axes and sizes."""
    import onnx

    config = read_config(exported)
    assert config["graphs"] == {name: f"{name}.onnx" for name in contract.ONNX.graphs}
    for name, graph in contract.ONNX.graphs.items():
        graph = graph.expand(config["num_decoder_layers"])  # fused_decoder_step: tensors per layer
        proto = onnx.load(str(exported / config["graphs"][name]), load_external_data=False)
        assert proto.opset_import[0].version == 17
        for values, tensors in ((proto.graph.input, graph.inputs), (proto.graph.output, graph.outputs)):
            actual = [
                (
                    value.name,
                    onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name,
                    # Dynamic axes have a symbolic name, fixed ones a value.
                    [None if dim.HasField("dim_param") else dim.dim_value for dim in value.type.tensor_type.shape.dim],
                )
                for value in values
            ]
            expected = [(t.name, contract.dtype(t, "float32"), contract.shape(t, config)) for t in tensors]
            if values is proto.graph.output:  # tf2onnx orders dict outputs alphabetically.
                expected.sort()
            assert actual == expected, name


def test_encoder_init_cache_and_decoder_steps_match_keras(model, onnx_model):
    """Shapes other than validation's; the ORT cache is fed back for 5 steps."""
    rng = np.random.default_rng(7)
    for lengths, max_length in (([2], 6), ([9, 4, 13, 1], 5), ([30, 17], 9)):
        src = sources(rng, lengths)
        expected = to_numpy(model.encode(src))
        outputs = onnx_model.encode(src)
        assert outputs.shape == expected.shape == (len(lengths), max(lengths), 16)
        np.testing.assert_allclose(outputs, expected, atol=1e-4, rtol=0)

        keras_cache = model.init_cache(expected, src, max_length)
        cache = onnx_model.init_cache(expected, src, max_length)
        assert sorted(cache) == sorted(keras_cache)
        for name in cache:
            np.testing.assert_allclose(cache[name], to_numpy(keras_cache[name]), atol=1e-5, rtol=0)
        tokens = np.full((len(lengths),), START, np.int32)
        for step in range(5):
            keras_logits, keras_cache = model.decode_step(tokens, step, keras_cache)
            logits, cache = onnx_model.decode_step(tokens, step, cache)
            assert logits.shape == (len(lengths), VOCABULARY_SIZE) and logits.dtype == np.float32
            np.testing.assert_allclose(logits, to_numpy(keras_logits), atol=1e-4, rtol=0)
            np.testing.assert_allclose(cache["self_key"], to_numpy(keras_cache["self_key"]), atol=1e-4, rtol=0)
            tokens = rng.integers(4, VOCABULARY_SIZE, len(lengths)).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 3, 4])
def test_generate_gives_the_same_tokens_as_keras_in_one_call(model, exported, beam_size, monkeypatch):
    """driver="whole": the whole search is one ONNX Runtime call (one beam_search graph for every beam size)."""
    from keras_transformer import generation

    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], driver="whole")
    src = sources(np.random.default_rng(3), [7, 2, 11, 5])
    expected, expected_scores = generation.generate(
        model, src, beam_size=beam_size, max_extra_length=6, return_scores=True
    )
    graph = "greedy_search" if beam_size == 1 else "beam_search"
    session = onnx_model._session(graph)
    calls = []

    class Counting:
        def run(self, *args, **kwargs):
            calls.append(args)
            return session.run(*args, **kwargs)

    monkeypatch.setitem(onnx_model._sessions, graph, Counting())
    ids, scores = onnx_model.generate(src, beam_size=beam_size, max_extra_length=6, return_scores=True)
    assert len(calls) == 1
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-4, rtol=0)


def _recording_steps(monkeypatch):
    """Records (sources, cache rows, self-attention cache length) of every fused decoder step."""
    from export import steps

    calls = []
    step = steps.FusedDecoder.step

    def recording(self, token_ids, index):
        logits = step(self, token_ids, index)
        cache = self.cache["self_key_0"]
        calls.append((self.indirection.shape[0], cache.shape[0], cache.shape[2]))
        assert len(token_ids) == cache.shape[0] == logits.shape[0]
        return logits

    monkeypatch.setattr(steps.FusedDecoder, "step", recording)
    return calls


def test_the_first_cache_holds_what_fits_in_its_budget(exported, monkeypatch):
    """The self-attention cache starts as long as `FIRST_CACHE_BYTES` allow (a small batch: the whole buffer,
    never grown); past the budget it starts at `INITIAL_CACHE_LENGTH` positions and grows, same tokens."""
    from export import steps

    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    src = sources(np.random.default_rng(3), [9, 4])
    calls = _recording_steps(monkeypatch)
    expected = onnx_model.generate(src, beam_size=2, max_extra_length=12)
    lengths = {length for _, _, length in calls}
    assert len(lengths) == 1 and lengths.pop() >= len(calls) > 2  # one buffer from the first step
    calls.clear()
    monkeypatch.setattr(steps, "FIRST_CACHE_BYTES", 1)
    monkeypatch.setattr(steps, "INITIAL_CACHE_LENGTH", 2)
    np.testing.assert_array_equal(onnx_model.generate(src, beam_size=2, max_extra_length=12), expected)
    assert calls[0][2] == 2 and len({length for _, _, length in calls}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 4])
def test_the_update_graph_runs_into_bound_buffers_with_the_plain_runs_results(exported, beam_size, monkeypatch):
    """The step driver's update writes into two sets of bound buffers that take turns; it runs the plain way
    only at the first step and when rows leave, and gives the plain runs' tokens and scores."""
    from export import steps

    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    src = sources(np.random.default_rng(10), [3, 20, 7, 12])
    runs = {"plain": 0, "all": 0}

    class Counting(steps.BoundUpdate):
        def __init__(self, session, graph, plain):
            def counted(feeds):
                runs["plain"] += 1
                return plain(feeds)

            super().__init__(session, graph, counted)

        def __call__(self, feeds):
            runs["all"] += 1
            return super().__call__(feeds)

    monkeypatch.setattr(steps, "BoundUpdate", Counting)
    monkeypatch.setattr(steps, "INITIAL_CACHE_LENGTH", 2)  # the cache grows: the logits stay bound
    monkeypatch.setattr(steps, "FIRST_CACHE_BYTES", 0)
    ids, scores = onnx_model.generate(src, beam_size=beam_size, max_extra_length=8, return_scores=True)
    assert runs["all"] > 10 and 1 <= runs["plain"] <= 1 + len(src)  # the first step, then once per departure
    monkeypatch.setattr(steps, "BoundUpdate", lambda session, graph, plain: plain)
    plain_ids, plain_scores = onnx_model.generate(src, beam_size=beam_size, max_extra_length=8, return_scores=True)
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_array_equal(scores, plain_scores)


def test_rows_that_leave_are_filled_from_the_tail_in_place():
    """`fill_holes`: the live rows, those among the first n where they are, the holes taken by later live rows;
    the buffers move only those rows, in place, and only the positions written so far."""
    from export import steps

    live = np.array([True, False, True, True, False, True, False, True])
    kept = steps.fill_holes(live)
    np.testing.assert_array_equal(kept, [0, 5, 2, 3, 7])
    np.testing.assert_array_equal(steps.beam_rows(kept[:2], 3), [0, 1, 2, 15, 16, 17])
    np.testing.assert_array_equal(steps.fill_holes(np.ones(3, bool)), [0, 1, 2])
    assert len(steps.fill_holes(np.zeros(3, bool))) == 0
    cache = np.arange(8 * 2 * 4 * 1, dtype=np.float32).reshape(8, 2, 4, 1)
    before = cache.copy()
    kept_cache = steps._fill_holes(cache, kept, positions=3)
    assert np.shares_memory(kept_cache, cache) and kept_cache.shape == (5, 2, 4, 1)
    np.testing.assert_array_equal(kept_cache[:, :, :3], before[kept][:, :, :3])
    np.testing.assert_array_equal(kept_cache[1, :, 3:], before[1, :, 3:])  # positions not written yet: untouched
    np.testing.assert_array_equal(cache[5:], before[5:])  # the rows after the first n are left as they were


def test_the_start_graph_runs_on_groups_of_similar_lengths():
    """`start_groups`: sorted lengths cut where padding to the bucketed longest would waste more than the slack;
    equal lengths stay one group. `merge_start_outputs` pads each group's dynamic axes and concatenates."""
    from export import steps

    assert [(g.start, g.stop) for g in steps.start_groups(np.array([2, 3, 6, 8, 14, 25]))] == [(0, 5), (5, 6)]
    assert [(g.start, g.stop) for g in steps.start_groups(np.full(64, 5))] == [(0, 64)]
    lengths = np.sort(np.random.default_rng(0).integers(3, 63, 64))
    groups = steps.start_groups(lengths)
    assert len(groups) > 2 and [g.start for g in groups[1:]] == [g.stop for g in groups[:-1]]
    assert groups[0].start == 0 and groups[-1].stop == 64
    graph = contract.ONNX.graphs["beam_start"]
    first = {t.name: np.ones([2 if a in ("batch", "beam_rows") else 3 for a in t.axes], dtype=bool if t.name
                             == "encoder_padding_mask" else np.float32) for t in graph.outputs}
    second = {t.name: np.ones([1 if a in ("batch", "beam_rows") else 5 for a in t.axes], dtype=first[t.name].dtype)
              for t in graph.outputs}
    first["buffer_length"], second["buffer_length"] = np.int32(16), np.int32(24)
    merged = steps.merge_start_outputs(graph, [first, second])
    assert int(merged["buffer_length"]) == 24
    mask = merged["encoder_padding_mask"]
    assert mask.shape == (3, 5) and mask[:2, 3:].sum() == 0 and mask[:2, :3].all() and mask[2].all()
    assert merged["cross_key"].shape[:1] == (3,) and merged["cross_key"][0, 0, 0, 4, 0] == 0


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_batch_of_mixed_lengths_starts_in_groups_with_one_calls_hypotheses(exported, beam_size, monkeypatch):
    """The step driver runs the start graph per group of similar lengths (sorted), and puts the rows back: the
    same hypotheses as one start call for the whole batch."""
    from export import steps

    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    src = sources(np.random.default_rng(4), [3, 40, 6, 2, 30, 8, 45, 5])
    arguments = dict(beam_size=beam_size, num_hypotheses=min(beam_size, 2), max_extra_length=8)
    starts, merge = [], steps.merge_start_outputs
    monkeypatch.setattr(steps, "merge_start_outputs", lambda graph, outputs: starts.append(len(outputs)) or merge(
        graph, outputs))
    grouped = onnx_model.generate_hypotheses(src, **arguments)
    monkeypatch.setattr(steps, "START_PADDING_TOKENS", 10**9)
    single = onnx_model.generate_hypotheses(src, **arguments)
    assert starts[0] > 1 and starts[1] == 1  # start graph calls
    np.testing.assert_array_equal(grouped.sequences, single.sequences)
    np.testing.assert_array_equal(grouped.scores, single.scores)
    np.testing.assert_array_equal(grouped.log_probs, single.log_probs)


@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 4])
def test_rows_that_are_done_leave_the_batch_and_the_cache_grows(model, exported, beam_size, monkeypatch):
    """The step driver: rows of very different lengths leave as they are done, the cache doubles from 2
    positions to the buffer, and the tokens and scores are Keras' and the whole-search graph's."""
    from export import steps
    from keras_transformer import generation

    monkeypatch.setattr(steps, "INITIAL_CACHE_LENGTH", 2)
    monkeypatch.setattr(steps, "FIRST_CACHE_BYTES", 0)
    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    whole = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], driver="whole")
    src = sources(np.random.default_rng(8), [2, 30, 5, 17, 3, 9])
    expected, expected_scores = generation.generate(
        model, src, beam_size=beam_size, max_extra_length=12, return_scores=True
    )
    calls = _recording_steps(monkeypatch)
    ids, scores = onnx_model.generate(src, beam_size=beam_size, max_extra_length=12, return_scores=True)
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-4, rtol=0)
    whole_ids, whole_scores = whole.generate(src, beam_size=beam_size, max_extra_length=12, return_scores=True)
    np.testing.assert_array_equal(ids, whole_ids)
    np.testing.assert_allclose(scores, whole_scores, atol=1e-5, rtol=0)
    rows = [batch for batch, _, _ in calls]
    # Rows leave as they are done (never come back); the longest source's row runs to the end.
    assert rows[0] == len(src) and rows[-1] < len(src) and rows == sorted(rows, reverse=True)
    assert all(cache_rows == batch * beam_size for batch, cache_rows, _ in calls)
    # The buffer of the longest row (30 + 12 tokens and the start id, rounded up to 8) is 48 positions.
    lengths = [length for _, _, length in calls]
    assert sorted(set(lengths)) == [2, 4, 8, 16, 32, 48] and lengths == sorted(lengths)
    # The cache grows only when the step's index reaches it: the index is the call's number.
    assert all(index < length for index, length in enumerate(lengths))
    assert len(calls) < 48


@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments",
    [
        dict(beam_size=4, num_hypotheses=3, target_prefix=[[7, 8], None, [11], None, None, [5, 6, 7]]),
        dict(beam_size=1, num_hypotheses=3, sampling_topk=10, sampling_temperature=0.8, seed=2,
             target_prefix=[None, [9], None, None, None, None]),
    ],
    ids=["n-best-prefix", "samples-prefix"],
)
def test_rows_leaving_the_batch_give_the_whole_search_hypotheses(model, exported, arguments, monkeypatch):
    """n-best with prefixes and seeded samples: the step driver's hypotheses equal the whole-search graph's and
    Keras'."""
    from export import steps
    from keras_transformer.generation import generate_hypotheses

    monkeypatch.setattr(steps, "INITIAL_CACHE_LENGTH", 4)
    monkeypatch.setattr(steps, "FIRST_CACHE_BYTES", 0)
    onnx_model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    whole = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], driver="whole")
    src = sources(np.random.default_rng(9), [3, 25, 6, 2, 14, 8])
    calls = _recording_steps(monkeypatch)
    found = onnx_model.generate_hypotheses(src, max_extra_length=8, **arguments)
    assert calls[-1][0] < calls[0][0]
    for expected in (whole.generate_hypotheses(src, max_extra_length=8, **arguments),
                     generate_hypotheses(model, src, max_extra_length=8, **arguments)):
        np.testing.assert_array_equal(found.sequences, expected.sequences)
        np.testing.assert_allclose(found.scores, expected.scores, atol=1e-4, rtol=0)
        np.testing.assert_allclose(found.log_probs, expected.log_probs, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("num_hypotheses", [1, 2])
def test_patience_stops_rows_sooner_with_keras_hypotheses(tiny_trained, num_hypotheses, monkeypatch):
    """`patience=1` (CTranslate2's rule) on the trained tiny model and the bundled sentences: the step driver,
    the whole-search graph and Keras give the same hypotheses, in fewer decoder steps than the exact search."""
    import keras_transformer as kt
    from keras_transformer.generation import generate, generate_hypotheses

    onnx_model = OnnxSeq2Seq(tiny_trained / "onnx", providers=["CPUExecutionProvider"])
    whole = OnnxSeq2Seq(tiny_trained / "onnx", providers=["CPUExecutionProvider"], driver="whole")
    model = kt.TransformerModel.from_preset(tiny_trained / "preset")
    lines = (tiny_trained / "valid.en").read_text(encoding="utf-8").splitlines()[:8]
    encoded = OnnxTranslator(tiny_trained / "onnx").encode(lines)
    src = np.zeros((len(encoded), max(map(len, encoded))), np.int32)
    for row, ids in enumerate(encoded):
        src[row, : len(ids)] = ids
    arguments = dict(beam_size=4, num_hypotheses=num_hypotheses)
    calls = _recording_steps(monkeypatch)
    onnx_model.generate_hypotheses(src, **arguments)
    exact_rows = sum(rows for _, rows, _ in calls)
    calls.clear()
    found = onnx_model.generate_hypotheses(src, patience=1, **arguments)
    assert sum(rows for _, rows, _ in calls) < exact_rows
    for expected in (whole.generate_hypotheses(src, patience=1, **arguments),
                     generate_hypotheses(model, src, patience=1, **arguments)):
        np.testing.assert_array_equal(found.sequences, expected.sequences)
        np.testing.assert_allclose(found.scores, expected.scores, atol=1e-4, rtol=0)
        np.testing.assert_allclose(found.log_probs, expected.log_probs, atol=1e-4, rtol=0)
    if num_hypotheses == 1:  # `generate` with a patience gives this search's best
        expected = generate(model, src, beam_size=4, patience=1)
        np.testing.assert_array_equal(expected[:, : found.sequences.shape[2]], found.sequences[:, 0])
        for runtime in (onnx_model, whole):
            np.testing.assert_array_equal(runtime.generate(src, beam_size=4, patience=1), expected)


def test_an_unknown_driver_is_refused_and_the_cpu_steps(exported, onnx_model):
    assert onnx_model.driver == "steps"
    with pytest.raises(ValueError, match=r"driver='loop' must be one of \('steps', 'whole'\) or None"):
        OnnxSeq2Seq(exported, driver="loop")


def test_models_the_fused_step_does_not_cover_are_named_and_served_by_the_whole_search(exported, tmp_path):
    """No fused step (pre-LN below opset 17, a window, ...): the export has no step driver graphs and the server runs the
    whole-search graphs; asking for the step driver says why it cannot."""
    from export.fused_step import NotFusable, fused_step_weights
    from keras_transformer.model import TransformerModel

    model = TransformerModel(
        vocabulary_size=60, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, normalize_first=True,
        attention_window=3,
    )
    with pytest.raises(NotFusable, match=r"does not cover this model: it has attention_window=3$"):
        fused_step_weights(model)
    with pytest.raises(NotFusable, match=r"it has pre-LN \(normalize_first=True\) at opset 16 .*attention_window=3"):
        fused_step_weights(model, opset=16)
    copy = copy_of(exported, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    for name in contract.STEP_DRIVER_GRAPHS:
        (copy / config["graphs"].pop(name)).unlink()
    (copy / "config.json").write_text(json.dumps(config))
    whole = OnnxSeq2Seq(copy, providers=["CPUExecutionProvider"])
    assert whole.driver == "whole"
    src = sources(np.random.default_rng(4), [5, 2])
    np.testing.assert_array_equal(
        whole.generate(src, beam_size=3, max_extra_length=4),
        OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"]).generate(src, beam_size=3, max_extra_length=4),
    )
    with pytest.raises(ValueError, match=r"has no fused decoder step .* use driver='whole' or None"):
        OnnxSeq2Seq(copy, driver="steps")


def test_generate_handles_an_empty_batch_and_bad_arguments(onnx_model):
    ids, scores = onnx_model.generate(np.zeros((0, 4), np.int32), return_scores=True)
    assert ids.shape == (0, 0) and scores.shape == (0,)
    with pytest.raises(ValueError, match=r"beam_size=0 must be an integer >= 1"):
        onnx_model.generate(np.array([[5, 3]]), beam_size=0)
    with pytest.raises(ValueError, match=r"length_penalty=-1 must be a finite number >= 0"):
        onnx_model.generate(np.array([[5, 3]]), length_penalty=-1)


def test_validation_checks_the_exported_search(model, exported, tmp_path, monkeypatch):
    """A search graph that differs from generation.search_graph fails the validation, named.

    One graph converted wrong, in a copy of the shared export (not a whole export): that the
    export runs this validation and leaves no directory when it fails is
    test_a_failed_validation_leaves_no_directory's proof.
    """
    from keras_transformer import generation

    def longer(model, search_name):
        search = generation.search_graph(model, search_name)
        return lambda ids, beam_size, alpha, max_extra_length: search(ids, beam_size, alpha, max_extra_length + 1)

    monkeypatch.setattr(graphs, "search_graph", longer)
    wrong = copy_of(exported, tmp_path)
    ((function, signature),) = graphs.graph_functions(model, ["greedy_search"]).values()
    onnx_export._convert(function, signature, read_config(wrong)["opset"], wrong / "greedy_search.onnx")
    with pytest.raises(ValidationError, match=r"greedy_search\.onnx output (sequences|scores)"):
        validate_onnx(wrong, model)


def test_weights_are_stored_once_for_all_graphs(exported, model):
    """Five graphs read the model's weights; weights.bin holds each tensor once."""
    import onnx

    from export.onnx import _graphs

    references = {}  # (offset, length) -> graphs reading it
    for name in GRAPH_FILES:
        proto = onnx.load(str(exported / name), load_external_data=False)
        for graph in _graphs(proto.graph):
            for tensor in graph.initializer:
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    entry = {item.key: item.value for item in tensor.external_data}
                    assert entry["location"] == "weights.bin"
                    references.setdefault((int(entry["offset"]), int(entry["length"])), set()).add(name)
    end = max(offset + length for offset, length in references)
    assert (exported / "weights.bin").stat().st_size == end
    assert sum(length for _, length in references) <= end < sum(length for _, length in references) + 64 * len(references)
    # The shared embedding matrix is read by the encoder, the decoder step and both searches.
    embedding_bytes = 4 * model.vocabulary_size * model.hidden_dim
    readers = [graphs for (_, length), graphs in references.items() if length == embedding_bytes]
    assert any({"encoder.onnx", "decoder_step.onnx", "beam_search.onnx", "greedy_search.onnx"} <= r for r in readers)


def test_layer_norms_are_one_onnx_op(exported):
    """TensorFlow's 13-node layer norm becomes ONNX's LayerNormalization, in the Loop body too."""
    import onnx

    from export.onnx import _graphs

    # 2 encoder layers x 2 norms; 2 decoder layers x 3 norms.
    for graph, expected in (("encoder", 4), ("decoder_step", 6), ("beam_search", 10), ("greedy_search", 10)):
        proto = onnx.load(str(exported / f"{graph}.onnx"))
        op_types = [node.op_type for inner in _graphs(proto.graph) for node in inner.node]
        assert op_types.count("LayerNormalization") == expected, graph
        assert "GlobalAveragePool" not in op_types and "Reciprocal" not in op_types, graph


def test_search_graphs_carry_no_weights_through_the_loop(exported):
    """The Loop reads the weights from the outer graph (initializers: pre-packed, quantizable)."""
    import onnx

    for graph in ("greedy_search", "beam_search", "beam_hypotheses", "sample_search"):
        proto = onnx.load(str(exported / f"{graph}.onnx"))
        (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
        body = loop.attribute[0].g
        carried = len(loop.input) - 2
        # No loop-carried value is passed through unchanged ...
        assert all(body.input[2 + j].name != body.output[1 + j].name for j in range(carried)), graph
        # ... and every matrix product of the decoder reads its kernel from an outer initializer.
        initializers = {tensor.name for tensor in proto.graph.initializer}
        kernels = [node.input[1] for node in body.node if node.op_type == "MatMul" and node.input[1] in initializers]
        assert len(kernels) >= 2 * 8, (graph, len(kernels))  # 2 decoder layers: q, k, v, out, q, out, ffn x2


def test_io_binding_path_gives_the_same_steps(exported, onnx_model):
    """The CUDA path of the protocol methods (I/O binding, device-resident cache reuse) run on the CPU."""
    bound = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], use_io_binding=True)
    src = sources(np.random.default_rng(4), [6, 3])
    caches = [m.init_cache(m.encode(src), src, 4) for m in (bound, onnx_model)]
    tokens = np.full((2,), START, np.int32)
    for step in range(3):
        (bound_logits, caches[0]), (logits, caches[1]) = (
            m.decode_step(tokens, step, cache) for m, cache in zip((bound, onnx_model), caches)
        )
        np.testing.assert_array_equal(bound_logits, logits)
        tokens = np.argmax(logits, axis=-1).astype(np.int32)
    # Outputs handed out are read-only, so reuse by identity is safe.
    assert not caches[0]["cross_key"].flags.writeable


@pytest.mark.slow
def test_translator_gives_the_same_text_as_the_keras_translator(exported, preset_dir):
    texts = ["the cat sees a dog.", "", "a red ball.", "my bird eats the big fish.", "the old fish likes the cat."]
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    assert isinstance(translator, Translator) and isinstance(translator.model, OnnxSeq2Seq)
    translations = translator.translate(texts, beam_size=2, max_extra_length=5, batch_size=3)
    expected = Translator.from_preset(preset_dir).translate(texts, beam_size=2, max_extra_length=5, batch_size=3)
    assert translations == expected and translations[1] == ""
    # Documents (split_sentences): the same sentences, the same answers, rebuilt alike.
    documents = ["the cat sees a dog. a red ball!\n\nmy bird eats the big fish.", "  the old fish likes the cat.  "]
    search = dict(beam_size=2, max_extra_length=5, batch_size=3, split_sentences=True)
    assert translator.translate(documents, **search) == Translator.from_preset(preset_dir).translate(documents, **search)


def test_runtime_cli_translates_stdin_line_by_line(exported, monkeypatch, capsys):
    from export import runtime

    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sees a dog.\n\na red ball.\n"))
    assert runtime.main(["--model", str(exported), "--beam-size", "1"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


def test_optimized_cache_loads_the_optimised_graph_without_optimising_again(exported, onnx_model, tmp_path,
                                                                             monkeypatch, caplog):
    import onnxruntime as ort

    cache = tmp_path / "cache"
    ids = sources(np.random.default_rng(0), [4, 2])
    expected = onnx_model.generate(ids, beam_size=2, max_extra_length=6)
    opened = []
    real_session = ort.InferenceSession

    def recording(path, options=None, **kwargs):
        opened.append((pathlib.Path(path), options.graph_optimization_level))
        return real_session(path, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    first = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], optimized_cache=cache)
    np.testing.assert_array_equal(first.generate(ids, beam_size=2, max_extra_length=6), expected)
    cached = first._optimized_path("beam_update")
    assert cached.is_file() and exported / first.config["graphs"]["beam_update"] in [path for path, _ in opened]
    assert not list(cache.glob(".*"))  # no temporary graph left behind
    before = len(opened)
    second = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], optimized_cache=cache)
    np.testing.assert_array_equal(second.generate(ids, beam_size=2, max_extra_length=6), expected)
    assert (cached, ort.GraphOptimizationLevel.ORT_DISABLE_ALL) in opened[before:]
    # A damaged copy is optimised again from the export, with a warning.
    cached.write_bytes(b"not a graph")
    third = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"], optimized_cache=cache)
    np.testing.assert_array_equal(third.generate(ids, beam_size=2, max_extra_length=6), expected)
    assert "optimising beam_update again" in caplog.text
    with pytest.raises(ValueError, match="optimized_cache works with the default session options"):
        OnnxSeq2Seq(exported, session_options=ort.SessionOptions(), optimized_cache=cache)



def test_optimized_cache_never_loads_a_copy_of_an_older_export_and_removes_it(exported, onnx_model, tmp_path,
                                                                               monkeypatch):
    """A graph file written again (a new export in the same place) is optimised afresh; its old copies go."""
    import onnxruntime as ort

    export, cache = copy_of(exported, tmp_path), tmp_path / "cache"
    ids = sources(np.random.default_rng(1), [5, 3])
    expected = onnx_model.generate(ids, beam_size=2, max_extra_length=5)
    first = OnnxSeq2Seq(export, providers=["CPUExecutionProvider"], optimized_cache=cache)
    first.generate(ids, beam_size=2, max_extra_length=5)
    stale = first._optimized_path("beam_start")
    stale_weights = sorted(cache.glob(f"{stale.stem}.*.weights"))
    assert stale.is_file() and stale_weights
    graph = export / first.config["graphs"]["beam_start"]
    graph.write_bytes(graph.read_bytes())  # the same graph, written again: a new modification time
    os.utime(graph, ns=(graph.stat().st_atime_ns, graph.stat().st_mtime_ns + 10**9))
    opened = []
    real_session = ort.InferenceSession

    def recording(path, options=None, **kwargs):
        opened.append(pathlib.Path(path))
        return real_session(path, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    second = OnnxSeq2Seq(export, providers=["CPUExecutionProvider"], optimized_cache=cache)
    fresh = second._optimized_path("beam_start")
    # Another onnxruntime's copy of the same files stays.
    other_runtime = fresh.with_name(f"{fresh.stem.rsplit('-', 1)[0]}-000000000000.onnx")
    other_runtime.write_bytes(b"another onnxruntime's copy")
    np.testing.assert_array_equal(second.generate(ids, beam_size=2, max_extra_length=5), expected)
    assert graph in opened and stale not in opened
    assert fresh != stale and fresh.is_file() and other_runtime.is_file()
    assert not stale.exists() and not any(path.exists() for path in stale_weights)
    # The other graphs' copies were still current: loaded, not optimised again.
    assert second._optimized_path("beam_update") in opened
    assert export / first.config["graphs"]["beam_update"] not in opened


def test_runtime_cli_keeps_optimised_graphs_in_the_user_cache_unless_told_not_to(exported, tmp_path, monkeypatch,
                                                                                  capsys, caplog):
    from export import runtime

    export = copy_of(exported, tmp_path)
    before = sorted(path.name for path in export.iterdir())
    monkeypatch.setenv("KERAS_TRANSFORMER_CACHE", str(tmp_path / "user-cache"))
    assert runtime.default_optimized_cache() == tmp_path / "user-cache" / "onnxruntime"
    monkeypatch.delenv("KERAS_TRANSFORMER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.default_optimized_cache() == tmp_path / "xdg" / "keras_transformer" / "onnxruntime"
    search = ["--beam-size", "2", "--max-extra-length", "4"]
    outputs = []
    for options in ([], ["--no-optimized-cache"], ["--optimized-cache", str(tmp_path / "mine")]):
        monkeypatch.setattr("sys.stdin", io.StringIO("the cat sees a dog.\na red ball.\n"))
        assert runtime.main(["--model", str(export), *search, *options]) == 0
        outputs.append(capsys.readouterr().out)
        if not options:
            cached = sorted(path.name for path in (tmp_path / "xdg" / "keras_transformer" / "onnxruntime").iterdir())
            assert {name.split("-")[0] for name in cached} == {"beam_start", "fused_decoder_step", "beam_update"}
        elif options == ["--no-optimized-cache"]:
            assert sorted(path.name for path in (tmp_path / "xdg" / "keras_transformer" / "onnxruntime").iterdir()) \
                == cached
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("\n") == 2
    assert len(list((tmp_path / "mine").glob("*.onnx"))) == 3
    assert sorted(path.name for path in export.iterdir()) == before  # the export directory is never written
    # A cache that cannot be created: one warning, the same translations.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sees a dog.\na red ball.\n"))
    with caplog.at_level(logging.WARNING, logger="export.runtime"):
        assert runtime.main(["--model", str(export), *search, "--optimized-cache", str(tmp_path / "a-file")]) == 0
    assert capsys.readouterr().out == outputs[0]
    assert [r.getMessage() for r in caplog.records if "optimised-graph cache" in r.getMessage()] == [
        f"Cannot create the optimised-graph cache {tmp_path / 'a-file'} ([Errno 17] File exists: "
        f"'{tmp_path / 'a-file'}'); optimising without it"]

# --------------------------------------------------------------------------- #
# Scores and files on ONNX Runtime (Translator.score, translate_file)
# --------------------------------------------------------------------------- #
SCORED_SOURCES = ["the cat sees a dog.", "a red ball.", "my bird eats the big fish.", "the old fish likes the cat."]
SCORED_TARGETS = ["a dog sees the cat.", "", "the big fish.", "my bird likes a red ball. the cat eats the fish."]


def _numpy_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_scores_agree_between_keras_onnx_runtime_and_numpy(model, exported, preset_dir):
    keras_scores = Translator.from_preset(preset_dir).score(SCORED_SOURCES, SCORED_TARGETS, batch_size=3)
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    onnx_scores = translator.score(SCORED_SOURCES, SCORED_TARGETS, batch_size=3)
    for ours, theirs in zip(onnx_scores, keras_scores):
        assert ours.token_ids == theirs.token_ids
        assert ours.log_prob == pytest.approx(theirs.log_prob, abs=1e-4)
        np.testing.assert_allclose(ours.token_log_probs, theirs.token_log_probs, atol=1e-4)
    # A NumPy log-softmax of the full (uncached) Keras model's logits, teacher forced.
    for source, score in zip(translator.encode(SCORED_SOURCES), onnx_scores):
        target = np.array([[START] + score.token_ids], np.int32)
        inputs = {"encoder_token_ids": np.array([source], np.int32), "decoder_token_ids": target[:, :-1]}
        logits = to_numpy(model(inputs))
        expected = np.take_along_axis(_numpy_log_softmax(logits[0]), target[0, 1:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(score.token_log_probs, expected, atol=1e-4)
        assert score.log_prob == pytest.approx(expected.sum(), abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 0.6])
def test_scoring_the_greedy_graphs_output_gives_its_own_log_probability(onnx_model, length_penalty):
    from keras_transformer.search.scoring import score_targets

    src = sources(np.random.default_rng(11), [6, 3, 9, 2])
    ids, scores = onnx_model.generate(src, beam_size=1, length_penalty=length_penalty, max_extra_length=5,
                                      return_scores=True)
    log_probs, _ = score_targets(onnx_model, src, ids)
    lengths = (ids[:, 1:] != 0).sum(axis=1)
    np.testing.assert_allclose(log_probs / ((5.0 + lengths) / 6.0) ** length_penalty, scores, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- #
# n-best, target prefixes and sampling: the same numbers as Keras
# --------------------------------------------------------------------------- #
def test_an_export_of_format_8_is_refused_with_export_again(exported, tmp_path):
    copy = copy_of(exported, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["format_version"] = 8
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version 8; this version of export.runtime reads .* version 9. Export the"):
        OnnxTranslator(copy)


@pytest.mark.parametrize(
    "arguments",
    [
        dict(beam_size=4, num_hypotheses=3),
        dict(beam_size=3, num_hypotheses=2, target_prefix=[[7, 8, 9], None, [11], None]),
        dict(beam_size=1, target_prefix=[None, [5], None, [6, 6]]),
        dict(beam_size=1, num_hypotheses=3, sampling_topk=0, seed=4, target_prefix=[[9], None, None, None]),
        dict(beam_size=1, num_hypotheses=2, sampling_topk=10, sampling_topp=0.8, sampling_temperature=0.7, seed=1),
    ],
    ids=["n-best", "n-best-prefix", "greedy-prefix", "samples-prefix", "samples-cut"],
)
def test_generate_hypotheses_gives_keras_tokens_scores_and_log_probs(model, onnx_model, arguments):
    from keras_transformer.generation import generate_hypotheses
    from keras_transformer.search.scoring import score_targets

    src = sources(np.random.default_rng(5), [7, 2, 11, 5])
    expected = generate_hypotheses(model, src, max_extra_length=6, **arguments)
    found = onnx_model.generate_hypotheses(src, max_extra_length=6, **arguments)
    np.testing.assert_array_equal(found.sequences, expected.sequences)
    np.testing.assert_allclose(found.scores, expected.scores, atol=1e-4, rtol=0)
    np.testing.assert_allclose(found.log_probs, expected.log_probs, atol=1e-4, rtol=0)
    # A NumPy recomputation from the graphs' logits (teacher forced) gives the same log-probabilities.
    batch, count, length = found.sequences.shape
    log_probs, _ = score_targets(onnx_model, np.repeat(src, count, axis=0), found.sequences.reshape((-1, length)))
    np.testing.assert_allclose(found.log_probs.reshape(-1), log_probs, atol=1e-4, rtol=0)
    for row, prefix in enumerate(arguments.get("target_prefix") or [None] * batch):
        if prefix:
            assert (found.sequences[row, :, 1: 1 + len(prefix)] == prefix).all()


def test_sampling_with_top_k_1_is_greedy_and_a_seed_reproduces(onnx_model):
    src = sources(np.random.default_rng(6), [4, 9, 6])
    greedy = onnx_model.generate(src, beam_size=1, max_extra_length=5)
    cut = onnx_model.generate_hypotheses(src, beam_size=1, sampling_topk=0, sampling_topp=1e-6, seed=3,
                                         max_extra_length=5)
    np.testing.assert_array_equal(cut.sequences[:, 0], greedy)
    first = onnx_model.generate_hypotheses(src, beam_size=1, num_hypotheses=2, sampling_topk=0, seed=3)
    again = onnx_model.generate_hypotheses(src, beam_size=1, num_hypotheses=2, sampling_topk=0, seed=3)
    np.testing.assert_array_equal(first.sequences, again.sequences)
    with pytest.raises(ValueError, match=r"num_hypotheses=5 must be <= beam_size=4"):
        onnx_model.generate_hypotheses(src, beam_size=4, num_hypotheses=5)
    assert onnx_model.generate_hypotheses(np.zeros((0, 3), np.int32), num_hypotheses=2).sequences.shape == (0, 2, 0)


@pytest.mark.slow
def test_onnx_translator_hypotheses_prefixes_and_samples_equal_keras(exported, preset_dir):
    texts = ["the cat sat", "a dog ran far away", "the bird"]
    keras_translator = Translator.from_preset(preset_dir)
    onnx_translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    for arguments in (
        dict(beam_size=4, num_hypotheses=3),
        dict(beam_size=2, num_hypotheses=2, target_prefix=["the", None, "a dog"]),
        dict(beam_size=1, num_hypotheses=2, sampling_topk=0, seed=8),
    ):
        ours = onnx_translator.translate_hypotheses(texts, **arguments)
        theirs = keras_translator.translate_hypotheses(texts, **arguments)
        for mine, other in zip(ours, theirs):
            assert [h.text for h in mine] == [h.text for h in other]
            assert [h.token_ids for h in mine] == [h.token_ids for h in other]
            np.testing.assert_allclose([h.score for h in mine], [h.score for h in other], atol=1e-4)
            np.testing.assert_allclose([h.log_prob for h in mine], [h.log_prob for h in other], atol=1e-4)
        single = {key: value for key, value in arguments.items() if key != "num_hypotheses"}
        if "sampling_topk" in single:  # The best of two samples is not the one sample.
            ours = onnx_translator.translate_hypotheses(texts, **single)
        assert onnx_translator.translate(texts, **single) == [row[0].text for row in ours]


def test_translate_file_of_the_bundled_test_split_equals_translate(exported, tmp_path, caplog):
    from keras_transformer.datasets import bundled_paths
    from keras_transformer.textio import read_lines

    caplog.set_level(logging.ERROR, logger="keras_transformer.translator")  # this tokenizer cuts most lines
    src = bundled_paths("test")[0]
    lines = read_lines(src)
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    search = dict(beam_size=1, max_extra_length=2, max_batch_tokens=2048)
    assert translator.translate_file(src, tmp_path / "test.de", window=300, **search) == len(lines) == 946
    assert read_lines(tmp_path / "test.de") == translator.translate(lines, **search)


def test_runtime_cli_translates_src_to_output_and_refuses_a_missing_directory(exported, tmp_path, capsys):
    from export import runtime

    lines = ["the cat sees a dog.", "", "a red ball.", "my bird eats the big fish."]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.de"
    search = ["--beam-size", "1", "--max-extra-length", "3"]
    assert runtime.main(["--model", str(exported), "--src", str(tmp_path / "in.en"), "--output", str(out),
                         "--max-batch-tokens", "16", "--no-progress", *search]) == 0
    expected = OnnxTranslator(exported, providers=["CPUExecutionProvider"]).translate(
        lines, beam_size=1, max_extra_length=3)
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == expected
    assert f"Wrote 4 lines to {out}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        runtime.main(["--model", str(exported), "--src", str(tmp_path / "in.en"), "--output",
                      str(tmp_path / "nowhere" / "out.de")])
    err = capsys.readouterr().err
    assert error.value.code == 2 and "Traceback" not in err
    assert err.strip().split("\n")[-1].startswith("python -m export.runtime: error: --output: the directory of ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.de"]


COLD_START_SCRIPT = """
import sys
from export import runtime

sys.stdin = open(sys.argv[2], encoding="utf-8")
status = runtime.main(["--model", sys.argv[1], "--beam-size", "2", "--max-extra-length", "3"])
print("MODULES " + " ".join(sorted(sys.modules)), file=sys.stderr)
sys.exit(status)
"""


def test_the_command_imports_no_progress_bar_or_export_validation_for_a_pipe(exported, tmp_path, monkeypatch):
    """stderr not a terminal: no bar, so no tqdm; the graphs' signatures are checked without `export.validate`."""
    import argparse

    from keras_transformer.translate import show_progress

    (tmp_path / "source.txt").write_text("the cat sees a dog.\n", encoding="utf-8")
    (tmp_path / "cold.py").write_text(COLD_START_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "cold.py"), str(exported), str(tmp_path / "source.txt")],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(pathlib.Path(onnx_export.__file__).parents[1])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "Translating" not in result.stderr
    modules = set(result.stderr.split("MODULES ")[1].split())
    assert "tqdm" not in modules and "export.validate" not in modules, sorted(modules)
    assert {"onnxruntime", "sentencepiece", "export.contract"} <= modules
    # On a terminal the bar is drawn unless --no-progress.
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert show_progress(argparse.Namespace(no_progress=False))
    assert not show_progress(argparse.Namespace(no_progress=True))
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert not show_progress(argparse.Namespace(no_progress=False))

# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def test_validation_reports_the_output_and_the_largest_difference(exported):
    differences = validate_onnx(exported, small_model())
    assert max(differences.values()) <= 1e-4
    other = small_model(seed=99)
    message = r"encoder\.onnx output encoder_outputs: largest difference .* exceeds atol=0\.0001"
    with pytest.raises(ValidationError, match=message):
        validate_onnx(exported, other)


def test_validation_checks_the_fused_step_against_decode_step(model):
    """The fused decoder step's logits against `decode_step` with beams reordered: exact for the model's weights,
    named and rejected for a step whose last layer reads other values."""
    import onnxruntime as ort

    from export.fused_step import build_fused_step, fused_step_weights
    from export.validate import _compare, _validate_fused_step

    def record(graph, name, actual, expected):
        _compare(graph, name, actual, expected, 1e-4)

    weights = fused_step_weights(model)
    session = ort.InferenceSession(build_fused_step(weights).SerializeToString(), providers=["CPUExecutionProvider"])
    _validate_fused_step(session, model, np.random.default_rng(0), record)
    weights["layers"][-1]["self_qkv"][:, -1] *= 3.0  # one value unit of the last layer's self-attention
    session = ort.InferenceSession(build_fused_step(weights).SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ValidationError, match=r"fused_decoder_step\.onnx output logits: largest difference"):
        _validate_fused_step(session, model, np.random.default_rng(0), record)


def test_validation_rejects_a_graph_with_other_names(exported, tmp_path):
    copy = copy_of(exported, tmp_path)
    shutil.copy(copy / "encoder.onnx", copy / "decoder_step.onnx")
    with pytest.raises(ValidationError, match=r"decoder_step\.onnx has inputs \['encoder_token_ids'\]"):
        validate_onnx(copy, small_model())


def test_a_graph_that_deviates_from_the_contract_is_named(exported, tmp_path):
    """A fixed batch axis, or a cache sized for another model: validation and the runtime name graph and tensor."""
    import onnx

    copy = copy_of(exported, tmp_path)
    path = copy / "decoder_step.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    (ids,) = [value for value in proto.graph.input if value.name == "decoder_token_ids"]
    ids.type.tensor_type.shape.dim[0].dim_value = 2  # (clears its dim_param)
    onnx.save(proto, str(path))
    message = r"decoder_step\.onnx decoder_token_ids axis 0 \(batch\) is fixed to 2; it must be dynamic"
    with pytest.raises(ValidationError, match=message):
        validate_onnx(copy, small_model())
    with pytest.raises(ValueError, match=f"does not match export format {contract.ONNX.version}: " + message):
        OnnxSeq2Seq(copy, providers=["CPUExecutionProvider"])._session("decoder_step")

    shutil.copy(exported / "decoder_step.onnx", path)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, num_heads=8)))
    message = r"decoder_step\.onnx self_key axis 2 \(num_heads\) is 4; the model's num_heads is 8"
    with pytest.raises(ValueError, match=message):
        OnnxSeq2Seq(copy, providers=["CPUExecutionProvider"])._session("decoder_step")
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_heads"}))
    with pytest.raises(ValueError, match=r"lacks \['num_heads'\] \(the sizes of the graphs' tensors\); export"):
        read_config(copy)


def test_dynamic_update_slice_is_a_scatter_with_xla_clamping(tmp_path):
    """The tf2onnx handler for keras.ops.slice_update, including out-of-range starts."""
    import tensorflow as tf

    def update(operand, updates, start):
        return {"output": keras.ops.slice_update(operand, [0, start, 0], updates)}

    signature = [
        tf.TensorSpec([None, None, 3], tf.float32, name="operand"),
        tf.TensorSpec([None, None, 3], tf.float32, name="updates"),
        tf.TensorSpec([], tf.int32, name="start"),
    ]
    path = tmp_path / "update.onnx"
    onnx_export._convert(update, signature, onnx_export.DEFAULT_OPSET, path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    operand = rng.normal(size=(2, 7, 3)).astype(np.float32)
    updates = rng.normal(size=(2, 2, 3)).astype(np.float32)
    for start in (0, 3, 5, 6, 100, -4):  # XLA clamps the start into [0, 7 - 2].
        (actual,) = session.run(None, {"operand": operand, "updates": updates, "start": np.array(start, np.int32)})
        np.testing.assert_array_equal(actual, to_numpy(update(operand, updates, start)["output"]))


def test_take_and_where_export_as_one_gather_and_one_where(tmp_path):
    """`_drop_negative_index_fixes` and the `SelectV2` handler: fewer nodes, Keras' values, infinities kept."""
    import onnx
    import tensorflow as tf

    def take_and_select(x, indices, condition, y):
        return {"taken": keras.ops.take(x, indices, axis=0), "selected": keras.ops.where(condition, x, y)}

    signature = [
        tf.TensorSpec([None, 3], tf.float32, name="x"),
        tf.TensorSpec([None], tf.int32, name="indices"),
        tf.TensorSpec([None, 3], tf.bool, name="condition"),
        tf.TensorSpec([None, 3], tf.float32, name="y"),
    ]
    path = tmp_path / "take.onnx"
    onnx_export._convert(take_and_select, signature, onnx_export.DEFAULT_OPSET, path)
    assert sorted(node.op_type for node in onnx.load(str(path)).graph.node) == ["Gather", "Where"]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    x[1, 2] = -np.inf  # x * 0 would be NaN where the select takes y
    feeds = {"x": x, "indices": np.array([0, -1, 4, -5, 1], np.int32), "condition": rng.random((5, 3)) < 0.5,
             "y": rng.normal(size=(5, 3)).astype(np.float32)}
    feeds["condition"][1, 2] = False
    expected = {name: to_numpy(value) for name, value in take_and_select(**feeds).items()}
    for name, actual in zip([o.name for o in session.get_outputs()], session.run(None, feeds)):
        np.testing.assert_array_equal(actual, expected[name])


def test_dense_on_3d_inputs_exports_as_one_matmul(tmp_path):
    """`_fold_tensordot_reshapes`: no tensordot reshapes left, same values at other shapes."""
    import onnx
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(5)
    layer.build((None, None, 3))

    def dense(x):
        return {"y": layer(x)}

    path = tmp_path / "dense.onnx"
    onnx_export._convert(dense, [tf.TensorSpec([None, None, 3], tf.float32, name="x")], 15, path)
    nodes = onnx.load(str(path)).graph.node
    assert [node.op_type for node in nodes if node.op_type != "Add"] == ["MatMul"]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((2, 7, 3), (1, 1, 3)):
        x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], to_numpy(layer(x)), atol=1e-6)


def test_no_op_node_pairs_that_tf2onnx_writes_are_dropped(tmp_path):
    """`_drop_no_op_pairs`: a squeeze of an `expand_dims`, a negated `all` (tf2onnx writes `Not(Not(...))`)
    and integers compared through casts to float leave those nodes out; the same values."""
    import onnx
    import tensorflow as tf

    def function(x, a, b):
        return {
            "doubled": keras.ops.squeeze(keras.ops.expand_dims(x, 1), 1) * 2.0,
            "not_all": keras.ops.logical_not(keras.ops.all(keras.ops.greater(x, 0.0), axis=1)),
            "less": keras.ops.less(a, b),
        }

    path = tmp_path / "pairs.onnx"
    signature = [tf.TensorSpec([None, 3], tf.float32, name="x"), tf.TensorSpec([None], tf.int32, name="a"),
                 tf.TensorSpec([None], tf.int32, name="b")]
    onnx_export._convert(function, signature, onnx_export.DEFAULT_OPSET, path)
    nodes = onnx.load(str(path)).graph.node
    producers = {output: node for node in nodes for output in node.output}
    kinds = [node.op_type for node in nodes]
    assert "Unsqueeze" not in kinds and "Squeeze" not in kinds, kinds
    assert not any(node.op_type == "Not" and producers.get(node.input[0]) is not None
                   and producers[node.input[0]].op_type == "Not" for node in nodes), kinds
    less = next(node for node in nodes if node.op_type == "Less")
    assert list(less.input) == ["a", "b"], kinds
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(4, 3)).astype(np.float32), "a": np.array([1, 5, -3, 7], np.int32),
             "b": np.array([2, 5, -4, 8], np.int32)}
    feeds["x"][2] = np.abs(feeds["x"][2])  # one row with every value > 0
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_array_equal(outputs["doubled"], feeds["x"] * 2.0)
    np.testing.assert_array_equal(outputs["not_all"], ~(feeds["x"] > 0).all(axis=1))
    np.testing.assert_array_equal(outputs["less"], feeds["a"] < feeds["b"])


def test_an_unconvertible_op_fails_the_export_and_leaves_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "CUSTOM_OP_HANDLERS", {})
    function, signature = graphs.graph_functions(model)["decoder_step"]
    with pytest.raises(RuntimeError, match="XlaDynamicUpdateSlice"):
        onnx_export._convert(function, signature, onnx_export.DEFAULT_OPSET, tmp_path / "decoder_step.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_optimizer_pass_is_skipped_on_a_fresh_conversion(model, tmp_path, monkeypatch):
    """The passes run in place; one that fails makes `_convert` convert again and skip that pass."""
    import onnxruntime

    real = onnx_export._optimizers()
    calls = []

    class Failing:
        graph_been_opt = False

        def optimize(self, graph, iteration):
            calls.append(iteration)
            raise ValueError("simulated optimizer failure")

    monkeypatch.setattr(onnx_export, "_optimizers", lambda: {"failing": Failing, **real})
    function, signature = graphs.graph_functions(model)["encoder"]
    path = tmp_path / "encoder.onnx"
    onnx_export._convert(function, signature, onnx_export.DEFAULT_OPSET, path)
    assert len(calls) >= 2  # in place, then on the fresh copy
    ids = np.array([[5, 6, 7, model.end_id]], np.int32)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"encoder_token_ids": ids})[0], to_numpy(model.encode(ids)), atol=1e-5)


# --------------------------------------------------------------------------- #
# Overwriting and atomicity
# --------------------------------------------------------------------------- #
def test_cli_refuses_to_overwrite(exported, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in exported.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        onnx_export.main(["--preset", "tiny", "--output", str(exported)])
    assert exit_info.value.code == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in exported.iterdir()} == before
    with pytest.raises(FileExistsError, match="already exists"):
        onnx_export.export_onnx("tiny", exported)


def test_bad_arguments_are_rejected_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"opset=11 must be an int in \[14, 18\]"):
        onnx_export.export_onnx("tiny", tmp_path / "out", opset=11)
    with pytest.raises(ValueError, match=r"quantize='int4' must be one of"):
        onnx_export.export_onnx("tiny", tmp_path / "out", quantize="int4")
    assert list(tmp_path.iterdir()) == []


def test_a_float32_export_of_another_model_is_not_quantized(exported, preset_dir, tmp_path):
    # The int8 validation bounds no value, so the reused export is checked against the model first.
    with pytest.raises(ValueError, match=r"float32_export='.*' is only read to quantize"):
        onnx_export.export_onnx(preset_dir, tmp_path / "out", float32_export=exported)
    with pytest.raises(ValidationError, match=r"is not a float32 ONNX export of this model: encoder\.onnx output "
                                              r"encoder_outputs: largest difference from Keras"):
        onnx_export.export_onnx(small_model(seed=7), tmp_path / "out", quantize="int8", float32_export=exported)
    with pytest.raises(ValueError, match=r"was exported at opset 17; opset=16 was asked for \(pass --opset 17\)"):
        onnx_export.export_onnx(preset_dir, tmp_path / "out", quantize="int8", opset=16, float32_export=exported)
    quantized = tmp_path / "quantized"
    shutil.copytree(exported, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(dict(config, quantization="int8")))
    with pytest.raises(ValidationError, match=r"config\.json has quantization='int8', not float32"):
        onnx_export.export_onnx(preset_dir, tmp_path / "out", quantize="int8", float32_export=quantized)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized"]


@pytest.mark.slow
def test_a_failed_validation_leaves_no_directory(model, tmp_path, monkeypatch):
    def failing_validation(directory, model, atol):
        assert sorted(p.name for p in directory.iterdir()) == sorted(GRAPH_FILES + ["config.json", "weights.bin"])
        raise ValidationError("simulated mismatch")

    # What is checked is the staging directory's fate, not the conversion: stand-in graphs and weights.
    monkeypatch.setattr(onnx_export, "_convert", lambda function, signature, opset, path: path.write_bytes(b"graph"))
    monkeypatch.setattr(onnx_export, "_share_weights",
                        lambda directory, paths: (directory / "weights.bin").write_bytes(b"weights"))
    monkeypatch.setattr(onnx_export, "validate_onnx", failing_validation)
    with pytest.raises(ValidationError, match="simulated mismatch"):
        onnx_export.export_onnx(model, tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_keeps_the_old_directory(model, exported, tmp_path, monkeypatch):
    old = copy_of(exported, tmp_path)
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def convert_then_fail(function, signature, opset, path):
        path.write_bytes(b"partial")
        if path.name == "init_cache.onnx":
            raise RuntimeError("simulated failure mid-export")

    monkeypatch.setattr(onnx_export, "_convert", convert_then_fail)
    with pytest.raises(RuntimeError, match="simulated failure mid-export"):
        onnx_export.export_onnx(model, old, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


# --------------------------------------------------------------------------- #
# Runtime errors
# --------------------------------------------------------------------------- #
def test_missing_files_are_named(exported, tmp_path):
    with pytest.raises(FileNotFoundError, match="No ONNX model directory"):
        OnnxSeq2Seq(tmp_path / "nowhere")
    copy = copy_of(exported, tmp_path)
    (copy / "decoder_step.onnx").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing decoder_step\.onnx"):
        OnnxSeq2Seq(copy)
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        read_config(copy)


def test_a_directory_without_tokenizer_cannot_translate(exported, tmp_path):
    copy = copy_of(exported, tmp_path)
    (copy / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.model"):
        OnnxTranslator(copy)


def test_another_format_version_is_rejected(exported, tmp_path):
    copy = copy_of(exported, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["format_version"] = 99
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version 99; this version of export.runtime reads 'keras_transformer.onnx' "
                       f"version {contract.ONNX.version}. Export the model again"):
        OnnxSeq2Seq(copy)


def test_a_saved_model_directory_is_named_as_such(exported, tmp_path):
    copy = copy_of(exported, tmp_path)
    (copy / "saved_model.pb").write_bytes(b"")
    with pytest.raises(ValueError, match="is a TensorFlow SavedModel"):
        OnnxSeq2Seq(copy)


def test_bad_ids_get_clear_errors(onnx_model):
    with pytest.raises(ValueError, match=r"token id 60, outside \[0, 60\)"):
        onnx_model.encode(np.array([[5, 60, 3]], np.int32))
    with pytest.raises(ValueError, match=r"token id -1, outside \[0, 60\)"):
        onnx_model.generate(np.array([[5, -1, 3]]))
    with pytest.raises(ValueError, match="must be an integer array of token ids, received dtype float32"):
        onnx_model.encode(np.array([[5.0, 6.0]], np.float32))
    with pytest.raises(ValueError, match=r"must have rank 2 \[batch, length\], received shape \(3,\)"):
        onnx_model.encode(np.array([5, 6, 3]))
    with pytest.raises(ValueError, match="longer than max_sequence_length=64"):
        onnx_model.encode(np.full((1, 65), 5))
    src = np.array([[5, 6, 3]], np.int32)
    cache = onnx_model.init_cache(onnx_model.encode(src), src, 4)
    with pytest.raises(ValueError, match=r"token id 77, outside \[0, 60\)"):
        onnx_model.decode_step(np.array([77]), 0, cache)
    with pytest.raises(ValueError, match="index=4 is outside the cache of length 4"):
        onnx_model.decode_step(np.array([START]), 4, cache)
    with pytest.raises(ValueError, match=r"token_ids has batch 2 but the cache entries have batches"):
        onnx_model.decode_step(np.array([START, START]), 0, cache)
    # int64 ids are accepted (cast to the graphs' int32).
    assert onnx_model.encode(src.astype(np.int64)).shape == (1, 3, 16)


def test_providers_fall_back_to_the_cpu_quietly(exported, capfd):
    """onnxruntime-gpu lists CUDA where it cannot run: probed once, no error lines."""
    from export import runtime

    capfd.readouterr()
    model = OnnxSeq2Seq(exported)
    model.generate(np.array([[5, 6, 3]]), beam_size=2, max_extra_length=2)
    if runtime._PROVIDER_WORKS.get("CUDAExecutionProvider"):
        pytest.skip("CUDA works here")
    assert model.providers == ["CPUExecutionProvider"] and not model.use_io_binding
    err = capfd.readouterr().err
    assert "[E:onnxruntime" not in err and "CUDAExecutionProvider" not in err, err
    with pytest.raises(ValueError, match=r"Execution provider\(s\) \['NoSuchExecutionProvider'\] are not available"):
        OnnxSeq2Seq(exported, providers=["NoSuchExecutionProvider"])


LEAN_SCRIPT = """
import json
import sys

class NoFramework:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"tensorflow", "keras", "jax", "torch", "keras_hub", "tensorflow_text", "tf2onnx"}:
            raise ImportError(name + " must not be imported by the ONNX Runtime server")

sys.meta_path.insert(0, NoFramework())
from export import runtime

model, source, output, scores = sys.argv[1:5]
search = ["--beam-size", "2", "--max-extra-length", "5"]
sys.stdin = open(source, encoding="utf-8")
status = runtime.main(["--model", model, "--no-progress", *search])
status |= runtime.main(["--model", model, "--src", source, "--output", output, "--max-batch-tokens", "16", *search])
translator = runtime.OnnxTranslator(model)
with open(scores, "w") as f:
    json.dump([score.log_prob for score in translator.score(sys.argv[5:], sys.argv[5:])], f)
sys.exit(status)
"""


@pytest.mark.slow
def test_the_server_runs_without_any_training_framework(exported, preset_dir, tmp_path):
    """`python -m export.runtime` (stdin, and --src/--output) and `score` where importing TensorFlow, Keras, JAX or
    PyTorch fails."""
    texts = ["the cat sees a dog.", "", "my bird eats the big fish.", "a red ball."]
    source = tmp_path / "source.txt"
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    script = tmp_path / "lean.py"
    script.write_text(LEAN_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(exported), str(source), str(tmp_path / "out.txt"),
         str(tmp_path / "scores.json"), *texts[2:]],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(pathlib.Path(onnx_export.__file__).parents[1])},
    )
    assert result.returncode == 0, result.stderr
    keras_translator = Translator.from_preset(preset_dir)
    expected = keras_translator.translate(texts, beam_size=2, max_extra_length=5)
    assert result.stdout.split("\n")[:-1] == expected
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1] == expected
    expected_scores = [score.log_prob for score in keras_translator.score(texts[2:], texts[2:])]
    np.testing.assert_allclose(json.loads((tmp_path / "scores.json").read_text()), expected_scores, atol=1e-4)
    assert "Traceback" not in result.stderr and "[E:onnxruntime" not in result.stderr
