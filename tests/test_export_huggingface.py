"""Exporting as a Hugging Face `MarianMTModel` checkpoint, measured against `transformers` itself.

The paper's model (ReLU, interleaved sinusoids, no logits bias) exports
exactly once its residual-stream features are permuted: `MarianMTModel`'s
logits equal ours within 1e-4 and greedy `generate` gives our tokens; left
unpermuted they do not (the permutation is what makes it exact). An
imported Marian checkpoint goes back out with its own ids and files, its
tensors equal to the original's; fine-tuned, it still exports exactly.
"""

import json
import shutil

import keras
import numpy as np
import pytest

from conftest import to_numpy, tiny_model

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import keras_transformer as kt  # noqa: E402
from export import huggingface  # noqa: E402
from export.contract import ValidationError  # noqa: E402
from export.huggingface import UnsupportedModelError, export_huggingface  # noqa: E402

SENTENCES = ["the cat sees a dog.", "my bird likes the big fish.", "a dog eats a red ball."]


def hf_logits(directory, sources, targets, to_hf):
    """`MarianMTModel.from_pretrained(directory)`'s logits for our ids (mapped by `to_hf`)."""
    model = transformers.MarianMTModel.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(to_hf[sources]), attention_mask=torch.tensor(sources != 0),
                     decoder_input_ids=torch.tensor(to_hf[targets])).logits.numpy()


def batch(rows):
    out = np.zeros((len(rows), max(map(len, rows))), "int32")
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@pytest.fixture(scope="module")
def paper_export(tiny_preset_dir, tmp_path_factory):
    """`tiny_preset_dir` (ReLU, interleaved sinusoids, no logits bias, our tokenizer) exported (validated)."""
    return export_huggingface(tiny_preset_dir, tmp_path_factory.mktemp("hf") / "paper", validation_sentences=3)


def test_the_paper_model_exports_exactly(paper_export, tiny_preset_dir):
    """Logits within 1e-4 at every position and id, the same greedy tokens, MarianTokenizer gives our ids."""
    model = kt.TransformerModel.from_preset(tiny_preset_dir)
    assert (model.activation, model.position_encoding, model.logits_bias) == ("relu", "sinusoidal", False)
    files = {path.name for path in paper_export.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
            "tokenizer_config.json", "README.md"} <= files
    config = json.loads((paper_export / "config.json").read_text())
    assert (config["activation_function"], config["pad_token_id"], config["eos_token_id"],
            config["decoder_start_token_id"]) == ("relu", 0, 3, 2)

    # The tokenizer: MarianTokenizer on the exported files gives our ids (the identity map).
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(paper_export))
    assert tokenizer(SENTENCES)["input_ids"] == model.tokenizer.encode(SENTENCES)

    # Logits, teacher-forced, every position and vocabulary entry.
    sources = batch(model.tokenizer.encode(SENTENCES))
    rng = np.random.default_rng(1)
    targets = np.concatenate([np.full((3, 1), 2), rng.integers(4, model.vocabulary_size, (3, 9))], 1).astype("int32")
    ours = to_numpy(model({"encoder_token_ids": sources, "decoder_token_ids": targets}))
    theirs = hf_logits(paper_export, sources, targets, np.arange(model.vocabulary_size))
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 1.0  # not vacuous

    # Greedy: generate == our generate, token for token (one sentence at a time: no padding).
    reference = transformers.MarianMTModel.from_pretrained(str(paper_export)).eval()
    generated = to_numpy(model.generate(sources, beam_size=1, max_extra_length=10))  # each row's own maximum
    for source, ours in zip(model.tokenizer.encode(SENTENCES), generated.tolist()):
        with torch.no_grad():
            theirs = reference.generate(input_ids=torch.tensor([source]), num_beams=1, do_sample=False,
                                        max_length=len(source) + 11)[0].tolist()
        assert theirs == ours[: len(theirs)] and ours[len(theirs):] == [0] * (len(ours) - len(theirs))
        assert theirs[-1] == 3  # ended (forced at the maximum length on both sides)
        # and MarianTokenizer decodes them (its start piece <s> included) as ours does.
        assert tokenizer.batch_decode([theirs], skip_special_tokens=True) == model.tokenizer.decode([ours])

    # The export's own validation recorded the same.
    record = json.loads((paper_export / huggingface.METADATA_FILE).read_text())
    assert record["validation"]["greedy_identical"] == record["validation"]["sentences"] >= 3
    assert record["validation"]["largest_logits_difference"] <= 1e-4


def test_without_the_feature_permutation_the_logits_differ(tiny_preset_dir, tmp_path, monkeypatch):
    """The permutation is what makes the export exact: left out, validation fails and nothing is written."""
    model = kt.TransformerModel.from_preset(tiny_preset_dir)
    monkeypatch.setattr(huggingface, "feature_permutation", lambda model: np.arange(model.hidden_dim))
    with pytest.raises(ValidationError, match=r"logits .* differ from Keras' .* by \S+ > atol=0.0001"):
        export_huggingface(model, tmp_path / "unpermuted")
    assert not (tmp_path / "unpermuted").exists()
    assert [path.name for path in tmp_path.iterdir()] == []  # the staging directory is gone too


def test_the_paper_model_imports_back(paper_export, tiny_preset_dir):
    """Our importer reads the export (Marian's halves layout now): the same logits and translations."""
    model = kt.TransformerModel.from_preset(tiny_preset_dir)
    imported = kt.TransformerModel.from_preset(paper_export)
    assert imported.position_encoding == "sinusoidal_halves" and imported.vocabulary_size == model.vocabulary_size
    sources = batch(model.tokenizer.encode(SENTENCES))
    targets = batch([[2, 5, 9, 11, 7]] * 3)
    inputs = {"encoder_token_ids": sources, "decoder_token_ids": targets}
    np.testing.assert_allclose(to_numpy(imported(inputs)), to_numpy(model(inputs)), atol=1e-4, rtol=0)
    assert imported.tokenizer.encode(SENTENCES) == model.tokenizer.encode(SENTENCES)


def test_the_built_in_tiny_preset_exports_exactly(tmp_path):
    """The paper's architecture as the `tiny` preset (random init, dropout 0.1 kept in config.json)."""
    keras.utils.set_random_seed(3)
    model = kt.TransformerModel.from_preset("tiny")
    directory = export_huggingface(model, tmp_path / "hf", validation_sentences=2)
    config = json.loads((directory / "config.json").read_text())
    assert (config["d_model"], config["encoder_layers"], config["activation_function"], config["dropout"]) == (
        64, 2, "relu", model.dropout)
    rng = np.random.default_rng(0)
    sources = np.concatenate([rng.integers(4, 1000, (2, 7)), np.full((2, 1), 3)], 1).astype("int32")
    targets = np.concatenate([np.full((2, 1), 2), rng.integers(4, 1000, (2, 5))], 1).astype("int32")
    ours = to_numpy(model({"encoder_token_ids": sources, "decoder_token_ids": targets}))
    theirs = hf_logits(directory, sources, targets, np.arange(1000))
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_a_model_without_tokenizer_exports_the_model_files(tmp_path):
    model = tiny_model(activation="gelu", logits_bias=True)
    model.logits_bias_weight.assign(np.random.default_rng(0).normal(size=model.vocabulary_size).astype("float32"))
    directory = export_huggingface(model, tmp_path / "hf", validation_sentences=2)
    names = {path.name for path in directory.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= names
    assert not names & {"vocab.json", "source.spm", "tokenizer_config.json"}
    assert json.loads((directory / "config.json").read_text())["activation_function"] == "gelu"
    validation = json.loads((directory / huggingface.METADATA_FILE).read_text())["validation"]
    assert validation["largest_logits_difference"] <= 1e-4


# ---------------------------------------------------------------------- #
# Imported Marian checkpoints go back out with their own ids and files
# ---------------------------------------------------------------------- #
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_an_imported_marian_checkpoint_round_trips(kind, request, tmp_path):
    """Tensors equal to the original's (float32), its own files; the trained one's greedy outputs end with </s>."""
    from safetensors.numpy import load_file

    marian_random = request.getfixturevalue(f"marian_{kind}")  # built once per machine (conftest.build_once)
    model = kt.TransformerModel.from_preset(marian_random)
    directory = export_huggingface(model, tmp_path / "hf", validation_sentences=3)
    original, exported = (load_file(str(path / "model.safetensors")) for path in (marian_random, directory))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor.astype("float32"), err_msg=name)
    for name in ("source.spm", "target.spm"):
        assert (directory / name).read_bytes() == (marian_random / name).read_bytes()
    assert json.loads((directory / "vocab.json").read_text()) == json.loads((marian_random / "vocab.json").read_text())
    ours, theirs = (json.loads((path / "config.json").read_text()) for path in (directory, marian_random))
    for key in ("vocab_size", "d_model", "activation_function", "pad_token_id", "eos_token_id",
                "decoder_start_token_id", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "scale_embedding"):
        assert ours[key] == theirs[key], key
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["bad_words_ids"] == [[theirs["pad_token_id"]]]
    # The checkpoint's languages go back out, in tokenizer_config.json and the model card.
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (tokenizer_config["source_lang"], tokenizer_config["target_lang"]) == ("en", "de")
    assert "language:\n- en\n- de\n" in (directory / "README.md").read_text()
    if kind == "trained":  # the export's greedy comparison was of whole translations
        from export.ctranslate2 import _keras_outputs, _validation_sources

        _, sources = _validation_sources(model, 3)
        lengths = [len(output) for output in _keras_outputs(model, sources, 1, 0.0)]
        assert all(length < len(source) + 20 for length, source in zip(lengths, sources)), lengths


@pytest.mark.slow
def test_a_fine_tuned_imported_model_exports(marian_random, tmp_path):
    """After a few training steps the start row (Marian's <pad>) no longer equals our pad row: still exact."""
    model = kt.TransformerModel.from_preset(marian_random, dropout=0.0)
    tokenizer = model.tokenizer
    keras.utils.set_random_seed(0)
    sources = batch(tokenizer.encode(["Open the file.", "Click OK."]))
    labels = batch(tokenizer.encode(["Öffnen Sie die Datei.", "Klicken Sie auf OK."], target=True))
    targets = np.concatenate([np.full((2, 1), tokenizer.start_id, "int32"), labels[:, :-1]], axis=1)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    model.fit({"encoder_token_ids": sources, "decoder_token_ids": targets}, labels, epochs=3, verbose=0)
    embeddings = to_numpy(model.token_embedding.embeddings)
    assert not np.allclose(embeddings[tokenizer.start_id], embeddings[tokenizer.pad_id])
    directory = export_huggingface(model, tmp_path / "hf", validation_sentences=3)
    validation = json.loads((directory / huggingface.METADATA_FILE).read_text())["validation"]
    assert validation["largest_logits_difference"] <= 1e-4
    # Marian's <pad> row is our start row (the decoder starts from it).
    from safetensors.numpy import load_file

    shared = load_file(str(directory / "model.safetensors"))["model.shared.weight"]
    np.testing.assert_array_equal(shared[tokenizer.marian_ids[tokenizer.start_id]], embeddings[tokenizer.start_id])


# ---------------------------------------------------------------------- #
# optimum-onnx exports what we wrote
# ---------------------------------------------------------------------- #
OPTIMUM_BLOCKED = (
    "optimum-onnx is not importable here: its only release (0.1.0) requires transformers<4.58 and this project "
    "transformers>=5 (huggingface/optimum-onnx#114); set KT_OPTIMUM_PYTHON to a Python that has optimum-onnx"
)


def optimum_python():
    """A Python with `optimum.onnxruntime`: KT_OPTIMUM_PYTHON, else this one if it has it, else None."""
    import importlib.util
    import os
    import sys

    if os.environ.get("KT_OPTIMUM_PYTHON"):
        return os.environ["KT_OPTIMUM_PYTHON"]
    try:
        return sys.executable if importlib.util.find_spec("optimum.onnxruntime") else None
    except ModuleNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(optimum_python() is None, reason=OPTIMUM_BLOCKED)  # before the fixtures are built
def test_optimum_onnx_exports_our_checkpoints_and_translates_as_we_do(paper_export, tiny_preset_dir, marian_trained,
                                                                       tmp_path):
    """optimum's `ORTModelForSeq2SeqLM` exports both directories with its own exporter; greedy equals ours.

    The paper's `tiny` (our tokenizer, identity ids) and an imported trained
    Marian checkpoint exported back (its own ids): optimum's greedy ids, mapped
    to ours, and its decoded texts equal our greedy search's, token for token.
    """
    import pathlib
    import subprocess

    python = optimum_python()
    marian = kt.TransformerModel.from_preset(marian_trained)
    marian_export = export_huggingface(marian, tmp_path / "marian", validation_sentences=3)
    sentences = SENTENCES + ["Select the cells that you want to delete.", "Click OK to close the dialog."]
    extra = 10
    request = {"models": [{"directory": str(path), "output": str(tmp_path / f"optimum-{index}")}
                          for index, path in enumerate((paper_export, marian_export))],
               "sentences": sentences, "max_extra_length": extra}
    script = pathlib.Path(__file__).with_name("optimum_greedy.py")
    run = subprocess.run([python, str(script)], input=json.dumps(request), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout)
    for model, answer in zip((kt.TransformerModel.from_preset(tiny_preset_dir), marian), answers):
        assert {"encoder_model.onnx", "decoder_model.onnx"} <= set(answer["files"])
        tokenizer = model.tokenizer
        sources = tokenizer.encode(sentences)
        generated = to_numpy(model.generate(batch(sources), beam_size=1, max_extra_length=extra)).tolist()
        to_hf = (np.asarray(tokenizer.marian_ids) if getattr(tokenizer, "marian_ids", None) is not None
                 else np.arange(model.vocabulary_size))
        for ours, theirs in zip(generated, answer["ids"]):
            ours = to_hf[np.asarray(ours[: len(theirs)])].tolist() + ours[len(theirs):]
            assert theirs == ours[: len(theirs)] and not any(ours[len(theirs):]), (theirs, ours)
        assert answer["texts"] == tokenizer.decode(generated)
    assert any(len(ids) < len(source) + extra + 1 for ids, source in zip(answers[1]["ids"], sources))  # ended early


@pytest.mark.slow
def test_what_the_training_command_wrote_exports_and_transformers_translates_it_as_we_do(tiny_trained, tmp_path):
    """`python -m keras_transformer.train`'s preset (the Quick start's kind of artifact, at `tiny` size) exports,
    and `MarianMTModel.generate` + `MarianTokenizer` translate the validation sentences to our greedy strings."""
    from conftest import TINY_TRAINED_PARTS

    preset = tiny_trained / TINY_TRAINED_PARTS["preset"]
    directory = export_huggingface(preset, tmp_path / "hf", validation_sentences=3)
    sentences = (tiny_trained / TINY_TRAINED_PARTS["valid"][0]).read_text(encoding="utf-8").splitlines()
    ours = kt.Translator.from_preset(preset).translate(sentences, beam_size=1, max_extra_length=20)
    model, tokenizer = transformers.MarianMTModel.from_pretrained(str(directory)).eval(), \
        transformers.MarianTokenizer.from_pretrained(str(directory))
    theirs = []
    for sentence in sentences:  # one at a time: no padding, each its own maximum length
        source = tokenizer(sentence)["input_ids"]
        with torch.no_grad():
            output = model.generate(input_ids=torch.tensor([source]), num_beams=1, do_sample=False,
                                    max_length=len(source) + 21)
        theirs += tokenizer.batch_decode(output, skip_special_tokens=True)
    assert theirs == ours
    assert len(set(ours)) > 1 and all(ours)  # a trained model's translations, not one repeated string
    assert "training data" in (directory / "README.md").read_text().lower()


# ---------------------------------------------------------------------- #
# Refusals, bad input, validation skipped
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("overrides, message", [
    ({"normalize_first": True}, r"normalize_first=True \(pre-LN\) cannot be exported as a Marian checkpoint"),
    ({"position_encoding": "learned"}, r"position_encoding='learned' cannot be exported"),
    ({"attention_window": 3}, r"attention_window=3 cannot be exported"),
    ({"key_dim": 8}, r"key_dim=8, value_dim=4 cannot be exported"),
    ({"layer_norm_epsilon": 1e-6}, r"layer_norm_epsilon=1e-06 cannot be exported"),
])
def test_what_marian_cannot_express_is_refused_in_one_line(overrides, message, tmp_path):
    with pytest.raises(UnsupportedModelError, match=message) as error:
        export_huggingface(tiny_model(**overrides), tmp_path / "hf")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "hf").exists()


def test_cli_bad_input_is_one_line(tiny_preset_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        huggingface.main(["--preset", str(tmp_path / "missing"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        huggingface.main(["--preset", str(tiny_preset_dir), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "already exists; pass --overwrite" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        huggingface.main(["--preset", str(tiny_preset_dir), "--output", str(tmp_path / "out"), "--overwrite"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is not a Hugging Face Marian checkpoint" in err


def test_overwrite_replaces_an_earlier_export(paper_export, tiny_preset_dir, tmp_path):
    target = tmp_path / "hf"
    shutil.copytree(paper_export, target)
    with pytest.raises(FileExistsError, match="already exists"):
        export_huggingface(tiny_preset_dir, target, validate=False)
    assert huggingface.main(["--preset", str(tiny_preset_dir), "--output", str(target), "--overwrite",
                             "--validation-sentences", "2"]) == 0
    assert json.loads((target / huggingface.METADATA_FILE).read_text())["validation"]["sentences"] == 2


def test_validation_is_skipped_without_transformers(tiny_preset_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(huggingface, "_import_reference", lambda: None)
    directory = export_huggingface(tiny_preset_dir, tmp_path / "hf")
    assert "Validation skipped" in caplog.text
    assert "skipped" in json.loads((directory / huggingface.METADATA_FILE).read_text())["validation"]


def test_model_card_names_the_data_and_scores(tiny_preset_dir, tmp_path):
    metadata = {"data": {"train": ["bundled:libreoffice_en_de/train.en.gz", "bundled:libreoffice_en_de/train.de.gz"],
                         "bundled_corpus": {"name": "libreoffice_en_de", "version": "1:7.4"}},
                "preset": "tiny", "steps": 400, "valid_bleu": 12.3, "valid_bleu_sentences": 100}
    directory = export_huggingface(tiny_preset_dir, tmp_path / "hf", metadata=metadata, validate=False)
    card = (directory / "README.md").read_text()
    assert card.startswith("---\n") and "language:\n- en\n- de\n" in card and "pipeline_tag: translation" in card
    assert "# license:" in card and "validation BLEU: 12.3 (100 sentences)" in card
    assert "libreoffice_en_de/train.en.gz" in card and "training steps: 400" in card
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (tokenizer_config["source_lang"], tokenizer_config["target_lang"]) == ("en", "de")
