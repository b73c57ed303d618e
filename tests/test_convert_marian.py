"""Importing Marian (OPUS-MT) checkpoints, measured against Hugging Face `transformers` itself.

The reference checkpoints are built in-process with `transformers` (fixtures
`marian_random` and `marian_trained` in conftest.py, nothing downloaded):
our logits equal `MarianMTModel`'s within 1e-4 on every backend, our
tokenizer gives `MarianTokenizer`'s ids and strings on the bundled corpus,
and greedy search gives `generate(num_beams=1)`'s translations.
"""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from conftest import BACKEND, SENTENCES, copy_with_config, padded, populate_hub_cache, to_numpy
from conftest import hf_marian_model as hf_model, hf_marian_tokenizer as hf_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import keras_transformer as kt  # noqa: E402
from keras_transformer.convert import CheckpointError  # noqa: E402
from keras_transformer.datasets import load_bundled  # noqa: E402
from keras_transformer.tokenizers.marian import MarianTokenizer  # noqa: E402


def hf_logits(model, source, target):
    pad = model.config.pad_token_id
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(source), attention_mask=torch.tensor(source != pad),
            decoder_input_ids=torch.tensor(target),
        ).logits.numpy()


@pytest.fixture(scope="module")
def imported_random(marian_random):
    return kt.TransformerModel.from_preset(marian_random)


@pytest.fixture(scope="module")
def imported_trained(marian_trained):
    return kt.TransformerModel.from_preset(marian_trained)


# ---------------------------------------------------------------------- #
# The model: logits
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_logits_equal_hugging_face(kind, request):
    """Teacher-forced logits of every target position, every vocabulary entry, within 1e-4 (float32)."""
    directory = request.getfixturevalue(f"marian_{kind}")
    model = request.getfixturevalue(f"imported_{kind}")
    tokenizer = model.tokenizer
    reference = hf_model(directory)
    sources = tokenizer.encode(SENTENCES)
    rng = np.random.default_rng(0)
    # Targets: the start id, then random ordinary ids (padding after shorter rows).
    lengths = [9, 4, 12, 7]
    targets = [[tokenizer.start_id] + rng.integers(4, model.vocabulary_size, size=n - 1).tolist() for n in lengths]
    ours = to_numpy(model({"encoder_token_ids": padded(sources, 0).astype("int32"),
                           "decoder_token_ids": padded(targets, 0).astype("int32")}))
    marian = tokenizer.marian_ids
    pad = reference.config.pad_token_id
    theirs = hf_logits(reference, padded([marian[s] for s in sources], pad),
                       padded([marian[t] for t in targets], pad))[..., marian]  # our vocabulary order
    for row, length in enumerate(lengths):  # padded target positions differ by design (HF masks no target)
        np.testing.assert_allclose(ours[row, :length], theirs[row, :length], atol=1e-4, rtol=0)
    # The comparison is not vacuous: a logits bias left out moves the logits far beyond the tolerance.
    if kind == "random":
        bias = to_numpy(model.logits_bias_weight)
        assert np.abs(bias).max() > 0.1


def test_cached_decoding_equals_hugging_face_step_by_step(imported_trained, marian_trained):
    """`decode_step` (our KV cache) gives HF's logits at each position."""
    model, tokenizer = imported_trained, imported_trained.tokenizer
    reference = hf_model(marian_trained)
    source = np.array(tokenizer.encode(SENTENCES[:1]), "int32")
    target = np.array([[tokenizer.start_id] + tokenizer.encode(["Öffnen Sie"], add_end=False, target=True)[0]], "int32")
    theirs = hf_logits(reference, tokenizer.marian_ids[source], tokenizer.marian_ids[target])[..., tokenizer.marian_ids]
    cache = model.init_cache(model.encode(source), source, max_length=target.shape[1])
    for t in range(target.shape[1]):
        step, cache = model.decode_step(target[:, t], t, cache)
        np.testing.assert_allclose(to_numpy(step)[0], theirs[0, t], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- #
# Search
# ---------------------------------------------------------------------- #
def test_greedy_translations_equal_generate(imported_trained, marian_trained):
    """Greedy search == `generate(num_beams=1)` (pad suppressed, as the Hub's generation configs do)."""
    sources, _ = load_bundled("test")
    texts = sources[:24]
    reference, reference_tokenizer = hf_model(marian_trained), hf_tokenizer(marian_trained)
    translator = kt.Translator(imported_trained, imported_trained.tokenizer)
    ours = translator.translate(texts, beam_size=1)
    batch = reference_tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = reference.generate(**batch, num_beams=1, do_sample=False,
                                       max_new_tokens=batch["input_ids"].shape[1] + 50)
    theirs = reference_tokenizer.batch_decode(generated, skip_special_tokens=True)
    # Every HF output ended with </s> (not cut by the length limit): the comparison is of whole translations.
    ends = (generated[:, 1:] == reference.config.eos_token_id).any(dim=1)
    assert bool(ends.all()), "the stand-in's greedy outputs should end with </s>"
    assert ours == theirs


def test_beam_search_translates_an_imported_model(imported_trained):
    """Beam search (the paper's GNMT penalty) runs on the imported model; beam 4 scores >= greedy's."""
    translator = kt.Translator(imported_trained, imported_trained.tokenizer)
    beam = translator.translate(SENTENCES, beam_size=4)
    assert all(isinstance(text, str) and text for text in beam)


# ---------------------------------------------------------------------- #
# The tokenizer (the same on every backend: runs once, see conftest.py)
# ---------------------------------------------------------------------- #
def test_tokenizer_ids_and_strings_equal_marian_tokenizer_on_the_bundled_corpus(marian_trained):
    from keras_transformer.convert import read_hf_config
    from keras_transformer.convert.marian import convert_tokenizer

    tokenizer = convert_tokenizer(marian_trained, read_hf_config(marian_trained))
    reference = hf_tokenizer(marian_trained)
    marian = tokenizer.marian_ids
    for split in ("train", "valid", "test"):
        english, german = load_bundled(split)
        for texts, target in ((english, False), (german, True)):
            ids = tokenizer.encode(texts, target=target)
            expected = reference(text_target=texts)["input_ids"] if target else reference(texts)["input_ids"]
            mismatches = [i for i, (a, b) in enumerate(zip(ids, expected)) if marian[a].tolist() != b]
            assert not mismatches, f"{split} {'de' if target else 'en'} line {mismatches[0]}: {texts[mismatches[0]]!r}"
            if target:
                decoded = tokenizer.decode(ids)
                expected_text = reference.batch_decode(expected, skip_special_tokens=True)
                wrong = [i for i, (a, b) in enumerate(zip(decoded, expected_text)) if a != b]
                assert not wrong, f"{split}: {decoded[wrong[0]]!r} != {expected_text[wrong[0]]!r}"


def test_tokenizer_special_ids_and_renumbering(marian_random):
    tokenizer = kt.TransformerModel.from_preset(marian_random).tokenizer
    vocab = json.loads((marian_random / "vocab.json").read_text(encoding="utf-8"))
    pieces = tokenizer.pieces()
    assert pieces[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.start_id, tokenizer.end_id) == (0, 1, 2, 3)
    assert tokenizer.vocabulary_size == len(vocab) + 1  # the added start piece
    # The start id takes <pad>'s row (Marian's decoder starts from <pad>); every other id its own piece's.
    assert tokenizer.marian_ids[2] == vocab["<pad>"]
    assert all(tokenizer.marian_ids[i] == vocab[piece] for i, piece in enumerate(pieces) if i != 2)
    assert sorted(tokenizer.marian_ids.tolist()) == sorted([*vocab.values(), vocab["<pad>"]])
    # An unknown piece is <unk>; the ends of decoding as Tokenizer's.
    assert tokenizer.id_of("no-such-piece") == tokenizer.unk_id
    assert tokenizer.decode([[2, 3, 7]]) == [""]
    for languages in (["en"], ["en", ""], "ende", ["en", 3]):
        with pytest.raises(ValueError, match=r"languages=.* must be None or two non-empty codes"):
            MarianTokenizer(tokenizer._source_proto, tokenizer._target_proto, vocab, languages=languages)


def test_language_codes_are_one_piece_and_required_when_the_model_has_them(tmp_path):
    from keras_transformer.convert.standin import build_marian_checkpoint

    directory = build_marian_checkpoint(tmp_path / "multi", language_codes=(">>deu<<", ">>nld<<"),
                                        source_vocabulary_size=120, target_vocabulary_size=120, max_sentences=500)
    tokenizer = kt.TransformerModel.from_preset(directory).tokenizer
    reference = hf_tokenizer(directory)
    texts = [">>deu<< Open the file.", ">>nld<< Close it."]
    assert [tokenizer.marian_ids[ids].tolist() for ids in tokenizer.encode(texts)] == reference(texts)["input_ids"]
    assert tokenizer.language_codes == [">>deu<<", ">>nld<<"]
    with pytest.raises(ValueError, match=r"texts\[1\] does not start with a target-language token.*>>deu<<"):
        tokenizer.encode([">>deu<< fine", "Open the file."])
    tokenizer.encode(["Öffnen"], target=True)  # targets carry no code


# ---------------------------------------------------------------------- #
# Saving in our format, loading by handle
# ---------------------------------------------------------------------- #
def test_save_to_preset_loads_back_identically(imported_trained, tmp_path):
    model = imported_trained
    model.save_to_preset(tmp_path / "preset")
    assert {"source.spm", "target.spm", "vocab.json", "marian_tokenizer.json", "model.weights.h5"} <= {
        path.name for path in (tmp_path / "preset").iterdir()}
    loaded = kt.TransformerModel.from_preset(tmp_path / "preset")
    assert isinstance(loaded.tokenizer, MarianTokenizer)
    assert loaded.tokenizer.pieces() == model.tokenizer.pieces()
    assert (loaded.tokenizer.marian_ids == model.tokenizer.marian_ids).all()
    # The checkpoint's source_lang / target_lang (its tokenizer_config.json) are kept, for an export's model card.
    assert model.tokenizer.languages == loaded.tokenizer.languages == ("en", "de")
    assert (loaded.activation, loaded.position_encoding, loaded.logits_bias) == ("silu", "sinusoidal_halves", True)
    source = np.array(model.tokenizer.encode(SENTENCES[:2])[0:1], "int32")
    target = np.array([[2, 5, 9, 11]], "int32")
    inputs = {"encoder_token_ids": source, "decoder_token_ids": target}
    np.testing.assert_array_equal(to_numpy(loaded(inputs)), to_numpy(model(inputs)))
    texts = SENTENCES[:2]
    assert kt.Translator.from_preset(tmp_path / "preset").translate(texts, beam_size=1) == \
        kt.Translator(model, model.tokenizer).translate(texts, beam_size=1)


def test_hf_handle_resolves_offline_from_the_cache(marian_trained, offline_hub):
    populate_hub_cache(offline_hub, "Helsinki-NLP/opus-mt-xx-yy", marian_trained)
    translator = kt.Translator.from_preset("hf://Helsinki-NLP/opus-mt-xx-yy")
    direct = kt.Translator.from_preset(marian_trained)
    assert translator.translate(SENTENCES[:2], beam_size=1) == direct.translate(SENTENCES[:2], beam_size=1)
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache.*offline"):
        kt.TransformerModel.from_preset("hf://Helsinki-NLP/opus-mt-not-cached")
    with pytest.raises(CheckpointError, match="is not a Hugging Face handle"):
        kt.TransformerModel.from_preset("hf://just-a-name")


def test_hf_handle_without_safetensors_names_the_repository_to_convert(marian_random, offline_hub, tmp_path):
    """Only safetensors are fetched: the message converts from the repository, not in the Hugging Face cache."""
    checkpoint = tmp_path / "pickle-only"
    shutil.copytree(marian_random, checkpoint)
    (checkpoint / "model.safetensors").unlink()
    snapshot = populate_hub_cache(offline_hub, "Helsinki-NLP/opus-mt-xx-zz", checkpoint)
    with pytest.raises(CheckpointError) as error:
        kt.TransformerModel.from_preset("hf://Helsinki-NLP/opus-mt-xx-zz")
    message = str(error.value)
    assert message.startswith("hf://Helsinki-NLP/opus-mt-xx-zz has no model.safetensors at revision main")
    assert "M.from_pretrained('Helsinki-NLP/opus-mt-xx-zz').save_pretrained('opus-mt-xx-zz')" in message
    assert "T.from_pretrained('Helsinki-NLP/opus-mt-xx-zz')" in message and "\n" not in message
    assert str(snapshot) not in message and str(offline_hub) not in message
    assert "hf://org/name@refs/pr/N" in message

    # The way out it names: the Hub's conversion pull request as the revision (cached as refs/refs/pr/N).
    pull_request = "89abcdef0123456789abcdef0123456789abcdef"
    shutil.copytree(marian_random, snapshot.parent / pull_request)
    (snapshot.parent.parent / "refs" / "refs" / "pr").mkdir(parents=True)
    (snapshot.parent.parent / "refs" / "refs" / "pr" / "3").write_text(pull_request)
    model = kt.TransformerModel.from_preset("hf://Helsinki-NLP/opus-mt-xx-zz@refs/pr/3")
    assert model.tokenizer is not None


def test_a_directory_named_as_a_pretrained_preset_is_loaded_as_one_named_as_an_architecture(
        imported_random, offline_hub, tmp_path, monkeypatch):
    """`--preset opus_mt_en_de` in a folder holding a run of that name reads the run, as `--preset tiny` does."""
    monkeypatch.chdir(tmp_path)
    for name in ("opus_mt_en_de", "tiny"):
        imported_random.save_to_preset(tmp_path / name)
        loaded = kt.TransformerModel.from_preset(name)
        assert loaded.vocabulary_size == imported_random.vocabulary_size and loaded.tokenizer is not None
    with pytest.raises(CheckpointError, match="hf://Helsinki-NLP/opus-mt-de-en is not in the Hugging Face cache"):
        kt.TransformerModel.from_preset("opus_mt_de_en")  # no such directory: the named checkpoint


# ---------------------------------------------------------------------- #
# What is refused, in one line naming the field
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("changes, message", [
    # Separate tables are supported (tests/test_convert_marian_separate.py); this file has the shared matrix only.
    ({"share_encoder_decoder_embeddings": False}, "no tensor 'model.encoder.embed_tokens.weight'"),
    ({"decoder_vocab_size": 99}, "decoder_vocab_size=99 differs from vocab_size=.* one shared embedding matrix"),
    ({"activation_function": "tanh"}, "activation_function='tanh' is not supported"),
    ({"scale_embedding": False}, "scale_embedding=False is not supported"),
    ({"decoder_ffn_dim": 96}, "decoder_ffn_dim=96 differs from encoder_ffn_dim"),
    ({"model_type": "t5"}, "model_type='t5' is not supported; supported: fsmt, m2m_100, marian"),
    ({"vocab_size": 10, "decoder_vocab_size": 10}, "vocab_size=10 but vocab.json has"),
])
def test_configs_the_model_cannot_express_are_refused(marian_random, tmp_path, changes, message):
    directory = copy_with_config(marian_random, tmp_path / "checkpoint", **changes)
    with pytest.raises(CheckpointError, match=message):
        kt.TransformerModel.from_preset(directory)


def test_a_pickle_only_checkpoint_is_refused_with_the_way_to_convert_it(marian_random, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(marian_random, directory)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors \(it has pytorch_model.bin.*pickle.*save_pretrained"):
        kt.TransformerModel.from_preset(directory)


def test_separate_vocabularies_and_bad_overrides_are_refused(marian_random, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(marian_random, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "separate_vocabs": True}))
    with pytest.raises(CheckpointError, match="separate_vocabs=true .*needs share_encoder_decoder_embeddings=false"):
        kt.TransformerModel.from_preset(directory)
    with pytest.raises(CheckpointError, match=r"Cannot override \['hidden_dim'\]"):
        kt.TransformerModel.from_preset(marian_random, hidden_dim=32)
    model = kt.TransformerModel.from_preset(marian_random, dropout=0.0)
    assert model.dropout == 0.0


def test_tensors_that_do_not_fit_are_named(marian_random, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "checkpoint"
    shutil.copytree(marian_random, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.encoder.layers.0.fc1.weight"] = tensors["model.encoder.layers.0.fc1.weight"][:, :8]
    tensors["extra.weight"] = np.zeros(3, "float32")
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.encoder.layers.0.fc1.weight has shape \(128, 8\)"):
        kt.TransformerModel.from_preset(directory)
    del tensors["extra.weight"]
    tensors["model.encoder.layers.0.fc1.weight"] = load_file(str(marian_random / "model.safetensors"))[
        "model.encoder.layers.0.fc1.weight"]
    tensors["model.decoder.layers.9.fc1.weight"] = np.zeros(3, "float32")
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensors the converted model does not use: model.decoder.layers.9"):
        kt.TransformerModel.from_preset(directory)


def test_paper_defaults_are_unchanged():
    model = kt.TransformerModel.from_preset("tiny")
    assert (model.activation, model.position_encoding, model.logits_bias) == ("relu", "sinusoidal", False)
    assert not any("logits_bias" in weight.path for weight in model.weights)
    assert os.environ.get("KERAS_BACKEND", BACKEND) == keras.backend.backend()


def test_stored_position_tables_are_checked_not_trusted(marian_random, tmp_path):
    """Older Hub checkpoints store the sinusoids (`embed_positions`): HF's own table loads, another layout is refused."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "checkpoint"
    shutil.copytree(marian_random, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    table = hf_model(marian_random).model.encoder.embed_positions.create_weight().numpy()  # float64 -> float32
    for side in ("encoder", "decoder"):
        tensors[f"model.{side}.embed_positions.weight"] = table
    save_file(tensors, str(directory / "model.safetensors"))
    kt.TransformerModel.from_preset(directory)
    half = table.shape[1] // 2
    interleaved = np.stack([table[:, :half], table[:, half:]], axis=-1).reshape(table.shape)
    tensors["model.decoder.embed_positions.weight"] = interleaved
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="embed_positions.weight differs from the sin|cos-halves sinusoids"):
        kt.TransformerModel.from_preset(directory)
