"""SavedModel export (export/saved_model.py): translate, encode, init_cache and decode_step signatures."""

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from conftest import to_numpy

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="SavedModel export runs on the TensorFlow backend"
)

import tensorflow as tf  # noqa: E402

import keras_transformer as kt  # noqa: E402
from export import contract  # noqa: E402
from export import saved_model as saved_model_export  # noqa: E402
from keras_transformer.translator import Translator  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = 2
MAX_SEQUENCE_LENGTH = 32  # Short, so that a long text exercises the cut to max_sequence_length.

# A toy English -> German corpus, word by word, with non-ASCII on both sides.
SUBJECTS = [("the cat", "die Katze"), ("a dog", "ein Hund"), ("my bird", "mein Vogel"),
            ("the old fish", "der alte Fisch")]
VERBS = [("sees", "sieht"), ("likes", "mag"), ("greets", "grüßt")]
OBJECTS = [("the cat.", "die Katze."), ("a ball.", "einen Ball."), ("the big tree.", "den großen Baum."),
           ("a red apple.", "einen roten Apfel."), ("the small café.", "das kleine Café.")]
PAIRS = [(f"{s} {v} {o}", f"{ts} {tv} {to}")
         for (s, ts), (v, tv), (o, to) in itertools.product(SUBJECTS, VERBS, OBJECTS)]
# Mixed lengths, non-ASCII, empty and whitespace-only texts (-> ""), an unseen
# word, and one longer than max_sequence_length (cut as Translator cuts it).
TEXTS = [
    "the cat greets the small café.",
    "",
    "a dog sees a red apple.",
    "my bird likes the big tree. the old fish sees the cat. a dog greets a ball.",
    "  \u3000",
    "café",
    "the old fish likes ümlauts.",
]
GREEDY_TEXTS = TEXTS[:4]
SIGNATURE_INPUTS = {name: sorted(graph.input_names()) for name, graph in contract.SAVED_MODEL.graphs.items()}
SIGNATURE_OUTPUTS = {name: sorted(graph.output_names()) for name, graph in contract.SAVED_MODEL.graphs.items()}


def signature_names(signature):
    return sorted(signature.structured_input_signature[1]), sorted(signature.structured_outputs)


def translate(loaded, texts):
    translation = loaded.signatures["translate"](text=tf.constant(texts, tf.string))["translation"]
    return [t.decode("utf-8") for t in translation.numpy()]


@pytest.fixture(scope="module")
def tokenizer():
    return kt.train_tokenizer([text for pair in PAIRS for text in pair], vocabulary_size=80)


@pytest.fixture(scope="module")
def model(tokenizer):
    """Trained briefly (a few seconds) so that translations are real sentences, not repetitions."""
    sources = tokenizer.encode([source for source, _ in PAIRS], add_start=False, add_end=True)
    targets = tokenizer.encode([target for _, target in PAIRS], add_start=True, add_end=True)
    x = np.zeros((len(PAIRS), max(map(len, sources))), "int32")
    y = np.zeros((len(PAIRS), max(map(len, targets))), "int32")
    for row, (source, target) in enumerate(zip(sources, targets)):
        x[row, : len(source)], y[row, : len(target)] = source, target
    keras.utils.set_random_seed(0)
    model = kt.TransformerModel(
        vocabulary_size=tokenizer.vocabulary_size, num_layers=1, num_heads=2, hidden_dim=32,
        intermediate_dim=64, dropout=0.0, max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=kt.LabelSmoothedCrossEntropy(label_smoothing=0.0))
    model.fit({"encoder_token_ids": x, "decoder_token_ids": y[:, :-1]}, y[:, 1:], batch_size=15, epochs=30, verbose=0)
    return model


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory, model, tokenizer):
    directory = tmp_path_factory.mktemp("preset") / "toy"
    model.save_to_preset(directory, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory, preset_dir):
    """Exported from the preset directory with the defaults (beam 4), as the notebooks do."""
    return saved_model_export.export_saved_model(preset_dir, tmp_path_factory.mktemp("saved_model") / "model")


@pytest.fixture(scope="module")
def loaded(exported):
    return tf.saved_model.load(str(exported))


@pytest.fixture(scope="module")
def expected_beam(model, tokenizer):
    return Translator(model, tokenizer).translate(TEXTS, beam_size=4)


# --------------------------------------------------------------------------- #
# The exported directory and its signatures
# --------------------------------------------------------------------------- #
def test_export_writes_a_self_contained_directory(exported, preset_dir, loaded):
    assert {"saved_model.pb", "variables", "config.json", "tokenizer.model"} <= {p.name for p in exported.iterdir()}
    assert (exported / "tokenizer.model").read_bytes() == (preset_dir / "tokenizer.model").read_bytes()
    config = json.loads((exported / "config.json").read_text())
    assert (config["format"], config["format_version"]) == ("keras_transformer.saved_model", 2)
    assert (config["beam_size"], config["length_penalty"], config["max_extra_length"]) == (4, 0.6, 50)
    assert (config["pad_id"], config["unk_id"], config["start_id"], config["end_id"]) == (0, 1, 2, 3)
    assert (config["vocabulary_size"], config["hidden_dim"], config["num_decoder_layers"]) == (80, 32, 1)
    assert (config["num_heads"], config["head_key_dim"], config["max_sequence_length"]) == (2, 16, 32)
    assert set(config["versions"]) == {"keras_transformer", "keras", "tensorflow", "tensorflow_text"}
    assert config["versions"]["keras_transformer"] == kt.__version__
    assert {name: sorted(s["inputs"]) for name, s in config["signatures"].items()} == SIGNATURE_INPUTS
    # Written next to its place and renamed: no staging directory is left.
    assert [p.name for p in exported.parent.iterdir()] == ["model"]

    assert sorted(loaded.signatures) == ["decode_step", "encode", "init_cache", "translate"]
    for name, signature in loaded.signatures.items():
        assert signature_names(signature) == (SIGNATURE_INPUTS[name], SIGNATURE_OUTPUTS[name]), name
    text = loaded.signatures["translate"].structured_input_signature[1]["text"]
    assert (text.shape.as_list(), text.dtype) == ([None], tf.string)
    ids = loaded.signatures["encode"].structured_input_signature[1]["encoder_token_ids"]
    assert (ids.shape.as_list(), ids.dtype) == ([None, None], tf.int32)


def test_signatures_are_the_contract_table(exported, loaded):
    """Every signature's tensors: the contract's names, dtypes and shapes (None where dynamic); config.json too."""
    config = json.loads((exported / "config.json").read_text())
    assert config["signatures"] == contract.describe_graphs(contract.SAVED_MODEL, "float32")
    for name, graph in contract.SAVED_MODEL.graphs.items():
        signature = loaded.signatures[name]
        for specs, tensors in (
            (signature.structured_input_signature[1], graph.inputs), (signature.structured_outputs, graph.outputs)
        ):
            actual = {key: (spec.dtype.name, spec.shape.as_list()) for key, spec in specs.items()}
            expected = {t.name: (contract.dtype(t, "float32"), contract.shape(t, config)) for t in tensors}
            assert actual == expected, name


def test_a_signature_that_deviates_from_the_contract_is_named(model):
    """`check_signature`, which the export runs on every signature: names the signature and the tensor."""

    @tf.function(input_signature=[tf.TensorSpec([None, 7], tf.int32, name="encoder_token_ids")])
    def encode(encoder_token_ids):
        return {"encoder_outputs": model.encode(encoder_token_ids, training=False)}

    sizes = contract.model_fields(model)
    with pytest.raises(contract.ValidationError, match=r"SavedModel signature encode encoder_token_ids axis 1 "
                       r"\(source_length\) is fixed to 7; it must be dynamic"):
        saved_model_export.check_signature("encode", encode.get_concrete_function(), sizes, "float32")


def test_translate_equals_the_translator_with_beam_search(loaded, expected_beam):
    assert translate(loaded, TEXTS) == expected_beam
    # Not degenerate: the toy model translates, non-ASCII included.
    assert expected_beam[0] == "die Katze grüßt das kleine Café."
    assert expected_beam[1] == expected_beam[4] == ""
    assert all(expected_beam[i] for i in (0, 2, 3, 5, 6)) and len(set(expected_beam)) == 6


def test_translate_handles_one_text_and_only_empty_texts(loaded, expected_beam):
    assert translate(loaded, [TEXTS[2]]) == [expected_beam[2]]
    assert translate(loaded, ["", " "]) == ["", ""]
    assert translate(loaded, []) == []


def test_encode_init_cache_and_decode_step_match_keras(loaded, model):
    rng = np.random.default_rng(0)
    src = rng.integers(4, 80, size=(3, 7)).astype("int32")
    src[:, -1], src[1, 4:], src[2, 2:] = 3, [3, 0, 0], [3, 0, 0, 0, 0]  # Mixed lengths.
    signatures = loaded.signatures
    encoder_outputs = signatures["encode"](encoder_token_ids=tf.constant(src))["encoder_outputs"]
    expected = to_numpy(model.encode(src))
    assert encoder_outputs.shape == expected.shape == (3, 7, 32)
    np.testing.assert_allclose(encoder_outputs.numpy(), expected, atol=1e-5, rtol=0)

    max_length = 6
    cache = signatures["init_cache"](
        encoder_outputs=tf.constant(expected), encoder_token_ids=tf.constant(src), max_length=tf.constant(max_length)
    )
    keras_cache = model.init_cache(expected, src, max_length)
    assert sorted(cache) == sorted(keras_cache)
    for name in cache:
        np.testing.assert_allclose(cache[name].numpy(), to_numpy(keras_cache[name]), atol=1e-5, rtol=0)
    tokens = np.full((3,), START, np.int32)
    for step in range(4):
        outputs = signatures["decode_step"](decoder_token_ids=tf.constant(tokens), step=tf.constant(step), **cache)
        keras_logits, keras_cache = model.decode_step(tokens, step, keras_cache)
        assert outputs["logits"].shape == (3, 80) and outputs["logits"].dtype == tf.float32
        np.testing.assert_allclose(outputs["logits"].numpy(), to_numpy(keras_logits), atol=1e-5, rtol=0)
        for name in ("self_key", "self_value"):
            np.testing.assert_allclose(
                outputs[f"updated_{name}"].numpy(), to_numpy(keras_cache[name]), atol=1e-5, rtol=0
            )
        cache = dict(cache, self_key=outputs["updated_self_key"], self_value=outputs["updated_self_value"])
        tokens = rng.integers(4, 80, 3).astype(np.int32)


LOAD_WITHOUT_THIS_PACKAGE = textwrap.dedent(
    """
    import importlib.util, json, os, sys

    # Neither this package nor Keras may be imported.
    for name in ("keras_transformer", "export", "keras", "tf_keras", "keras_hub"):
        sys.modules[name] = None
    import tensorflow as tf

    # `import tensorflow_text` is the usual way to register its ops, but it
    # imports Keras itself (for its Keras layers); the SavedModel needs only
    # the SentencePiece ops, so load that library alone.
    package = os.path.dirname(importlib.util.find_spec("tensorflow_text").origin)
    tf.load_op_library(os.path.join(package, "python", "ops", "_sentencepiece_tokenizer.so"))
    loaded = tf.saved_model.load(sys.argv[1])
    texts = json.loads(sys.argv[2])
    translation = loaded.signatures["translate"](text=tf.constant(texts))["translation"]
    ids = tf.constant(json.loads(sys.argv[3]), tf.int32)
    encoder_outputs = loaded.signatures["encode"](encoder_token_ids=ids)["encoder_outputs"]
    print(json.dumps({
        "translation": [t.decode("utf-8") for t in translation.numpy()],
        "encoder_outputs": encoder_outputs.numpy().tolist(),
        "imported": sorted(m for m in ("keras", "keras_transformer", "tf_keras") if sys.modules.get(m) is not None),
    }))
    """
)


def test_loads_and_translates_without_keras_or_this_package(exported, model, tmp_path, expected_beam):
    src = [[5, 9, 11, 3], [7, 3, 0, 0]]
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_WITHOUT_THIS_PACKAGE, str(exported), json.dumps(TEXTS), json.dumps(src)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout.strip().splitlines()[-1])
    assert output["imported"] == []
    assert output["translation"] == expected_beam
    np.testing.assert_allclose(np.array(output["encoder_outputs"]), to_numpy(model.encode(np.array(src))), atol=1e-5)


# --------------------------------------------------------------------------- #
# CLI, overwriting, atomicity, errors
# --------------------------------------------------------------------------- #
def test_cli_refuses_to_overwrite_then_replaces_with_a_greedy_export(exported, preset_dir, model, tokenizer,
                                                                     tmp_path, capsys):
    output = tmp_path / "copy"
    shutil.copytree(exported, output)
    before = {p.name: p.stat().st_mtime_ns for p in output.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        saved_model_export.main(["--preset", str(preset_dir), "--output", str(output)])
    assert exit_info.value.code == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match=r"already exists; pass overwrite=True \(--overwrite\)"):
        saved_model_export.export_saved_model(preset_dir, output)
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir()} == before

    argv = ["--preset", str(preset_dir), "--output", str(output), "--overwrite", "--beam-size", "1",
            "--max-extra-length", "10"]
    assert saved_model_export.main(argv) == 0
    config = json.loads((output / "config.json").read_text())
    assert (config["beam_size"], config["max_extra_length"]) == (1, 10)
    expected = Translator(model, tokenizer).translate(GREEDY_TEXTS, beam_size=1, max_extra_length=10)
    assert translate(tf.saved_model.load(str(output)), GREEDY_TEXTS) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]


def test_a_failed_export_leaves_the_old_directory_and_no_temporary_one(exported, model, tokenizer, tmp_path,
                                                                       monkeypatch):
    output = tmp_path / "copy"
    shutil.copytree(exported, output)
    before = {p.name: p.read_bytes() for p in output.iterdir() if p.is_file()}

    def failing_config(*args):
        (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".copy.tmp-")]
        assert (staging / "saved_model.pb").is_file()  # Midway: the SavedModel is written.
        raise RuntimeError("simulated failure mid-export")

    monkeypatch.setattr(saved_model_export, "_config", failing_config)
    with pytest.raises(RuntimeError, match="simulated failure mid-export"):
        saved_model_export.export_saved_model(model, output, tokenizer=tokenizer, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]
    assert {p.name: p.read_bytes() for p in output.iterdir() if p.is_file()} == before


def test_bad_arguments_are_clear_errors_and_write_nothing(model, tokenizer, tmp_path, monkeypatch):
    output = tmp_path / "out"
    with pytest.raises(ValueError, match=r"beam_size=0 must be an integer >= 1"):
        saved_model_export.export_saved_model(model, output, tokenizer=tokenizer, beam_size=0)
    with pytest.raises(ValueError, match=r"length_penalty=-1 must be a finite number >= 0"):
        saved_model_export.export_saved_model(model, output, tokenizer=tokenizer, length_penalty=-1)
    with pytest.raises(ValueError, match=r"without a tokenizer \(the model has no tokenizer attached\).*tokenizer="):
        saved_model_export.export_saved_model(model, output)
    with pytest.raises(ValueError, match=r"'tiny' is a built-in architecture preset.*save_to_preset"):
        saved_model_export.export_saved_model("tiny", output)
    model.save_to_preset(tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match=r"no_tokenizer' has no tokenizer\.model"):
        saved_model_export.export_saved_model(tmp_path / "no_tokenizer", output)
    other = kt.train_tokenizer([text for pair in PAIRS for text in pair], vocabulary_size=70)
    with pytest.raises(ValueError, match="tokenizer has 70 pieces but the model's vocabulary_size is 80"):
        saved_model_export.export_saved_model(model, output, tokenizer=other)
    with pytest.raises(TypeError, match="preset_or_model must be a preset name, a preset directory or a "
                                        "TransformerModel, received int"):
        saved_model_export.export_saved_model(3, output, tokenizer=tokenizer)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND is 'jax'. Run with KERAS_BACKEND=tensorflow"):
        saved_model_export.export_saved_model(model, output, tokenizer=tokenizer)
    assert [p.name for p in tmp_path.iterdir()] == ["no_tokenizer"]


def test_cli_explains_a_missing_tokenizer(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        saved_model_export.main(["--preset", "tiny", "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    assert "error: Cannot export a SavedModel without a tokenizer ('tiny' is a built-in" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "export.saved_model", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--preset", "--output", "--overwrite", "--beam-size", "--length-penalty", "--max-extra-length"):
        assert flag in result.stdout
