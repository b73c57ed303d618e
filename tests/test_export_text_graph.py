"""translate.onnx (export/text_graph.py): text in, text out in one ONNX Runtime call."""

import json
import shutil

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="ONNX export runs on the TensorFlow backend"
)

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")
pytest.importorskip(
    "onnxruntime_extensions", reason="translate.onnx needs onnxruntime-extensions (SentencePiece operators)"
)

import keras_transformer as kt  # noqa: E402
from export import onnx as onnx_export  # noqa: E402
from export import text_graph  # noqa: E402
from export.validate import ValidationError  # noqa: E402
from keras_transformer.translator import Translator  # noqa: E402

from conftest import TINY_EXPORT_MAX_SEQUENCE_LENGTH as MAX_SEQUENCE_LENGTH  # noqa: E402
from conftest import refuse_graph_conversion  # noqa: E402

TEXTS = [
    "the cat sees a dog.",
    "",
    "a red ball.",
    "   ",
    "Die Katze, ça, naïve, 東京.",  # Non-ASCII, mostly not in the vocabulary (<unk>).
    "my bird eats the big fish.",
    "fish",
]
# More than MAX_SEQUENCE_LENGTH pieces: the Translator keeps the first 63 and the end id.
# Words of the tiny tokenizer's corpus only, so that its first pieces, decoded, encode to the same pieces.
LONG = " ".join(["the old fish likes the big fish."] * 8) + " my bird eats a red ball."


@pytest.fixture(scope="module")
def preset_dir(tiny_preset_dir):
    return tiny_preset_dir


@pytest.fixture(scope="module")
def exported(tiny_onnx_export, tmp_path_factory):
    """A copy of the suite's tiny export (shared, read only), with translate.onnx written into it."""
    output = tmp_path_factory.mktemp("onnx") / "model"
    shutil.copytree(tiny_onnx_export, output)
    text_graph.write_text_graph(output)  # Validated against OnnxTranslator on its own texts.
    return output


@pytest.fixture(scope="module")
def tokenizer(preset_dir):
    return kt.Tokenizer.load(preset_dir)


def prefix_of_long(tokenizer):
    """LONG cut as the Translator cuts it, as text: its first 15 pieces."""
    pieces = tokenizer.encode([LONG], add_end=False)[0]
    return tokenizer.decode([pieces[: MAX_SEQUENCE_LENGTH - 1]])[0]


@pytest.fixture(scope="module")
def results(exported, tokenizer):
    """translate.onnx's and OnnxTranslator's strings, from one child process (see translate_in_subprocess)."""
    calls = {
        "default": (TEXTS, {}),
        "greedy": (TEXTS, {"beam_size": 1, "max_extra_length": 6, "alpha": 1.0}),
        "beam2": (TEXTS, {"beam_size": 2, "max_extra_length": 6, "alpha": 1.0}),
        "long": ([LONG, "a dog.", LONG + " and more words"], {"max_extra_length": 4}),
        "prefix": ([prefix_of_long(tokenizer)], {"max_extra_length": 4}),
        "no_texts": ([], {}),
        "no_pieces": (["", " ", "\t", "\u3000"], {}),
        "next_line": (["\x85", " \x85 "], {"max_extra_length": 4}),
    }
    answer = text_graph.translate_in_subprocess(exported, list(calls.values()), compare=True)
    return {label: (graph, translator) for label, graph, translator in zip(
        calls, answer["graph"], answer["translator"], strict=True)}


@pytest.fixture(scope="module")
def keras_translator(preset_dir):
    return Translator.from_preset(preset_dir)


def test_the_graph_takes_strings_and_optional_search_arguments(exported):
    import onnx

    model = onnx.load(str(exported / "translate.onnx"), load_external_data=False)
    graph = model.graph
    kinds = {value.name: value.type.tensor_type for value in graph.input}
    assert list(kinds) == ["text", "beam_size", "alpha", "max_extra_length"]
    assert [kinds[n].elem_type for n in kinds] == [
        onnx.TensorProto.STRING, onnx.TensorProto.INT32, onnx.TensorProto.FLOAT, onnx.TensorProto.INT32
    ]
    assert [d.dim_param for d in kinds["text"].shape.dim] == ["batch"]
    (output,) = graph.output
    assert (output.name, output.type.tensor_type.elem_type) == ("translation", onnx.TensorProto.STRING)
    # Defaults: initializers named as the inputs.
    defaults = {t.name: onnx.numpy_helper.to_array(t).item() for t in graph.initializer if t.name in kinds}
    assert defaults == {"beam_size": 4, "alpha": pytest.approx(0.6), "max_extra_length": 50}
    assert {(o.domain, o.version) for o in model.opset_import} >= {("ai.onnx.contrib", 1)}
    ops = {(node.domain, node.op_type) for node in graph.node}
    assert ("ai.onnx.contrib", "SentencepieceTokenizer") in ops
    # The weights are not copied: the graph reads the export's weights.bin.
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {"weights.bin"}
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["keras_transformer.defaults"]) == {"beam_size": 4, "alpha": 0.6, "max_extra_length": 50}


@pytest.mark.parametrize(
    "label, search",
    [
        ("default", {"beam_size": 4, "length_penalty": 0.6, "max_extra_length": 50}),
        ("greedy", {"beam_size": 1, "length_penalty": 1.0, "max_extra_length": 6}),
        ("beam2", {"beam_size": 2, "length_penalty": 1.0, "max_extra_length": 6}),
    ],
)
def test_strings_equal_both_translators(results, keras_translator, label, search):
    """Mixed lengths, empty and whitespace-only texts, non-ASCII, <unk>; "default": the graph's defaults."""
    received, expected = results[label]
    assert received == expected
    if label == "default":  # (OnnxTranslator is compared with Keras in test_export_onnx.py.)
        # Batches of 2 sorted by length in the Translator, one batch of 7 in the graph.
        assert received == keras_translator.translate(TEXTS, batch_size=2, **search)
    assert received[1] == received[3] == "" and all(received[i] for i in (0, 2, 4, 5, 6))


def test_long_sources_are_cut_as_the_translator_cuts_them(results, keras_translator, tokenizer, caplog):
    assert len(tokenizer.encode([LONG])[0]) > MAX_SEQUENCE_LENGTH + 2
    received, expected = results["long"]
    assert received == expected
    texts = [LONG, "a dog.", LONG + " and more words"]
    assert received == keras_translator.translate(texts, max_extra_length=4)
    assert f"keeping the first {MAX_SEQUENCE_LENGTH - 1}" in caplog.text  # The Translator warns; the graph cannot.
    # What follows the first pieces does not change the translation.
    assert received[0] == received[2] == results["prefix"][0][0]


def test_empty_batches_and_texts_without_pieces(results):
    assert results["no_texts"] == ([], [])
    assert results["no_pieces"] == (["", "", "", ""], ["", "", "", ""])


def test_the_one_known_difference_next_line_alone(results, tokenizer):
    """U+0085 alone: Python's str.strip() removes it (the Translator returns ""), SentencePiece keeps it (<unk>)."""
    assert "\x85".strip() == "" and tokenizer.encode(["\x85"], add_end=False)[0]  # Not in the vocabulary: <unk>.
    received, expected = results["next_line"]
    assert expected == ["", ""]
    assert all(received)  # The graph translates the <unk> piece.


def test_cli_writes_the_graph_and_names_what_is_missing(exported, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    (copy / "translate.onnx").unlink()
    # Validated with its own defaults.
    assert text_graph.main(["--model", str(copy), "--beam-size", "2", "--length-penalty", "1.0"]) == 0
    default = text_graph.translate_in_subprocess(copy, [(TEXTS, {})])["graph"]
    given = {"beam_size": 2, "alpha": 1.0}
    assert default == text_graph.translate_in_subprocess(exported, [(TEXTS, given)])["graph"]
    (copy / "tokenizer.model").unlink()
    with pytest.raises(SystemExit):
        text_graph.main(["--model", str(copy)])
    assert "has no tokenizer.model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="beam_size=0"):
        text_graph.write_text_graph(exported, beam_size=0)


def test_a_graph_that_differs_fails_validation_and_is_removed(exported, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    (copy / "translate.onnx").unlink()
    build = text_graph.build_text_graph
    # Wrong end id: the sources get another last token.
    monkeypatch.setattr(
        text_graph, "build_text_graph",
        lambda model, proto, config, **kwargs: build(model, proto, dict(config, end_id=5), **kwargs),
    )
    with pytest.raises(ValidationError, match="translate.onnx translates"):
        text_graph.write_text_graph(copy)
    assert not (copy / "translate.onnx").exists()


def test_export_onnx_with_tokenizer_flag(tmp_path, monkeypatch, capsys):
    """The flag reaches `export_onnx` (which writes translate.onnx inside the export: test_export_imported's
    `onnx_dir`); a model without a tokenizer is refused in one line before any graph is converted."""
    calls = []
    monkeypatch.setattr(onnx_export, "export_onnx", lambda *args, **kwargs: calls.append(kwargs))
    assert onnx_export.main(["--preset", "unused", "--output", str(tmp_path / "out"), "--with-tokenizer"]) == 0
    assert calls[0]["with_tokenizer"] is True
    monkeypatch.undo()
    refuse_graph_conversion(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        onnx_export.main(["--preset", "tiny", "--output", str(tmp_path / "tiny-onnx"), "--with-tokenizer"])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "tiny has no tokenizer.model" in error
    assert not (tmp_path / "tiny-onnx").exists()
