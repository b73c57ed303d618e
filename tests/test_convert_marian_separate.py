"""Marian checkpoints with separate source and target vocabularies (transformers PR #15831).

`share_encoder_decoder_embeddings: false`, `decoder_vocab_size`, and in the
tokenizer `separate_vocabs: true` with `target_vocab.json`. The reference is
`MarianMTModel` / `MarianTokenizer` built in-process (fixtures
`marian_separate_random` and `marian_separate_trained` in conftest.py: the
source vocabulary has 400 entries, the target's 300, so the two `<pad>`s and
every ordinary id differ). Our model is `TransformerModel(source_vocabulary_size=...)`.
"""

import json
import shutil

import keras
import numpy as np
import pytest

from conftest import SENTENCES, padded, to_numpy
from conftest import hf_marian_model as hf_model, hf_marian_tokenizer as hf_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import keras_transformer as kt  # noqa: E402
from keras_transformer.convert import CheckpointError  # noqa: E402
from keras_transformer.datasets import load_bundled  # noqa: E402
from keras_transformer.tokenizers.marian import MarianTokenizer  # noqa: E402


def hf_logits(model, tokenizer, sources, targets):
    """HF's logits for our source and target ids (renumbered to Marian's), in our target order."""
    source_pad = tokenizer.vocab[tokenizer.pad_token]  # the source vocabulary's <pad>, not the config's
    source = padded([tokenizer.source_marian_ids[s] for s in sources], source_pad)
    target = padded([tokenizer.marian_ids[t] for t in targets], model.config.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(source), attention_mask=torch.tensor(source != source_pad),
                       decoder_input_ids=torch.tensor(target)).logits.numpy()
    return logits[..., tokenizer.marian_ids]


@pytest.fixture(scope="module")
def imported_random(marian_separate_random):
    return kt.TransformerModel.from_preset(marian_separate_random)


@pytest.fixture(scope="module")
def imported_trained(marian_separate_trained):
    return kt.TransformerModel.from_preset(marian_separate_trained)


# ---------------------------------------------------------------------- #
# The model option
# ---------------------------------------------------------------------- #
def test_source_vocabulary_size_gives_the_encoder_a_table_of_its_own():
    shared = kt.TransformerModel.from_preset("tiny")
    assert shared.source_token_embedding is None and "source_vocabulary_size" not in shared.get_config()
    separate = kt.TransformerModel.from_preset("tiny", source_vocabulary_size=1300)
    hidden = separate.hidden_dim
    # One more table, [1300, D]; the decoder's [V, D] stays tied to the output projection (no [D, V] kernel).
    assert separate.count_params() - shared.count_params() == 1300 * hidden
    assert separate.source_token_embedding.embeddings.shape == (1300, hidden)
    assert separate.encoder_vocabulary_size == 1300 and separate.vocabulary_size == 1000
    source = np.array([[1250, 6, 3]], "int32")  # an id only the source vocabulary has
    target = np.array([[2, 7, 9]], "int32")
    logits = to_numpy(separate({"encoder_token_ids": source, "decoder_token_ids": target}))
    assert logits.shape == (1, 3, 1000)
    # The encoder reads its own table: changing it changes the outputs, as the decoder's table does.
    table = to_numpy(separate.source_token_embedding.embeddings)
    separate.source_token_embedding.embeddings.assign(table * 0.0)
    changed = to_numpy(separate({"encoder_token_ids": source, "decoder_token_ids": target}))
    assert np.abs(changed - logits).max() > 1e-3
    with pytest.raises(ValueError, match="decoder_token_ids"):
        separate({"encoder_token_ids": source, "decoder_token_ids": np.array([[2, 1250]], "int32")})
    round_trip = kt.TransformerModel.from_config(separate.get_config())
    assert round_trip.get_config() == separate.get_config()
    assert round_trip.get_config()["source_vocabulary_size"] == 1300
    with pytest.raises(ValueError, match="source_vocabulary_size=0"):
        kt.TransformerModel.from_preset("tiny", source_vocabulary_size=0)


# ---------------------------------------------------------------------- #
# The model: logits, cached decoding, greedy search against transformers
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_logits_equal_hugging_face(kind, request):
    model = request.getfixturevalue(f"imported_{kind}")
    tokenizer = model.tokenizer
    assert tokenizer.separate_vocabs and model.source_vocabulary_size == tokenizer.source_vocabulary_size
    assert model.source_vocabulary_size != model.vocabulary_size
    reference = hf_model(request.getfixturevalue(f"marian_separate_{kind}"))
    sources = tokenizer.encode(SENTENCES)
    rng = np.random.default_rng(0)
    lengths = [9, 4, 12, 7]
    targets = [[tokenizer.start_id] + rng.integers(4, model.vocabulary_size, size=n - 1).tolist() for n in lengths]
    ours = to_numpy(model({"encoder_token_ids": padded(sources, 0).astype("int32"),
                           "decoder_token_ids": padded(targets, 0).astype("int32")}))
    theirs = hf_logits(reference, tokenizer, sources, targets)
    for row, length in enumerate(lengths):  # padded target positions differ by design (HF masks no target)
        np.testing.assert_allclose(ours[row, :length], theirs[row, :length], atol=1e-4, rtol=0)


def test_cached_decoding_equals_hugging_face_step_by_step(imported_trained, marian_separate_trained):
    model, tokenizer = imported_trained, imported_trained.tokenizer
    reference = hf_model(marian_separate_trained)
    source = tokenizer.encode(SENTENCES[:1])
    target = [[tokenizer.start_id] + tokenizer.encode(["Öffnen Sie die Datei"], add_end=False, target=True)[0]]
    theirs = hf_logits(reference, tokenizer, source, target)
    source, target = np.array(source, "int32"), np.array(target, "int32")
    cache = model.init_cache(model.encode(source), source, max_length=target.shape[1])
    for t in range(target.shape[1]):
        step, cache = model.decode_step(target[:, t], t, cache)
        np.testing.assert_allclose(to_numpy(step)[0], theirs[0, t], atol=1e-4, rtol=0)


def test_greedy_translations_equal_generate(imported_trained, marian_separate_trained):
    """Greedy search == `generate(num_beams=1)`: the tokens, then the texts."""
    sources, _ = load_bundled("test")
    texts = sources[:16]
    model, tokenizer = imported_trained, imported_trained.tokenizer
    reference, reference_tokenizer = hf_model(marian_separate_trained), hf_tokenizer(marian_separate_trained)
    batch = reference_tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = reference.generate(**batch, num_beams=1, do_sample=False,
                                       max_new_tokens=batch["input_ids"].shape[1] + 50).numpy()
    eos = reference.config.eos_token_id
    assert (generated[:, 1:] == eos).any(axis=1).all(), "the stand-in's greedy outputs should end with </s>"
    theirs = [row[1: list(row).index(eos, 1) + 1].tolist() for row in generated]  # after the start, </s> included
    ids = model.generate(np.array(padded(tokenizer.encode(texts), 0), "int32"), beam_size=1)
    ours = [tokenizer.marian_ids[row[1: list(row).index(tokenizer.end_id) + 1]].tolist() for row in ids]
    assert ours == theirs
    # The texts: HF's decoding of its tokens. (With separate vocabularies, HF's `skip_special_tokens` knows the
    # source's <pad> id only, so the padding after a finished row is cut here, as above.)
    assert tokenizer.decode(ids) == reference_tokenizer.batch_decode(theirs, skip_special_tokens=True)


# ---------------------------------------------------------------------- #
# The tokenizer (the same on every backend: runs once, see conftest.py)
# ---------------------------------------------------------------------- #
def test_tokenizer_ids_and_strings_equal_marian_tokenizer_on_the_bundled_corpus(marian_separate_random):
    from keras_transformer.convert import read_hf_config
    from keras_transformer.convert.marian import convert_tokenizer

    directory = marian_separate_random
    tokenizer = convert_tokenizer(directory, read_hf_config(directory))
    reference = hf_tokenizer(directory)
    assert reference.separate_vocabs
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    target_vocab = json.loads((directory / "target_vocab.json").read_text(encoding="utf-8"))
    assert vocab["<pad>"] != target_vocab["<pad>"]  # the special pieces are looked up in each, by name
    assert tokenizer.source_vocabulary_size == len(vocab) + 1 and tokenizer.vocabulary_size == len(target_vocab) + 1
    assert tokenizer.pieces()[:4] == tokenizer.source_vocabulary()[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tokenizer.marian_ids[2] == target_vocab["<pad>"] and tokenizer.source_marian_ids[0] == vocab["<pad>"]
    for split in ("train", "valid", "test"):
        english, german = load_bundled(split)
        for texts, target, marian in ((english, False, tokenizer.source_marian_ids),
                                      (german, True, tokenizer.marian_ids)):
            ids = tokenizer.encode(texts, target=target)
            expected = reference(text_target=texts)["input_ids"] if target else reference(texts)["input_ids"]
            mismatches = [i for i, (a, b) in enumerate(zip(ids, expected)) if marian[a].tolist() != b]
            assert not mismatches, f"{split} {'de' if target else 'en'} line {mismatches[0]}: {texts[mismatches[0]]!r}"
            if target:
                decoded = tokenizer.decode(ids)
                expected_text = reference.batch_decode(expected, skip_special_tokens=True)
                wrong = [i for i, (a, b) in enumerate(zip(decoded, expected_text)) if a != b]
                assert not wrong, f"{split}: {decoded[wrong[0]]!r} != {expected_text[wrong[0]]!r}"


def test_tokenizer_saves_and_loads_its_target_vocabulary(marian_separate_random, tmp_path):
    from keras_transformer.tokenizers.sentencepiece import load_tokenizer

    tokenizer = kt.TransformerModel.from_preset(marian_separate_random).tokenizer
    tokenizer.save(tmp_path / "tokenizer")
    assert (tmp_path / "tokenizer" / "target_vocab.json").is_file()
    loaded = load_tokenizer(tmp_path / "tokenizer")
    assert isinstance(loaded, MarianTokenizer) and loaded.separate_vocabs
    assert loaded.pieces() == tokenizer.pieces() and loaded.source_vocabulary() == tokenizer.source_vocabulary()
    assert loaded.encode(SENTENCES) == tokenizer.encode(SENTENCES)
    (tmp_path / "tokenizer" / "target_vocab.json").unlink()
    with pytest.raises(FileNotFoundError, match="target_vocab.json is missing"):
        load_tokenizer(tmp_path / "tokenizer")


# ---------------------------------------------------------------------- #
# Presets, fine-tuning's starting point
# ---------------------------------------------------------------------- #
def test_save_to_preset_loads_back_identically(imported_random, tmp_path):
    model = imported_random
    model.save_to_preset(tmp_path / "preset")
    config = json.loads((tmp_path / "preset" / "config.json").read_text())
    assert "source_vocabulary_size" in json.dumps(config)
    loaded = kt.TransformerModel.from_preset(tmp_path / "preset")
    assert loaded.source_vocabulary_size == model.source_vocabulary_size and loaded.tokenizer.separate_vocabs
    source = np.array(model.tokenizer.encode(SENTENCES[:1]), "int32")
    inputs = {"encoder_token_ids": source, "decoder_token_ids": np.array([[2, 5, 9, 11]], "int32")}
    np.testing.assert_array_equal(to_numpy(loaded(inputs)), to_numpy(model(inputs)))
    assert loaded.tokenizer.encode(SENTENCES) == model.tokenizer.encode(SENTENCES)


def test_a_tokenizer_of_another_source_vocabulary_is_refused_by_the_translator(imported_random):
    tokenizer = imported_random.tokenizer
    specials = tokenizer.specials()
    # The same target vocabulary (so the same target ids), the target's as the source's too.
    other = MarianTokenizer(tokenizer.source_proto, tokenizer.target_proto, tokenizer.target_vocab,
                            pad_token=specials["pad_token"], unk_token=specials["unk_token"],
                            end_token=specials["end_token"], target_vocab=tokenizer.target_vocab)
    assert other.vocabulary_size == tokenizer.vocabulary_size and other.source_vocabulary_size == 301
    with pytest.raises(ValueError, match=r"301 source pieces but the model's encoder takes 401 ids"):
        kt.Translator(imported_random, other)


def test_fine_tuning_trains_both_tables_and_keeps_both_vocabularies(marian_separate_random, tmp_path):
    """`init_from` a separate-vocabulary checkpoint: a couple of steps move both tables; the preset keeps both files."""
    from keras_transformer import training

    english, german = load_bundled("valid")
    pairs = [(e, d) for e, d in zip(english, german) if len(e) <= 40 and len(d) <= 40][:16]
    for name, side in (("train.en", 0), ("train.de", 1)):
        (tmp_path / name).write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
    imported = kt.TransformerModel.from_preset(marian_separate_random)
    training.run_training(tmp_path / "run", init_from=str(marian_separate_random),
                          train_src=str(tmp_path / "train.en"), train_tgt=str(tmp_path / "train.de"), steps=2,
                          warmup_steps=2, tokens_per_batch=400, max_length=40, verbose=0)
    model = kt.TransformerModel.from_preset(str(tmp_path / "run"))
    assert model.source_vocabulary_size == imported.source_vocabulary_size and model.tokenizer.separate_vocabs
    for name in ("vocab.json", "target_vocab.json"):
        assert json.loads((tmp_path / "run" / name).read_text()) == \
            json.loads((marian_separate_random / name).read_text())
    for table in ("source_token_embedding", "token_embedding"):
        before, after = (to_numpy(getattr(m, table).embeddings) for m in (imported, model))
        assert before.shape == after.shape and not np.array_equal(before, after), table


# ---------------------------------------------------------------------- #
# What is refused
# ---------------------------------------------------------------------- #
def _copy(source, destination, config=None, tokenizer_config=None):
    shutil.copytree(source, destination)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            path = destination / name
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return destination


def test_inconsistent_separate_vocabularies_are_refused(marian_separate_random, marian_random, tmp_path):
    directory = _copy(marian_random, tmp_path / "one", tokenizer_config={"separate_vocabs": True})
    with pytest.raises(CheckpointError, match="separate_vocabs=true .*needs share_encoder_decoder_embeddings=false"):
        kt.TransformerModel.from_preset(directory)
    directory = _copy(marian_separate_random, tmp_path / "two")
    (directory / "target_vocab.json").unlink()
    with pytest.raises(CheckpointError, match="has no target_vocab.json"):
        kt.TransformerModel.from_preset(directory)
    directory = _copy(marian_separate_random, tmp_path / "three", config={"decoder_vocab_size": 299})
    with pytest.raises(CheckpointError, match="decoder_vocab_size=299 but target_vocab.json has 300 pieces"):
        kt.TransformerModel.from_preset(directory)


# ---------------------------------------------------------------------- #
# The exports follow
# ---------------------------------------------------------------------- #
@pytest.mark.slow
def test_hugging_face_export_writes_the_checkpoint_back(imported_trained, marian_separate_trained, tmp_path):
    """Tensors, vocabularies and config as the original's; the export's own validation (transformers) passes."""
    from safetensors.numpy import load_file

    from export.huggingface import export_huggingface

    directory = export_huggingface(imported_trained, tmp_path / "hf", validation_sentences=3)
    original, exported = (load_file(str(path / "model.safetensors")) for path in (marian_separate_trained, directory))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor.astype("float32"), err_msg=name)
    for name in ("vocab.json", "target_vocab.json"):
        assert json.loads((directory / name).read_text()) == json.loads((marian_separate_trained / name).read_text())
    ours, theirs = (json.loads((path / "config.json").read_text()) for path in (directory, marian_separate_trained))
    for key in ("vocab_size", "decoder_vocab_size", "share_encoder_decoder_embeddings", "pad_token_id",
                "eos_token_id", "decoder_start_token_id"):
        assert ours[key] == theirs[key], key
    assert json.loads((directory / "tokenizer_config.json").read_text())["separate_vocabs"] is True
    validation = json.loads((directory / "keras_transformer.json").read_text())["validation"]
    assert validation["largest_logits_difference"] <= 1e-4 and validation["greedy_identical"] == 3


@pytest.mark.slow
def test_ctranslate2_export_takes_the_source_table_and_both_vocabularies(imported_trained, tmp_path):
    pytest.importorskip("ctranslate2")
    from export.ctranslate2 import export_ctranslate2
    from export.serve.engines import CTranslate2Engine
    from keras_transformer.search.options import SearchOptions

    model, tokenizer = imported_trained, imported_trained.tokenizer
    directory = export_ctranslate2(model, tmp_path / "ct2", validation_sentences=6)  # validated: tokens and log-probs
    assert not (directory / "shared_vocabulary.json").exists()
    assert json.loads((directory / "source_vocabulary.json").read_text()) == tokenizer.source_vocabulary()
    assert json.loads((directory / "target_vocabulary.json").read_text()) == tokenizer.pieces()
    validation = json.loads((directory / "keras_transformer.json").read_text())["validation"]
    assert validation["identical"] == validation["sentences"] == 6
    engine = CTranslate2Engine(directory)
    assert engine.translate(SENTENCES, SearchOptions(beam_size=1)) == \
        kt.Translator(model, tokenizer).translate(SENTENCES, beam_size=1)


@pytest.mark.slow
@pytest.mark.tensorflow_only
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the exports trace TensorFlow graphs")
def test_onnx_export_takes_the_source_table(imported_trained, tmp_path):
    """Every graph validated against Keras at export (the fused step and translate.onnx too); the runtime agrees."""
    from export.onnx import export_onnx
    from export.runtime import OnnxTranslator

    model = imported_trained
    directory = export_onnx(model, tmp_path / "onnx", with_tokenizer=True)
    config = json.loads((directory / "config.json").read_text())
    assert config["source_vocabulary_size"] == model.source_vocabulary_size != config["vocabulary_size"]
    assert "fused_decoder_step" in config["graphs"] and (directory / "translate.onnx").is_file()
    translator = OnnxTranslator(directory)
    assert translator.model.encoder_vocabulary_size == model.source_vocabulary_size
    for beam_size in (1, 4):
        assert translator.translate(SENTENCES, beam_size=beam_size) == \
            kt.Translator(model, model.tokenizer).translate(SENTENCES, beam_size=beam_size)


@pytest.mark.slow
@pytest.mark.tensorflow_only
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the exports trace TensorFlow graphs")
def test_saved_model_tokenizes_sources_with_the_source_vocabulary(imported_trained, tmp_path):
    import tensorflow as tf

    from export.saved_model import export_saved_model

    model = imported_trained
    directory = export_saved_model(model, tmp_path / "saved_model", beam_size=1)
    translate = tf.saved_model.load(str(directory)).signatures["translate"]
    texts = [text.decode("utf-8") for text in translate(text=tf.constant(SENTENCES))["translation"].numpy()]
    assert texts == kt.Translator(model, model.tokenizer).translate(SENTENCES, beam_size=1)
