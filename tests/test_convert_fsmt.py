"""Importing FSMT checkpoints (fairseq's WMT19 models), measured against Hugging Face `transformers` itself.

The reference checkpoint is built in-process with `transformers` (fixture
`fsmt_random` in conftest.py, nothing downloaded) in the layout of
facebook/wmt19-en-de: BPE merges learned on the Moses tokens of the bundled
corpus, `vocab-src.json` and `vocab-tgt.json` of different sizes, random
weights. Our logits equal `FSMTForConditionalGeneration`'s within 1e-4 on
every backend (cached decoding included), greedy search gives its
`generate`'s tokens, and our tokenizer gives `FSMTTokenizer`'s ids and
strings on the bundled corpus.

`FSMTForConditionalGeneration` applies no causal mask to a teacher-forced
call with `use_cache=True` (its config's default; generation feeds one token
at a time and is causal): the reference logits are taken with
`use_cache=False`.
"""

import json
import shutil

import numpy as np
import pytest

from conftest import SENTENCES, copy_with_config, padded, to_numpy

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("sacremoses")

import keras_transformer as kt  # noqa: E402
from keras_transformer.convert import CheckpointError  # noqa: E402
from keras_transformer.datasets import load_bundled  # noqa: E402
from keras_transformer.tokenizers.fsmt import FsmtTokenizer  # noqa: E402


def hf_model(directory):
    return transformers.FSMTForConditionalGeneration.from_pretrained(str(directory)).eval()


def hf_tokenizer(directory):
    return transformers.FSMTTokenizer.from_pretrained(str(directory))


def hf_logits(model, source, target):
    pad = model.config.pad_token_id
    with torch.no_grad():
        return model(input_ids=torch.tensor(source), attention_mask=torch.tensor(source != pad),
                     decoder_input_ids=torch.tensor(target), use_cache=False).logits.numpy()


@pytest.fixture(scope="module")
def imported(fsmt_random):
    return kt.TransformerModel.from_preset(fsmt_random)


# ---------------------------------------------------------------------- #
# The model: logits
# ---------------------------------------------------------------------- #
def test_logits_equal_hugging_face(imported, fsmt_random):
    """Teacher-forced logits of every target position, every row of the target table, within 1e-4 (float32)."""
    model, tokenizer = imported, imported.tokenizer
    reference = hf_model(fsmt_random)
    assert (model.normalize_first, model.position_encoding, model.activation, model.logits_bias) == (
        False, "sinusoidal_fairseq", "relu", False)
    assert (model.source_vocabulary_size, model.vocabulary_size) == (
        reference.config.src_vocab_size + 1, reference.config.tgt_vocab_size + 1)  # the added start id
    sources = tokenizer.encode(SENTENCES)
    rng = np.random.default_rng(0)
    lengths = [9, 4, 12, 7]
    targets = [[tokenizer.start_id] + rng.integers(4, model.vocabulary_size, size=n - 1).tolist() for n in lengths]
    ours = to_numpy(model({"encoder_token_ids": padded(sources, 0).astype("int32"),
                           "decoder_token_ids": padded(targets, 0).astype("int32")}))
    rows, source_rows = tokenizer.checkpoint_ids, tokenizer.source_checkpoint_ids
    pad = reference.config.pad_token_id
    theirs = hf_logits(reference, padded([source_rows[s] for s in sources], pad),
                       padded([rows[t] for t in targets], pad))[..., rows]  # our vocabulary order
    for row, length in enumerate(lengths):  # padded target positions differ by design (HF masks no target)
        np.testing.assert_allclose(ours[row, :length], theirs[row, :length], atol=1e-4, rtol=0)


def test_cached_decoding_equals_hugging_face_step_by_step(imported, fsmt_random):
    """`decode_step` (our KV cache, fairseq's positions from 2) gives HF's logits at each position."""
    model, tokenizer = imported, imported.tokenizer
    reference = hf_model(fsmt_random)
    source = np.array(tokenizer.encode(SENTENCES[:1]), "int32")
    target = np.array([[tokenizer.start_id] + tokenizer.encode(["Öffnen Sie das Fenster"], add_end=False,
                                                               target=True)[0]], "int32")
    theirs = hf_logits(reference, tokenizer.source_checkpoint_ids[source],
                       tokenizer.checkpoint_ids[target])[..., tokenizer.checkpoint_ids]
    cache = model.init_cache(model.encode(source), source, max_length=target.shape[1])
    others = np.arange(model.vocabulary_size) != tokenizer.start_id
    for t in range(target.shape[1]):
        step, cache = model.decode_step(target[:, t], t, cache)
        step = to_numpy(step)[0]
        np.testing.assert_allclose(step[others], theirs[0, t][others], atol=1e-4, rtol=0)
        # The added start id (</s>'s row) is outside the search's softmax: one </s> in it, as in Hugging Face's.
        assert step[tokenizer.start_id] == -np.inf


# ---------------------------------------------------------------------- #
# Search
# ---------------------------------------------------------------------- #
def test_greedy_tokens_equal_generate(imported, fsmt_random):
    """Greedy search == `generate(num_beams=1)` (HF's cached, one token a step), token for token."""
    texts = load_bundled("test")[0][:8]
    tokenizer, reference, reference_tokenizer = imported.tokenizer, hf_model(fsmt_random), hf_tokenizer(fsmt_random)
    sources = tokenizer.encode(texts)
    new_tokens = 12
    ours = imported.generate(padded(sources, 0).astype("int32"), beam_size=1, max_extra_length=new_tokens)
    batch = reference_tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = reference.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=new_tokens,
                                       forced_eos_token_id=None).numpy()
    end = reference.config.eos_token_id
    compared = 0
    for row, theirs in zip(ours, generated):
        mine = tokenizer.checkpoint_ids[row[1:]].tolist()  # after the start id, in checkpoint ids
        theirs = theirs[1:].tolist()
        mine = mine[: mine.index(end) + 1] if end in mine else mine
        theirs = theirs[: theirs.index(end) + 1] if end in theirs else theirs
        common = min(len(mine), len(theirs))  # the two length limits differ; the tokens up to the shorter agree
        assert mine[:common] == theirs[:common]
        compared += common
    assert compared >= len(texts) * 4


def test_translator_from_a_preset_directory_and_the_checkpoint(imported, fsmt_random, tmp_path):
    """`save_to_preset` writes our tokenizer files; the preset and the checkpoint translate alike."""
    imported.save_to_preset(tmp_path / "preset")
    assert {"vocab-src.json", "vocab-tgt.json", "merges.txt", "fsmt_tokenizer.json", "model.weights.h5"} <= {
        path.name for path in (tmp_path / "preset").iterdir()}
    translator = kt.Translator.from_preset(tmp_path / "preset")
    assert isinstance(translator.tokenizer, FsmtTokenizer)
    assert translator.tokenizer.pieces() == imported.tokenizer.pieces()
    assert translator.tokenizer.source_vocabulary() == imported.tokenizer.source_vocabulary()
    source = np.array(imported.tokenizer.encode(SENTENCES[:1]), "int32")
    inputs = {"encoder_token_ids": source, "decoder_token_ids": np.array([[2, 9, 11, 5]], "int32")}
    np.testing.assert_array_equal(to_numpy(translator.model(inputs)), to_numpy(imported(inputs)))
    texts = SENTENCES[:2]
    translations = translator.translate(texts, beam_size=2, max_extra_length=6)
    assert len(translations) == 2 and all(isinstance(text, str) for text in translations)
    assert kt.Translator.from_preset(fsmt_random).translate(texts, beam_size=2, max_extra_length=6) == translations


def test_fine_tuning_from_an_fsmt_checkpoint_runs_a_step(fsmt_random, tmp_path):
    """`init_from` an FSMT directory: the model builds, one train step runs, the preset translates."""
    from keras_transformer.training import run_training

    english, german = load_bundled("train")
    (tmp_path / "train.en").write_text("\n".join(english[:64]) + "\n", encoding="utf-8")
    (tmp_path / "train.de").write_text("\n".join(german[:64]) + "\n", encoding="utf-8")
    output = tmp_path / "run"
    run_training(output, init_from=fsmt_random, train_src=tmp_path / "train.en", train_tgt=tmp_path / "train.de",
                 steps=1, tokens_per_batch=500, warmup_steps=1, validation_bleu=False, checkpoint_every=1, verbose=0)
    translator = kt.Translator.from_preset(output)
    assert isinstance(translator.tokenizer, FsmtTokenizer)
    before = kt.TransformerModel.from_preset(fsmt_random)
    changed = [a.path for a, b in zip(translator.model.weights, before.weights)
               if not np.array_equal(to_numpy(a), to_numpy(b))]
    assert changed  # the step trained
    assert len(translator.translate(SENTENCES[:1], beam_size=1, max_extra_length=5)) == 1


# ---------------------------------------------------------------------- #
# The tokenizer
# ---------------------------------------------------------------------- #
def test_tokenizer_ids_and_strings_equal_fsmt_tokenizer_on_the_bundled_corpus(fsmt_random):
    """Source ids (renumbered back) equal FSMTTokenizer's; decoding target ids gives its strings."""
    ours, reference = FsmtTokenizer.load(fsmt_random, {"languages": ["en", "de"]}), hf_tokenizer(fsmt_random)
    english, german = (lines[:300] for lines in load_bundled("test"))
    english = english + ["", "  Tabs\tand  spaces ", "“Quotes” — dashes – and… ellipses", "a-b 3,5 % x@y.z"]
    expected = reference(english)["input_ids"]
    assert [ours.source_checkpoint_ids[ids].tolist() for ids in ours.encode(english)] == expected
    assert any(1 in ids for ids in ours.encode(english))  # unknown pieces occur (<unk> is our 1)
    # Target side: our ids of the German texts, decoded by both (FSMTTokenizer decodes with vocab-tgt.json).
    targets = ours.encode(german, add_end=True, target=True)
    theirs = reference.batch_decode([ours.checkpoint_ids[ids].tolist() for ids in targets], skip_special_tokens=True)
    assert ours.decode(targets) == theirs
    assert sum(text == line for text, line in zip(theirs, german)) > len(german) // 4  # mostly round trips


def test_tokenizer_special_ids_and_renumbering(fsmt_random):
    tokenizer = FsmtTokenizer.load(fsmt_random, {"languages": ["en", "de"]})
    vocab = json.loads((fsmt_random / "vocab-tgt.json").read_text())
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.start_id, tokenizer.end_id) == (0, 1, 2, 3)
    # Our pad, unk, start, end -> fairseq's <pad>, <unk>, </s> (the decoder starts there), </s>; then <s>, ...
    assert tokenizer.checkpoint_ids[:5].tolist() == [1, 3, 2, 2, 0]
    assert tokenizer.source_checkpoint_ids[:5].tolist() == [1, 3, 1, 2, 0]
    assert tokenizer.vocabulary_size == len(vocab) + 1
    assert tokenizer.pieces()[tokenizer.start_id] == tokenizer.added_start_token not in vocab
    assert tokenizer.encode(["Click OK."])[0][-1] == tokenizer.end_id
    assert tokenizer.encode(["Click OK."], add_start=True, add_end=False, target=True)[0][0] == tokenizer.start_id
    # decode cuts at the end id and drops pad, unk, start and <s> (skip_special_tokens=True).
    ids = tokenizer.encode(["Klicken Sie auf OK."], target=True)[0]
    assert tokenizer.decode([[2, 4, 1] + ids + [9, 9]]) == tokenizer.decode([ids])
    assert tokenizer.decode([[3]]) == [""]


# ---------------------------------------------------------------------- #
# What is refused, in one line naming the field
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("changes, message", [
    ({"scale_embedding": False}, "scale_embedding=False is not supported"),
    ({"pad_token_id": 0}, "pad_token_id=0 is not supported: fairseq's dictionary has 1 there"),
    ({"activation_function": "tanh"}, "activation_function='tanh' is not supported"),
    ({"decoder_ffn_dim": 96}, "decoder_ffn_dim=96 differs from encoder_ffn_dim"),
    ({"langs": ["en"]}, r"langs=\['en'\] must be two language codes"),
    ({"tgt_vocab_size": 99}, "tgt_vocab_size=99 but vocab-tgt.json has"),
])
def test_configs_the_model_cannot_express_are_refused(fsmt_random, tmp_path, changes, message):
    directory = copy_with_config(fsmt_random, tmp_path / "checkpoint", **changes)
    with pytest.raises(CheckpointError, match=message):
        kt.TransformerModel.from_preset(directory)


def test_an_untied_output_projection_is_refused_in_one_line(fsmt_random, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "checkpoint"
    shutil.copytree(fsmt_random, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.decoder.output_projection.weight"] = tensors["model.decoder.output_projection.weight"] * 1.5
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="output_projection.weight differs from model.decoder.embed_tokens.weight"
                       " .an untied output projection; TransformerModel ties it") as raised:
        kt.TransformerModel.from_preset(directory)
    assert "\n" not in str(raised.value)


def test_missing_tokenizer_files_are_refused(fsmt_random, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(fsmt_random, directory)
    (directory / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match="has no merges.txt: an FSMT checkpoint's tokenizer is vocab-src.json"):
        kt.TransformerModel.from_preset(directory)


def test_exporters_refuse_an_fsmt_model_in_one_line(imported):
    from export.contract import UnsupportedModelError, check_exportable

    message = "export of an FSMT model .fairseq's WMT19. is not supported: its Moses tokenizer and BPE"
    with pytest.raises(UnsupportedModelError, match="ONNX " + message):
        check_exportable(imported, "ONNX")
    from export import ctranslate2

    with pytest.raises(UnsupportedModelError, match="CTranslate2 " + message):
        ctranslate2._load_model(imported)
