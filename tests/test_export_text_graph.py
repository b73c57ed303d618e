"""translate.onnx (export/text_graph.py): text in, text out in one ONNX Runtime call."""

import itertools
import json
import shutil

import keras
import numpy as np
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
from export.runtime import OnnxTranslator  # noqa: E402
from export.validate import ValidationError  # noqa: E402
from keras_transformer.translator import Translator  # noqa: E402

MAX_SEQUENCE_LENGTH = 16  # Small, so that a sentence gets truncated.
SUBJECTS = ["the cat", "a dog", "my bird", "the old fish"]
VERBS = ["sees", "likes", "eats"]
OBJECTS = ["the cat.", "a dog.", "the big fish.", "a red ball."]
CORPUS = [f"{s} {v} {o}" for s, v, o in itertools.product(SUBJECTS, VERBS, OBJECTS)]
CORPUS += ["Die Katze sieht den großen Hund.", "Le chat a été naïf, ça va."]
TEXTS = [
    "the cat sees a dog.",
    "",
    "a red ball.",
    "   ",
    "Die Katze, ça, naïve, 東京.",  # Non-ASCII; 東京 is not in the vocabulary (<unk>).
    "my bird eats the big fish.",
    "fish",
]
# More than MAX_SEQUENCE_LENGTH pieces: the Translator keeps the first 15 and the end id.
LONG = "the old fish likes the big fish and the cat sees a red ball and my bird eats."


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    keras.utils.set_random_seed(1234)
    model = kt.TransformerModel(
        vocabulary_size=64, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    directory = tmp_path_factory.mktemp("preset") / "tiny"
    model.save_to_preset(directory, tokenizer=kt.train_tokenizer(CORPUS, vocabulary_size=64))
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory, preset_dir):
    output = onnx_export.export_onnx(preset_dir, tmp_path_factory.mktemp("onnx") / "model")
    text_graph.write_text_graph(output)  # Validated against OnnxTranslator on its own texts.
    return output


@pytest.fixture(scope="module")
def session(exported):
    return text_graph._session(exported / text_graph.TEXT_GRAPH_FILE)


@pytest.fixture(scope="module")
def translators(exported, preset_dir):
    return OnnxTranslator(exported, providers=["CPUExecutionProvider"]), Translator.from_preset(preset_dir)


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


@pytest.mark.parametrize("beam_size", [None, 1, 2])
def test_strings_equal_both_translators(session, translators, beam_size):
    """Mixed lengths, empty and whitespace-only texts, non-ASCII, <unk>; None: the graph's default (4)."""
    onnx_translator, keras_translator = translators
    inputs = {} if beam_size is None else {"beam_size": beam_size, "max_extra_length": 6, "alpha": 1.0}
    search = {"beam_size": beam_size or 4, "max_extra_length": inputs.get("max_extra_length", 50),
              "length_penalty": inputs.get("alpha", 0.6)}
    received = text_graph.translate_texts(session, TEXTS, **inputs)
    expected = onnx_translator.translate(TEXTS, **search)
    assert received == expected
    # Batches of 2 sorted by length in the Translator, one batch of 7 in the graph.
    assert received == keras_translator.translate(TEXTS, batch_size=2, **search)
    assert received[1] == received[3] == "" and all(received[i] for i in (0, 2, 4, 5, 6))


def test_long_sources_are_cut_as_the_translator_cuts_them(session, translators, caplog):
    onnx_translator, keras_translator = translators
    assert len(onnx_translator.tokenizer.encode([LONG])[0]) > MAX_SEQUENCE_LENGTH + 2
    # Cut to the first 15 pieces: what follows them does not change the translation.
    pieces = onnx_translator.tokenizer.encode([LONG], add_end=False)[0]
    prefix = onnx_translator.tokenizer._processor.decode(pieces[: MAX_SEQUENCE_LENGTH - 1])
    texts = [LONG, "a dog.", LONG + " and more words"]
    received = text_graph.translate_texts(session, texts, max_extra_length=4)
    assert received == onnx_translator.translate(texts, max_extra_length=4)
    assert received == keras_translator.translate(texts, max_extra_length=4)
    assert received[0] == received[2] == text_graph.translate_texts(session, [prefix], max_extra_length=4)[0]
    assert "keeping the first 15" in caplog.text  # The Translator warns; the graph cannot.


def test_empty_batches_and_batches_without_pieces(session):
    assert text_graph.translate_texts(session, []) == []
    assert text_graph.translate_texts(session, ["", " ", "\t"]) == ["", "", ""]


def test_cli_writes_the_graph_and_names_what_is_missing(exported, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    (copy / "translate.onnx").unlink()
    assert text_graph.main(["--model", str(copy), "--beam-size", "2", "--no-validate"]) == 0
    session = text_graph._session(copy / "translate.onnx")
    assert text_graph.translate_texts(session, ["a dog."]) == text_graph.translate_texts(
        text_graph._session(exported / "translate.onnx"), ["a dog."], beam_size=2
    )
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


def test_export_onnx_with_tokenizer_flag(exported, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    (copy / "translate.onnx").unlink()
    monkeypatch.setattr(onnx_export, "export_onnx", lambda *args, **kwargs: copy)
    assert onnx_export.main(["--preset", "unused", "--output", str(copy), "--overwrite", "--with-tokenizer"]) == 0
    assert (copy / "translate.onnx").is_file()
