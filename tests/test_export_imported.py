"""Every export of an imported Marian checkpoint: ONNX (and translate.onnx), CTranslate2, SavedModel.

The checkpoint is the stand-in of tests/conftest.py (`marian_trained`: SiLU,
sin|cos-halves positions, a logits bias, two SentencePiece models and
vocab.json). transformers never trains `final_logits_bias` (a buffer), so
the stand-in's is zero; the model exported here gets a random one, so that
an export that dropped it would fail its validation and these comparisons.
Each format is exported once per module (exports are slow on a small CPU);
each export validates itself (it raises otherwise), and the tests compare
the exported engines' strings with the Keras `Translator`'s, greedy and
beam 4, and the in-graph tokenizers with `MarianTokenizer` on the bundled
test split.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = [
    pytest.mark.tensorflow_only,
    pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the exports trace TensorFlow graphs"),
]

pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")
pytest.importorskip("onnxruntime_extensions", reason="translate.onnx needs onnxruntime-extensions")
pytest.importorskip("tensorflow_text")
ctranslate2 = pytest.importorskip("ctranslate2")

import tensorflow as tf  # noqa: E402

import keras_transformer as kt  # noqa: E402
from export import ctranslate2 as ct2_export  # noqa: E402
from export import onnx as onnx_export  # noqa: E402
from export import saved_model as saved_model_export  # noqa: E402
from export import text_graph  # noqa: E402
from export.validate import ValidationError, validate_onnx  # noqa: E402
from keras_transformer.datasets import load_bundled  # noqa: E402
from keras_transformer.tokenizers.marian import MarianTokenizer  # noqa: E402
from keras_transformer.tokenizers.sentencepiece import load_tokenizer  # noqa: E402

from conftest import refuse_graph_conversion  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGLISH, GERMAN = load_bundled("test")
# Test-split sentences spread over the split, a text with a leading language
# code (one unk piece for this one-language vocabulary), characters only
# target.spm knows ("ß", "„": ids of vocab.json, not unk), empty ones.
PICKS = np.linspace(0, len(ENGLISH) - 1, 10).round().astype(int)
TEXTS = [ENGLISH[i] for i in PICKS] + [
    ">>de<< " + ENGLISH[PICKS[1]], "„Straße“ and ß, öß", "", "   ",
]
SEARCHES = {"greedy": 1, "beam4": 4}


@pytest.fixture(scope="module")
def model(marian_trained):
    model = kt.TransformerModel.from_preset(marian_trained, dropout=0.0)
    bias = np.random.default_rng(0).normal(0.0, 0.5, (model.vocabulary_size,)).astype("float32")
    model.logits_bias_weight.assign(bias)
    return model


@pytest.fixture(scope="module")
def tokenizer(model):
    assert isinstance(model.tokenizer, MarianTokenizer) and not model.tokenizer.language_codes
    return model.tokenizer


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory, model):
    """Our preset directory holding the imported model and its MarianTokenizer."""
    directory = tmp_path_factory.mktemp("preset") / "opus-mt-standin"
    model.save_to_preset(directory)
    return directory


@pytest.fixture(scope="module")
def keras_translator(model, tokenizer):
    return kt.Translator(model, tokenizer)


@pytest.fixture(scope="module")
def expected(keras_translator):
    """The Keras Translator's strings for TEXTS, per search."""
    return {search: keras_translator.translate(TEXTS, beam_size=beam) for search, beam in SEARCHES.items()}


def multilingual(tokenizer):
    """The tokenizer with two of its ordinary pieces renamed to target-language codes (same size)."""
    vocab = tokenizer.vocab
    for code, piece in zip((">>de<<", ">>fr<<"), tokenizer.pieces()[-2:]):
        vocab[code] = vocab.pop(piece)
    specials = tokenizer.specials()
    return MarianTokenizer(tokenizer.source_proto, tokenizer.target_proto, vocab, pad_token=specials["pad_token"],
                           unk_token=specials["unk_token"], end_token=specials["end_token"],
                           start_token=specials["start_token"])


# --------------------------------------------------------------------------- #
# ONNX: python -m export.onnx --with-tokenizer on the preset directory
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory, preset_dir):
    output = tmp_path_factory.mktemp("onnx") / "model"
    # Validated at export: graphs against Keras, then translate.onnx against OnnxTranslator.
    assert onnx_export.main(["--preset", str(preset_dir), "--output", str(output), "--with-tokenizer"]) == 0
    return output


# Run where importing a training framework fails (the server's promise):
# OnnxTranslator, translate.onnx, and translate.onnx's tokenizer steps alone.
ONNX_CHILD = """
import json, sys

class NoFramework:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"tensorflow", "keras", "jax", "torch", "keras_hub", "tensorflow_text", "tf2onnx"}:
            raise ImportError(name + " must not be imported by the ONNX Runtime server")

sys.meta_path.insert(0, NoFramework())
import numpy as np
from export import text_graph
from export.runtime import OnnxTranslator

request = json.load(sys.stdin)
translator = OnnxTranslator(request["directory"], providers=["CPUExecutionProvider"])
session = text_graph._session(request["directory"] + "/translate.onnx")
answer = {"runtime": {}, "graph": {}}
for search, beam in request["searches"].items():
    answer["runtime"][search] = translator.translate(request["texts"], beam_size=beam)
    answer["graph"][search] = text_graph.translate_texts(session, request["texts"], beam_size=beam)
encode = text_graph._session(request["encode"])
ids, has_pieces = encode.run(None, {"text": np.array(request["source_texts"], dtype=object)})
answer["encoded"] = {"ids": ids.tolist(), "has_pieces": has_pieces.tolist()}
decode = text_graph._session(request["decode"])
sequences = np.array(request["sequences"], np.int32)
(texts,) = decode.run(None, {"text": np.array([""] * len(sequences), dtype=object), "sequences": sequences})
answer["decoded"] = [str(text) for text in texts]
json.dump(answer, sys.stdout)
"""


def padded(rows):
    matrix = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = row
    return matrix


@pytest.fixture(scope="module")
def onnx_results(onnx_dir, tokenizer, tmp_path_factory):
    """One child process: the strings of OnnxTranslator and translate.onnx, the tokenizer graphs' outputs."""
    import onnx

    directory = tmp_path_factory.mktemp("tokenizer_graphs")
    config = json.loads((onnx_dir / "config.json").read_text())
    paths = {}
    for name, graph in text_graph.build_tokenizer_graphs(tokenizer, config).items():
        paths[name] = str(directory / f"{name}.onnx")
        onnx.save(graph, paths[name])
    # Sources: both languages (German has many characters source.spm does not know).
    # Long ones are cut to max_sequence_length as the Translator cuts them, a language code counted.
    source_texts = ENGLISH + GERMAN + TEXTS + ["ß", "öß", ">>x<<", ">>x<<ß", "x" * 400, ">>x<< " + "a b " * 200]
    # Targets as the model writes them, then random ids (pieces target.spm does not know, specials, ids after end).
    targets = tokenizer.encode(GERMAN, add_start=True, target=True)
    rng = np.random.default_rng(1)
    random_rows = rng.integers(0, tokenizer.vocabulary_size, size=(300, 12)).tolist()
    sequences = padded(targets + [[tokenizer.start_id] + row for row in random_rows])
    request = {
        "directory": str(onnx_dir), "texts": TEXTS, "searches": SEARCHES, "encode": paths["encode"],
        "decode": paths["decode"], "source_texts": source_texts, "sequences": sequences.tolist(),
    }
    result = subprocess.run(
        [sys.executable, "-c", ONNX_CHILD], input=json.dumps(request), capture_output=True, text=True, timeout=600,
        cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    answer.update(source_texts=source_texts, sequences=sequences)
    return answer


@pytest.mark.slow
def test_onnx_export_holds_the_marian_tokenizer_and_is_validated_with_the_logits_bias(onnx_dir, model, preset_dir):
    files = {path.name for path in onnx_dir.iterdir()}
    assert {"source.spm", "target.spm", "vocab.json", "marian_tokenizer.json", "translate.onnx"} <= files
    assert "tokenizer.model" not in files
    assert load_tokenizer(onnx_dir).pieces() == model.tokenizer.pieces()
    config = json.loads((onnx_dir / "config.json").read_text())
    assert config["model_config"]["activation"] == "silu"
    assert config["model_config"]["position_encoding"] == "sinusoidal_halves"
    assert config["model_config"]["logits_bias"] is True
    # SiLU converts as x * sigmoid(x): TensorFlow's Sigmoid and Mul, which ONNX has.
    import onnx

    encoder = onnx.load(str(onnx_dir / "encoder.onnx"), load_external_data=False)
    assert "Sigmoid" in {node.op_type for node in encoder.graph.node}
    # The validation sees the logits bias: against the same model without it, the decoder step differs.
    unbiased = kt.TransformerModel.from_preset(preset_dir, dropout=0.0)
    unbiased.logits_bias_weight.assign(np.zeros((model.vocabulary_size,), "float32"))
    with pytest.raises(ValidationError, match=r"decoder_step\.onnx output logits"):
        validate_onnx(onnx_dir, unbiased)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["runtime", "graph"])
@pytest.mark.parametrize("search", list(SEARCHES))
def test_onnx_translations_equal_the_keras_translator(onnx_results, expected, engine, search):
    """OnnxTranslator (framework-free) and translate.onnx give the Keras Translator's strings."""
    assert onnx_results[engine][search] == expected[search]
    assert all(expected[search][:10])  # real sentences, not empty strings


@pytest.mark.slow
def test_the_text_graph_tokenizes_as_the_translator(onnx_results, keras_translator):
    """translate.onnx's source ids (what its search receives) are `Translator.encode`'s, on both test splits."""
    texts = onnx_results["source_texts"]
    expected = keras_translator.encode(texts)
    has_pieces = onnx_results["encoded"]["has_pieces"]
    assert has_pieces == [len(ids) > 1 for ids in expected]
    rows = iter(onnx_results["encoded"]["ids"])
    for text, ids, kept in zip(texts, expected, has_pieces):
        if kept:
            row = next(rows)
            assert row[: len(ids)] == ids and not any(row[len(ids):]), text
    # The cases that need more than a Gather from source.spm's ids: vocab.json pieces source.spm does not know.
    unk = keras_translator.tokenizer.unk_id
    assert keras_translator.encode(["ß"])[0][-2] != unk and keras_translator.encode(["öß"])[0][-2] == unk


@pytest.mark.slow
def test_the_text_graph_detokenizes_as_the_marian_tokenizer(onnx_results, tokenizer):
    assert onnx_results["decoded"] == tokenizer.decode(onnx_results["sequences"])


# --------------------------------------------------------------------------- #
# translate.onnx refuses a multilingual vocabulary, in one line
# --------------------------------------------------------------------------- #
def test_a_multilingual_vocabulary_is_refused_for_the_text_graph(model, tokenizer, onnx_dir, tmp_path, monkeypatch,
                                                                  capsys):
    many = multilingual(tokenizer)
    assert many.language_codes == [">>de<<", ">>fr<<"]
    with pytest.raises(ValueError, match=r"multilingual model \(2 target-language codes.*OnnxTranslator"):
        text_graph.check_tokenizer(many)
    # An existing export: translate.onnx is refused, the export kept.
    copy = tmp_path / "copy"
    shutil.copytree(onnx_dir, copy, ignore=shutil.ignore_patterns("translate.onnx"))
    many.save(copy)
    with pytest.raises(ValueError, match="multilingual"):
        text_graph.write_text_graph(copy)
    assert not (copy / "translate.onnx").exists() and (copy / "config.json").is_file()

    # python -m export.onnx --with-tokenizer: refused in one line before any graph is converted.
    multilingual_model = kt.TransformerModel.from_config(model.get_config())
    multilingual_model.tokenizer = many

    monkeypatch.setattr(onnx_export, "_load_model", lambda preset: multilingual_model)
    refuse_graph_conversion(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        onnx_export.main(["--preset", "unused", "--output", str(tmp_path / "new"), "--with-tokenizer"])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "multilingual" in error and "OnnxTranslator" in error
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- #
# CTranslate2
# --------------------------------------------------------------------------- #
CT2_SENTENCES = 16


@pytest.fixture(scope="module")
def ct2_dir(tmp_path_factory, preset_dir):
    # Validated at export: files, log-probabilities (1e-3) and greedy tokens against Keras.
    return ct2_export.export_ctranslate2(
        preset_dir, tmp_path_factory.mktemp("ct2") / "model", validation_sentences=CT2_SENTENCES
    )


@pytest.fixture(scope="module")
def ct2_translator(ct2_dir):
    return ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1, inter_threads=1)


@pytest.mark.slow
def test_ctranslate2_export_is_validated_with_the_imported_vocabulary(ct2_dir, model, tokenizer):
    metadata = ct2_export.read_metadata(ct2_dir)
    validation = metadata["validation"]
    assert validation["identical"] == validation["sentences"] == CT2_SENTENCES and validation["exact"]
    assert validation["largest_log_prob_difference"] < 1e-4
    assert metadata["tokenizer"] == "marian_tokenizer.json" and metadata["logits_bias"]
    assert all((ct2_dir / name).is_file() for name in metadata["tokenizer_files"])
    assert json.loads((ct2_dir / "shared_vocabulary.json").read_text()) == tokenizer.pieces()
    assert ct2_export.activation(model) == "SWISH"
    # The projection bias is the model's logits bias, the pad and start ids suppressed.
    bias = ct2_export.projection_bias(model)
    expected = keras.ops.convert_to_numpy(model.logits_bias_weight).copy()
    expected[[model.pad_id, model.start_id]] = ct2_export.SUPPRESSED_LOGIT
    np.testing.assert_array_equal(bias, expected)


@pytest.mark.slow
def test_ctranslate2_greedy_translations_equal_the_keras_translator(ct2_translator, tokenizer, model, expected):
    """The serving route: MarianTokenizer's pieces (no end piece) -> CTranslate2 -> MarianTokenizer.decode."""
    texts = [text for text in TEXTS if text.strip()]
    ids = tokenizer.encode(texts, add_end=False)
    for text, row in zip(texts, ids):  # SentencePiece alone gives the same pieces
        assert [tokenizer.id_of(piece) for piece in ct2_export.source_pieces(tokenizer, text)] == row, text
    outputs = ct2_export._ctranslate2_outputs(
        ct2_translator, tokenizer.pieces(), ids, model.max_sequence_length, beam_size=1, length_penalty=0.6
    )
    translations = tokenizer.decode([[model.start_id, *output, model.end_id] for output in outputs])
    assert translations == [want for text, want in zip(TEXTS, expected["greedy"]) if text.strip()]


@pytest.mark.slow
def test_ctranslate2_beam_search_agrees_where_the_searches_do(ct2_dir, model):
    """Beam 4, alpha 0: CTranslate2's search differs from ours by design (see export/ctranslate2.py)."""
    report = ct2_export.validate_ctranslate2(ct2_dir, model, sentences=CT2_SENTENCES, beam_size=4, length_penalty=0.0)
    assert report["identical"] >= CT2_SENTENCES // 2, report
    assert report["largest_log_prob_difference"] < 1e-4


def test_ctranslate2_exports_a_multilingual_vocabulary(marian_trained, tokenizer, tmp_path):
    """The validation sentences start with the vocabulary's codes, which its tokenizer requires."""
    model = kt.TransformerModel.from_preset(marian_trained, dropout=0.0)
    model.tokenizer = multilingual(tokenizer)
    output = ct2_export.export_ctranslate2(model, tmp_path / "multilingual", validation_sentences=4)
    validation = ct2_export.read_metadata(output)["validation"]
    assert validation["identical"] == validation["sentences"] == 4 and validation["exact"]
    texts, ids = ct2_export._validation_sources(model, 4)
    assert [text.split()[0] for text in texts] == [">>de<<", ">>fr<<", ">>de<<", ">>fr<<"]
    assert [row[0] for row in ids] == [model.tokenizer.id_of(">>de<<"), model.tokenizer.id_of(">>fr<<")] * 2


def test_ctranslate2_maps_gelu_and_the_halves_layout_exactly(tmp_path):
    """The other imported options on a small random model (no tokenizer: random ids), validated at export."""
    from conftest import tiny_model

    model = tiny_model(activation="gelu", position_encoding="sinusoidal_halves", logits_bias=True, max_sequence_length=24)
    model.logits_bias_weight.assign(np.random.default_rng(3).normal(0.0, 1.0, (model.vocabulary_size,)))
    output = ct2_export.export_ctranslate2(model, tmp_path / "gelu", validation_sentences=8)
    validation = ct2_export.read_metadata(output)["validation"]
    assert validation["identical"] == 8 and validation["largest_log_prob_difference"] < 1e-4
    assert ct2_export.activation(model) == "GELU"


# --------------------------------------------------------------------------- #
# SavedModel
# --------------------------------------------------------------------------- #
def translate(loaded, texts):
    translation = loaded.signatures["translate"](text=tf.constant(texts, tf.string))["translation"]
    return [text.decode("utf-8") for text in translation.numpy()]


@pytest.mark.slow
def test_saved_model_translates_as_the_keras_translator_with_beam_search(tmp_path, preset_dir, expected):
    output = saved_model_export.export_saved_model(preset_dir, tmp_path / "beam4")
    config = json.loads((output / "config.json").read_text())
    assert config["tokenizer"] == "marian_tokenizer.json"
    assert all((output / name).is_file() for name in config["tokenizer_files"])
    assert translate(tf.saved_model.load(str(output)), TEXTS) == expected["beam4"]


@pytest.mark.slow
def test_saved_model_cli_from_the_checkpoint_directory_greedy(tmp_path, marian_trained):
    """`python -m export.saved_model --preset <Hugging Face checkpoint directory>`."""
    output = tmp_path / "greedy"
    assert saved_model_export.main(["--preset", str(marian_trained), "--output", str(output), "--beam-size", "1"]) == 0
    expected = kt.Translator.from_preset(marian_trained).translate(TEXTS[:4], beam_size=1)
    assert translate(tf.saved_model.load(str(output)), TEXTS[:4]) == expected


def test_saved_model_tokenizer_is_the_marian_tokenizer(tokenizer):
    """The in-graph tokenizer's ids and strings: `MarianTokenizer.encode` (no end id) and `.decode`."""
    tokenize, detokenize = saved_model_export._in_graph_tokenizer(tf.Module(), tokenizer)
    texts = ENGLISH + GERMAN + TEXTS + ["ß", "öß", ">>x<<", ">>x<<ß"]
    assert tokenize(tf.constant(texts)).to_list() == tokenizer.encode(texts, add_end=False)
    targets = tokenizer.encode(GERMAN, add_start=True, target=True)
    random_rows = np.random.default_rng(2).integers(0, tokenizer.vocabulary_size, size=(300, 12)).tolist()
    sequences = padded(targets + [[tokenizer.start_id] + row for row in random_rows])
    decoded = [text.decode("utf-8") for text in detokenize(tf.constant(sequences)).numpy()]
    assert decoded == tokenizer.decode(sequences)


def test_saved_model_refuses_a_multilingual_vocabulary(model, tokenizer, tmp_path):
    output = tmp_path / "multilingual"
    with pytest.raises(ValueError, match=r"multilingual model \(2 target-language codes.*OnnxTranslator"):
        saved_model_export.export_saved_model(model, output, tokenizer=multilingual(tokenizer))
    assert not output.exists()
