"""Fine-tuning a trained model: `run_training(init_from=...)`, `train --init-from`, and the commands on checkpoints."""

import gc
import hashlib
import json
import os
import shutil
import weakref

import numpy as np
import pytest

import keras_transformer as kt
from conftest import populate_hub_cache, tiny_model, to_numpy
from keras_transformer import training
from keras_transformer.tokenizers.marian import MarianTokenizer

OFFLINE_HANDLE = "hf://Helsinki-NLP/opus-mt-en-de"


def _write_pairs(directory, name, pairs):
    (directory / f"{name}.en").write_text("".join(e + "\n" for e, _ in pairs), encoding="utf-8")
    (directory / f"{name}.de").write_text("".join(d + "\n" for _, d in pairs), encoding="utf-8")
    return str(directory / f"{name}.en"), str(directory / f"{name}.de")


def _short_pairs(n, longest=40):
    """The first `n` pairs of the bundled validation split with both sides at most `longest` characters."""
    from keras_transformer.datasets import load_bundled

    english, german = load_bundled("valid")
    return [(e, d) for e, d in zip(english, german) if len(e) <= longest and len(d) <= longest][:n]


def _pairs_of_one_length(tokenizer, n, lengths=(15, 18)):
    """`n` bundled validation pairs of `lengths` ids (the longer side, special ids included): one bucket, one shape."""
    from keras_transformer.datasets import load_bundled

    english, german = load_bundled("valid")
    sources, targets = tokenizer.encode(english), tokenizer.encode(german, add_start=True, target=True)
    pairs = [(e, d) for e, d, s, t in zip(english, german, sources, targets)
             if lengths[0] <= max(len(s), len(t)) <= lengths[1]]
    assert len(pairs) >= n
    return pairs[:n]


def _weights(model):
    return [np.array(to_numpy(w)) for w in model.weights]


def _snapshot(directory):
    """{relative path: sha1} of every file under `directory`."""
    result = {}
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                result[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha1(f.read()).hexdigest()
    return result


@pytest.fixture
def cached_opus_mt_en_de(offline_hub, marian_trained):
    """The stand-in in the offline cache as Helsinki-NLP/opus-mt-en-de (what `opus_mt_en_de` names)."""
    populate_hub_cache(offline_hub, "Helsinki-NLP/opus-mt-en-de", marian_trained)
    return marian_trained


# ---------------------------------------------------------------------- #
# Fine-tuning the Marian stand-in: imported weights, kept tokenizer, resume.
# ---------------------------------------------------------------------- #
@pytest.mark.slow
def test_fine_tuning_starts_from_the_imported_weights_keeps_the_tokenizer_and_resumes(
    tmp_path, monkeypatch, marian_trained, marian_random
):
    imported = kt.TransformerModel.from_preset(marian_trained)
    pairs = _pairs_of_one_length(imported.tokenizer, 24)  # batches of one shape: one compilation per run
    train_src, train_tgt = _write_pairs(tmp_path, "train", pairs)
    valid_src, valid_tgt = _write_pairs(tmp_path, "valid", pairs[:12])  # seen in training: its loss must fall
    output = tmp_path / "run"
    source = tmp_path / "trained-checkpoint"  # deleted before the resume: a resumed run does not read it again
    shutil.copytree(marian_trained, source)
    arguments = dict(init_from=str(source), train_src=train_src, train_tgt=train_tgt, valid_src=valid_src,
                     valid_tgt=valid_tgt, steps=4, checkpoint_every=2, warmup_steps=4, learning_rate_scale=0.1,
                     tokens_per_batch=200, max_length=18, bleu_beam_size=1, verbose=0)

    def no_vocabulary(*args, **kwargs):
        raise AssertionError("a fine-tuning run trained a tokenizer")

    monkeypatch.setattr(training.prepare, "train_tokenizer", no_vocabulary)
    built = []  # the weights of the model each run trains, before its first update
    trained = []  # a weak reference to that model
    build, finalize = training._build_model, training._finalize

    def build_and_record(run, data):
        imported = weakref.ref(data.imported) if data.imported is not None else None
        model, strategy = build(run, data)
        built.append(_weights(model))
        trained.append(weakref.ref(model))
        gc.collect()
        assert imported is None or imported() is None, "the imported model outlived the copy of its weights"
        return model, strategy

    def finalize_after_the_trained_model_is_freed(run, data, averaged, scores):
        assert trained[-1]() is None, "the trained model (and its optimizer state) is alive beside the averaged one"
        return finalize(run, data, averaged, scores)

    monkeypatch.setattr(training.run, "_build_model", build_and_record)
    monkeypatch.setattr(training.run, "_finalize", finalize_after_the_trained_model_is_freed)

    # Stopped after its first resume point (2 of 4 steps), as if killed there.
    save = training.ResumePoint.on_epoch_end

    def save_then_stop(self, epoch, logs=None):
        save(self, epoch, logs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(training.ResumePoint, "on_epoch_end", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            training.run_training(output, **arguments)
    for expected, actual in zip(_weights(imported), built[0], strict=True):
        np.testing.assert_array_equal(actual, expected)  # the first update starts from the checkpoint
    state = json.loads((output / "training" / "state.json").read_text())
    assert state["arguments"]["init_from"] == os.path.abspath(source)
    assert state["arguments"]["preset"] is None and state["arguments"]["vocabulary_size"] is None

    # Another checkpoint is another run: refused, nothing touched.
    before = _snapshot(output)
    with pytest.raises(training.BadArgumentError, match=r"init_from='.*random.*' \(was '.*trained.*'\).*Repeat"):
        training.run_training(output, **{**arguments, "init_from": str(marian_random)})
    with pytest.raises(training.BadArgumentError, match=r"init_from=None \(was '.*trained.*'\).*Repeat"):
        training.run_training(output, **{**arguments, "init_from": None})  # training from scratch instead
    assert _snapshot(output) == before

    shutil.rmtree(source)  # gone (or, for an hf:// handle, not in this machine's cache, offline)
    metadata = training.run_training(output, **arguments)  # the same command resumes
    assert len(built) == 2
    assert any(not np.array_equal(a, b) for a, b in zip(built[1], built[0]))  # the resume point, not the checkpoint
    resume = training.read_resume_point(output / "training" / "backup" / training.RESUME_FILE)
    assert (resume["intervals"], resume["step"], metadata["steps"]) == (2, 4, 4)
    assert metadata["init_from"] == os.path.abspath(source)

    # The loss on pairs it was fine-tuned on fell from the imported model's.
    from keras_transformer import data as data_lib

    valid_ids = data_lib.encode_pairs(imported.tokenizer, *(list(side) for side in zip(*pairs[:12])), 18)
    training.compile_model(imported, warmup_steps=4)
    before_loss = imported.evaluate(data_lib.make_dataset(*valid_ids, tokens_per_batch=200, shuffle=False),
                                    verbose=0, return_dict=True)["loss"]
    assert metadata["valid_loss"] < before_loss

    # The preset: the checkpoint's architecture, its tokenizer's files, and it translates.
    model = kt.TransformerModel.from_preset(str(output))
    config, expected_config = model.get_config(), imported.get_config()
    for key in ("vocabulary_size", "hidden_dim", "activation", "position_encoding", "logits_bias", "layer_norm_epsilon"):
        assert config[key] == expected_config[key]
    assert isinstance(model.tokenizer, MarianTokenizer)
    for name in ("source.spm", "target.spm"):
        assert (output / name).read_bytes() == (marian_trained / name).read_bytes()
    assert json.loads((output / "vocab.json").read_text()) == json.loads((marian_trained / "vocab.json").read_text())
    assert not (output / "tokenizer.model").exists()
    translations = kt.Translator.from_preset(str(output)).translate([e for e, _ in pairs[:2]], beam_size=1)
    assert all(isinstance(text, str) and text for text in translations)


def test_init_from_a_preset_directory_keeps_its_tokenizer_architecture_and_weights(tmp_path, monkeypatch):
    """Our own preset (shared SentencePiece vocabulary, learned positions) is fine-tuned as an imported checkpoint."""
    from keras_transformer.tokenizers.sentencepiece import train_tokenizer

    src, tgt = _write_pairs(tmp_path, "train", _short_pairs(24))
    trained = tmp_path / "trained"
    tiny_model(vocabulary_size=120, position_encoding="learned", max_sequence_length=40).save_to_preset(
        trained, tokenizer=train_tokenizer([src, tgt], vocabulary_size=120))
    expected = kt.TransformerModel.from_preset(str(trained))

    class Stop(Exception):
        pass

    def stop_before_fitting(run, data, model, strategy_name):
        def architecture(m):
            return {k: v for k, v in m.get_config().items() if k != "name"}

        assert architecture(model) == architecture(expected)
        for want, got in zip(_weights(expected), _weights(model), strict=True):
            np.testing.assert_array_equal(got, want)
        raise Stop()

    monkeypatch.setattr(training.prepare, "train_tokenizer", None)  # calling it would fail the test
    monkeypatch.setattr(training.run, "_fit", stop_before_fitting)
    with pytest.raises(Stop):
        training.run_training(tmp_path / "run", init_from=str(trained), train_src=src, train_tgt=tgt, steps=1,
                              tokens_per_batch=400, max_length=40, verbose=0)
    work = tmp_path / "run" / "training"
    assert (work / "tokenizer.model").read_bytes() == (trained / "tokenizer.model").read_bytes()
    assert json.loads((work / "state.json").read_text())["arguments"]["init_from"] == str(trained)


def test_init_from_a_pretrained_preset_name_resolves_from_the_hub_cache(tmp_path, monkeypatch, cached_opus_mt_en_de):
    src, tgt = _write_pairs(tmp_path, "train", _short_pairs(8))
    expected = kt.TransformerModel.from_preset(cached_opus_mt_en_de)

    class Stop(Exception):
        pass

    def stop_before_fitting(run, data, model, strategy_name):
        for want, got in zip(_weights(expected), _weights(model), strict=True):
            np.testing.assert_array_equal(got, want)
        raise Stop()

    monkeypatch.setattr(training.run, "_fit", stop_before_fitting)
    with pytest.raises(Stop):
        training.run_training(tmp_path / "run", init_from="opus_mt_en_de", train_src=src, train_tgt=tgt, steps=1,
                              tokens_per_batch=400, max_length=64, verbose=0)
    work = tmp_path / "run" / "training"
    assert json.loads((work / "state.json").read_text())["arguments"]["init_from"] == "opus_mt_en_de"  # a name
    assert (work / "source.spm").read_bytes() == (cached_opus_mt_en_de / "source.spm").read_bytes()


# ---------------------------------------------------------------------- #
# What a fine-tuning run refuses, before it writes anything.
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(preset="tiny", init_from="opus_mt_en_de"), r"Pass --preset .* or --init-from .*, not both"),
        (dict(init_from="tiny"), r"--init-from tiny is an architecture with random weights: train it with --preset tiny"),
        (dict(init_from="opus_mt_en_de", vocabulary_size=300), r"vocabulary_size=300 is for training a new vocabulary"),
        (dict(init_from="opus_mt_en_de", tokenizer_max_sentences=10), r"drop --tokenizer-max-sentences"),
        (dict(init_from="no/such/directory"), r"--init-from 'no/such/directory' is not a directory"),
        (dict(preset="opus_mt_en_de"), r"is a pretrained checkpoint, .*fine-tune it with --init-from opus_mt_en_de"),
        (dict(preset=OFFLINE_HANDLE), r"fine-tune it with --init-from hf://"),
    ],
)
def test_init_from_refuses_contradictions(tmp_path, arguments, message):
    with pytest.raises(training.BadArgumentError, match=message):
        training.run_training(tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_init_from_refuses_a_checkpoint_it_cannot_fine_tune(tmp_path, marian_random, offline_hub):
    src, tgt = _write_pairs(tmp_path, "train", _short_pairs(4))
    common = dict(train_src=src, train_tgt=tgt, verbose=0)
    cases = [
        (dict(init_from=str(marian_random), model_overrides={"num_layers": 1}), r"Cannot override \['num_layers'\]"),
        (dict(init_from=str(marian_random), max_length=300), r"max_length=300 is longer than the max_sequence_length=256"),
        (dict(init_from=str(marian_random), preset=str(marian_random)), r"not both"),
        (dict(init_from=OFFLINE_HANDLE), r"is not in the Hugging Face cache"),
        (dict(init_from="opus_mt_en_de"), r"is not in the Hugging Face cache"),
    ]
    without_tokenizer = tmp_path / "no-tokenizer"
    tiny_model().save_to_preset(without_tokenizer)
    cases.append((dict(init_from=str(without_tokenizer)), r"has no tokenizer"))
    for arguments, message in cases:
        with pytest.raises(training.UserInputError, match=message):
            training.run_training(tmp_path / "out", **common, **arguments)
        assert not (tmp_path / "out").exists()


def test_preset_directory_of_a_marian_checkpoint_is_refused_as_preset(tmp_path, marian_random):
    with pytest.raises(training.BadArgumentError, match=r"pretrained checkpoint.*--init-from"):
        training.TrainingConfig(preset=str(marian_random))
    assert training.TrainingConfig().model_preset == training.DEFAULT_PRESET == "small"
    assert training.TrainingConfig(init_from=str(marian_random)).model_preset == str(marian_random)


# ---------------------------------------------------------------------- #
# The commands.
# ---------------------------------------------------------------------- #
def test_train_cli_passes_init_from_and_dropout(tmp_path, monkeypatch):
    from keras_transformer import train

    received = {}
    monkeypatch.setattr(train, "run_training", lambda output, **kwargs: received.update(kwargs) or {})
    train.main(["--init-from", "opus_mt_en_de", "--output", str(tmp_path / "out"), "--dropout", "0.2"])
    assert (received["init_from"], received["preset"], received["model_overrides"]) == (
        "opus_mt_en_de", None, {"dropout": 0.2})
    train.main(["--output", str(tmp_path / "out")])
    assert (received["init_from"], received["preset"], received["model_overrides"]) == (None, None, None)


def test_train_cli_refuses_preset_with_init_from_in_one_line(tmp_path, capsys):
    from keras_transformer import train

    with pytest.raises(SystemExit) as exit_info:
        train.main(["--preset", "tiny", "--init-from", "opus_mt_en_de", "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not both" in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_translate_cli_and_evaluate_cli_on_marian_checkpoints(tmp_path, capsys, cached_opus_mt_en_de):
    """A checkpoint directory, an hf:// handle (from the offline cache) and a pretrained preset name."""
    from keras_transformer import evaluate, translate

    directory = str(cached_opus_mt_en_de)
    pairs = _short_pairs(2)
    src, ref = _write_pairs(tmp_path, "test", pairs)
    expected = kt.Translator.from_preset(directory).translate([e for e, _ in pairs], beam_size=1)
    translate.main(["--preset", directory, "--input", src, "--output", str(tmp_path / "out.de"), "--beam-size", "1",
                    "--no-progress"])
    assert (tmp_path / "out.de").read_text(encoding="utf-8").splitlines() == expected
    for preset in (OFFLINE_HANDLE, "opus_mt_en_de"):
        translate.main(["--preset", preset, "--input", src, "--beam-size", "1", "--no-progress"])
        assert capsys.readouterr().out.splitlines() == expected
    evaluate.main(["--preset", directory, "--src", src, "--ref", ref, "--beam-size", "1", "--json", "--no-progress"])
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 2 and result["preset"] == directory and 0.0 <= result["chrf"] <= 100.0


@pytest.mark.parametrize("command", ["translate", "evaluate"])
@pytest.mark.parametrize("preset", [OFFLINE_HANDLE, "opus_mt_en_de"])
def test_translate_cli_and_evaluate_cli_name_an_uncached_handle_in_one_line(tmp_path, capsys, offline_hub, command,
                                                                            preset):
    import importlib

    module = importlib.import_module(f"keras_transformer.{command}")
    src, ref = _write_pairs(tmp_path, "test", [("A test.", "Ein Test.")])
    argv = ["--preset", preset] + (["--input", src] if command == "translate" else ["--src", src, "--ref", ref])
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is not in the Hugging Face cache" in error and OFFLINE_HANDLE in error
