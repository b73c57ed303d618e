"""LoRA fine-tuning with Keras' `Dense.enable_lora` (issue 45, item 3).

Only the adapters train; checkpoints, presets and exports hold the merged kernels; a resume point the adapters.
"""

import json

import h5py
import keras
import numpy as np
import pytest

import keras_transformer as kt
from conftest import BACKEND, TINY_CORPUS, random_ids, resume_after_the_first_interval, tiny_model, to_numpy
from keras_transformer import lora, training
from test_training_durability import _run_until_the_first_resume_point

ATTENTION = ("query", "key", "value", "attention_output")
FEEDFORWARD = ("feedforward_intermediate_dense", "feedforward_output_dense")


def _batch(rng, batch=3, vocabulary_size=50):
    inputs = {"encoder_token_ids": random_ids(rng, batch, 7, vocabulary_size),
              "decoder_token_ids": random_ids(rng, batch, 5, vocabulary_size)}
    inputs["encoder_token_ids"][0, 5:] = 0  # padding, as batches have it
    return inputs, random_ids(rng, batch, 5, vocabulary_size)


def _values(variables):
    return {v.path: np.array(to_numpy(v)) for v in variables}


def _is_factor(variable):
    return variable.name in ("lora_kernel_a", "lora_kernel_b")


@pytest.fixture(scope="module")
def trained():
    """A tiny model (learned positions, logits bias: every kind of weight) with LoRA (alpha 8 / rank 4 = scale 2)
    on attention and feed-forward, after 4 updates on one batch, with its weights before them (read only)."""
    model = tiny_model(position_encoding="learned", logits_bias=True)
    model.enable_lora(4, targets=["attention", "feedforward"], lora_alpha=8)
    model.tokenizer = kt.train_tokenizer(TINY_CORPUS, 50)
    training.compile_model(model, warmup_steps=2)
    before = _values(model.weights)
    batch = _batch(np.random.default_rng(1))
    losses = [float(model.train_on_batch(*batch)[0]) for _ in range(4)]
    return model, before, losses


def _logits(model, inputs):
    return to_numpy(model(inputs, training=False))


# ---------------------------------------------------------------------- #
# What trains.
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "targets, layers",
    [(None, ATTENTION), ("feedforward", FEEDFORWARD), (["attention", "feedforward"], ATTENTION + FEEDFORWARD),
     (["query", "value"], ("query", "value"))],
)
def test_only_the_adapters_of_the_targets_are_trainable(targets, layers):
    model = tiny_model(position_encoding="learned", logits_bias=True)
    parameters = model.count_params()
    model.enable_lora(4, targets=targets)
    assert model.lora_enabled and model.lora_targets == layers
    assert {v.name for v in model.trainable_weights} == {"lora_kernel_a", "lora_kernel_b"}
    adapted = {v.path.rsplit("/", 1)[0] for v in model.trainable_weights}
    # 2 encoder layers (self-attention) and 2 decoder layers (self- and cross-attention), 2 feed-forward each.
    per_layer = {name: 6 if name in ATTENTION else 4 for name in layers}
    assert len(adapted) == sum(per_layer.values())
    assert {path.rsplit("/", 1)[1] for path in adapted} == set(layers)
    # rank * (in + out) per adapted Dense: hidden_dim 16, intermediate_dim 32.
    sizes = {"feedforward_intermediate_dense": 16 + 32, "feedforward_output_dense": 32 + 16}
    expected = sum(count * 4 * sizes.get(name, 16 + 16) for name, count in per_layer.items())
    assert sum(int(np.prod(v.shape)) for v in model.trainable_weights) == expected
    assert model.count_params() == parameters + expected


def test_frozen_weights_never_move_and_the_adapters_do(trained):
    model, before, losses = trained
    assert not any(before[v.path].any() for v in model.weights if v.name == "lora_kernel_b")  # Keras: B = 0
    assert losses[-1] < losses[0]  # the adapters learn
    after = _values(model.weights)
    for variable in model.weights:
        if _is_factor(variable):
            assert not np.array_equal(after[variable.path], before[variable.path]), variable.path
        else:
            np.testing.assert_array_equal(after[variable.path], before[variable.path], err_msg=variable.path)


# ---------------------------------------------------------------------- #
# Merged: the same model without adapters.
# ---------------------------------------------------------------------- #
def test_merged_model_has_numpy_merged_kernels_and_the_same_logits(trained, rng):
    model = trained[0]
    merged = model.merge_lora()
    plain = tiny_model(position_encoding="learned", logits_bias=True)
    assert not merged.lora_enabled and len(merged.weights) == len(plain.weights)
    assert not any(_is_factor(v) for v in merged.weights)
    assert [v.shape for v in merged.trainable_weights] == [v.shape for v in plain.trainable_weights]
    assert merged.tokenizer is model.tokenizer
    merged_values = {v.path.split("/", 1)[1]: to_numpy(v) for v in merged.weights}
    checked = 0
    for layer in lora.lora_layers(model):
        kernel, a, b = (np.asarray(to_numpy(v), "float64") for v in (layer._kernel, layer.lora_kernel_a,
                                                                      layer.lora_kernel_b))
        path = layer._kernel.path.split("/", 1)[1]
        # lora_alpha / rank = 8 / 4.
        np.testing.assert_allclose(merged_values[path], kernel + 2.0 * a @ b, rtol=1e-6, atol=1e-6, err_msg=path)
        assert np.abs(2.0 * a @ b).max() > 1e-4  # trained: the merge changes the kernel
        checked += 1
    assert checked == 32  # 6 attentions x 4 projections, 4 feed-forward networks x 2
    inputs, _ = _batch(rng)
    np.testing.assert_allclose(_logits(merged, inputs), _logits(model, inputs), rtol=0, atol=1e-5)
    assert model.lora_enabled and len(model.trainable_weights) == 64  # the LoRA model is unchanged


def test_save_to_preset_writes_an_ordinary_merged_preset(trained, tmp_path, rng):
    model = trained[0]
    model.save_to_preset(tmp_path / "preset")
    config = json.loads((tmp_path / "preset" / "config.json").read_text())
    assert "lora" not in json.dumps(config)
    loaded = kt.TransformerModel.from_preset(str(tmp_path / "preset"))
    assert not loaded.lora_enabled and not any(_is_factor(v) for v in loaded.weights)
    with h5py.File(tmp_path / "preset" / "model.weights.h5") as handle:
        arrays = []
        handle.visititems(lambda name, item: arrays.append(name) if isinstance(item, h5py.Dataset) else None)
    assert len(arrays) == len(loaded.weights)
    inputs, _ = _batch(rng)
    np.testing.assert_allclose(_logits(loaded, inputs), _logits(model, inputs), rtol=0, atol=1e-5)


def test_weight_files_hold_float32_merged_kernels_under_mixed_precision(tmp_path, rng):
    """Keras merges a LoRA kernel in the compute dtype; a checkpoint must not round the frozen weights to bfloat16."""
    model = tiny_model(dtype="mixed_bfloat16")
    model.enable_lora(2)
    for layer in lora.lora_layers(model):
        layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    model.save_weights(str(tmp_path / "ckpt.weights.h5"))
    assert all(layer.compute_dtype == "bfloat16" for layer in lora.lora_layers(model))  # the policies are back
    plain = tiny_model()
    plain.load_weights(str(tmp_path / "ckpt.weights.h5"))
    for expected, actual in zip(lora.merged_weights(model), plain.get_weights(), strict=True):
        assert actual.dtype == np.float32
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the ONNX and SavedModel exporters run on TensorFlow")
def test_every_exporter_takes_a_lora_model_merged(trained):
    pytest.importorskip("ctranslate2")
    from export import ctranslate2, onnx, saved_model

    model = trained[0]
    exported = [onnx._load_model(model), ctranslate2._load_model(model), saved_model._load(model, None)[0]]
    expected = lora.merged_weights(model)
    for loaded in exported:
        assert not loaded.lora_enabled and loaded.tokenizer is model.tokenizer
        for want, got in zip(expected, loaded.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want)
    plain = tiny_model()
    assert onnx._load_model(plain) is plain  # a model without LoRA is exported as it is


# ---------------------------------------------------------------------- #
# Resume: the adapters and the frozen kernels come back exactly.
# ---------------------------------------------------------------------- #
def test_a_lora_resume_point_continues_bit_for_bit(tmp_path):
    """Keras' weight file holds merged kernels and no adapters; the resume point keeps W, A and B themselves."""
    def lora_model(seed):
        model = tiny_model(vocabulary_size=20, dropout=0.3, seed=seed)
        model.enable_lora(2, targets=["attention", "feedforward"])
        training.compile_model(model, warmup_steps=10, learning_rate_scale=10.0)
        return model

    model, resumed, first = resume_after_the_first_interval(tmp_path, lora_model)

    merged_only = lora_model(7)
    merged_only.optimizer.build(merged_only.trainable_variables)
    merged_only.load_weights(str(first))  # what Keras alone restores: merged kernels, adapters zero
    assert not any(to_numpy(v).any() for v in merged_only.weights if _is_factor(v))

    for expected, actual in zip(model.weights, resumed.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(actual), to_numpy(expected), err_msg=expected.path)


def test_a_resume_point_and_a_model_that_disagree_on_lora_are_refused(tmp_path):
    plain, with_lora = tiny_model(), tiny_model()
    with_lora.enable_lora(2)
    for model in (plain, with_lora):
        training.compile_model(model)
        model.optimizer.build(model.trainable_variables)
    training.save_resume_point(plain, tmp_path / "plain.weights.h5", 1)
    training.save_resume_point(with_lora, tmp_path / "lora.weights.h5", 1)
    with pytest.raises(ValueError, match=r"plain.weights.h5 holds no LoRA state; the model has LoRA rank=2"):
        training.load_resume_point(with_lora, tmp_path / "plain.weights.h5")
    other_rank = tiny_model()
    other_rank.enable_lora(3)
    training.compile_model(other_rank)
    with pytest.raises(ValueError, match=r"holds LoRA rank=2; the model has LoRA rank=3"):
        training.load_resume_point(other_rank, tmp_path / "lora.weights.h5")


# ---------------------------------------------------------------------- #
# run_training(lora_rank=...): averaged merged checkpoints, an ordinary preset, resume.
# ---------------------------------------------------------------------- #
def _tiny_trained_preset(tmp_path):
    """The `tiny` preset with a tokenizer, as a fine-tuning run's `init_from`, and a copy task's files."""
    directory = tmp_path / "tiny"
    keras.utils.set_random_seed(3)
    model = kt.TransformerModel.from_preset("tiny", vocabulary_size=60, max_sequence_length=32, dropout=0.0)
    model.save_to_preset(directory, tokenizer=kt.train_tokenizer(TINY_CORPUS, 60))
    text = "".join(line + "\n" for line in TINY_CORPUS)
    (tmp_path / "train.src").write_text(text, encoding="utf-8")
    (tmp_path / "train.tgt").write_text(text, encoding="utf-8")
    return dict(init_from=str(directory), train_src=str(tmp_path / "train.src"), train_tgt=str(tmp_path / "train.tgt"),
                tokens_per_batch=256, max_length=32, warmup_steps=2, learning_rate_scale=5.0, verbose=0)


@pytest.mark.slow
def test_a_lora_run_resumes_with_lora_and_writes_an_ordinary_preset_of_the_averaged_merged_checkpoints(
    tmp_path, monkeypatch
):
    arguments = dict(_tiny_trained_preset(tmp_path), lora_rank=4, lora_targets="feedforward", steps=2,
                     checkpoint_every=1, average_last=2)
    output = tmp_path / "run"
    _run_until_the_first_resume_point(monkeypatch, output, arguments)  # as if killed there
    resume_path = output / "training" / "backup" / training.RESUME_FILE
    with h5py.File(resume_path) as handle:
        assert int(handle[lora.RESUME_GROUP].attrs["rank"]) == 4
    state = json.loads((output / "training" / "state.json").read_text())
    assert (state["arguments"]["lora_rank"], state["arguments"]["lora_targets"]) == (4, list(FEEDFORWARD))
    with pytest.raises(training.BadArgumentError, match=r"lora_rank=8 \(was 4\).*Repeat the original arguments"):
        training.run_training(output, **{**arguments, "lora_rank": 8})

    inputs = {"encoder_token_ids": np.array([[5, 9, 12, 3, 0]], "int32"),
              "decoder_token_ids": np.array([[2, 7, 11, 6]], "int32")}
    seen = {}
    build, fit = training._build_model, training._fit

    def build_and_look(run, data):
        model, strategy_name = build(run, data)
        seen["built"] = (model.lora_rank, model.lora_targets, int(to_numpy(model.optimizer.iterations)))
        return model, strategy_name

    def fit_and_look(run, data, model, strategy_name):
        loss = fit(run, data, model, strategy_name)
        seen["trainable"] = {v.name for v in model.trainable_weights}
        seen["logits"] = _logits(model, inputs)
        return loss

    monkeypatch.setattr(training.run, "_build_model", build_and_look)
    monkeypatch.setattr(training.run, "_fit", fit_and_look)
    # The targets by their layers' names are the same run as "feedforward".
    metadata = training.run_training(output, **{**arguments, "lora_targets": list(FEEDFORWARD)})
    assert seen["built"] == (4, FEEDFORWARD, 1)  # LoRA enabled before the resume point was loaded
    assert seen["trainable"] == {"lora_kernel_a", "lora_kernel_b"}
    assert metadata["steps"] == 2 and metadata["lora"] == {"rank": 4, "targets": list(FEEDFORWARD)}

    preset = kt.TransformerModel.from_preset(str(output))
    assert not preset.lora_enabled and not any(_is_factor(v) for v in preset.weights)
    assert "lora" not in (output / "config.json").read_text()
    # The checkpoints are ordinary (merged) weight files: the last one is the trained LoRA model.
    checkpoints = training.list_checkpoints(output / "training" / "checkpoints")
    assert [p.name for p in checkpoints] == metadata["averaged_checkpoints"] == [
        "ckpt-00000001.weights.h5", "ckpt-00000002.weights.h5"]
    each = []
    for path in checkpoints:
        plain = kt.TransformerModel.from_preset(str(output))
        plain.load_weights(str(path))
        each.append(plain.get_weights())
    last = kt.TransformerModel.from_preset(str(output))
    last.set_weights(each[-1])
    np.testing.assert_allclose(_logits(last, inputs), seen["logits"], rtol=0, atol=1e-5)
    # The preset is their average (paper section 6.1): the merged kernels averaged.
    for first, second, got in zip(*each, preset.get_weights(), strict=True):
        np.testing.assert_allclose(got, (first.astype("float64") + second) / 2, rtol=0, atol=1e-6)
    assert any(not np.array_equal(first, second) for first, second in zip(*each))


# ---------------------------------------------------------------------- #
# Bad input: one line naming the value.
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(rank=0), r"rank=0 must be a positive integer"),
        (dict(rank=2.5), r"rank=2.5 must be a positive integer"),
        (dict(rank=True), r"rank=True must be a positive integer"),
        (dict(rank="4"), r"rank='4' must be a positive integer"),
        (dict(rank=4, targets=["attention", "attn"]), r"targets=\['attention', 'attn'\]: unknown 'attn'; allowed: "
                                                      r"'attention', 'feedforward', 'query'"),
        (dict(rank=4, targets=[]), r"targets=\[\] must be one or more of 'attention'"),
        (dict(rank=4, targets=7), r"targets=7 must be one or more of"),
        (dict(rank=4, lora_alpha=0), r"lora_alpha=0 must be None \(= rank\) or a positive number"),
        (dict(rank=4, lora_alpha="big"), r"lora_alpha='big' must be"),
    ],
)
def test_enable_lora_refuses_bad_arguments_and_changes_nothing(arguments, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        model.enable_lora(**arguments)
    assert not model.lora_enabled and len(model.trainable_weights) == len(model.weights)


def test_enable_lora_twice_and_merge_without_lora_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"merge_lora: this model has no LoRA adapters; call enable_lora"):
        model.merge_lora()
    model.enable_lora(2)
    with pytest.raises(ValueError, match=r"LoRA is already enabled on this model \(rank=2, targets=\['query'"):
        model.enable_lora(4, targets="feedforward")
    assert len(model.trainable_weights) == 48


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(init_from="opus_mt_en_de", lora_rank=0), r"lora_rank=0 must be an integer >= 1"),
        (dict(init_from="opus_mt_en_de", lora_rank="8"), r"lora_rank='8' must be an integer >= 1"),
        (dict(init_from="opus_mt_en_de", lora_rank=8, lora_targets=["ffn"]), r"lora_targets=\['ffn'\]: unknown 'ffn'"),
        (dict(init_from="opus_mt_en_de", lora_targets="attention"), r"lora_targets='attention' needs lora_rank"),
        (dict(preset="tiny", lora_rank=8), r"lora_rank=8 adapts a trained model: pass --init-from"),
        (dict(lora_rank=8), r"lora_rank=8 adapts a trained model"),
    ],
)
def test_run_training_refuses_bad_lora_arguments_before_writing(tmp_path, arguments, message):
    with pytest.raises(training.BadArgumentError, match=message):
        training.run_training(tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_train_cli_passes_lora_and_refuses_it_in_one_line(tmp_path, monkeypatch, capsys):
    from keras_transformer import train

    received = {}
    with monkeypatch.context() as patch:
        patch.setattr(train, "run_training", lambda output, **kwargs: received.update(kwargs) or {})
        train.main(["--init-from", "opus_mt_en_de", "--output", str(tmp_path / "out"), "--lora-rank", "8",
                    "--lora-targets", "attention", "feedforward"])
        assert (received["lora_rank"], received["lora_targets"]) == (8, ["attention", "feedforward"])
        train.main(["--init-from", "opus_mt_en_de", "--output", str(tmp_path / "out")])
        assert (received["lora_rank"], received["lora_targets"]) == (None, None)
    capsys.readouterr()
    for argv, message in [
        (["--preset", "tiny", "--lora-rank", "4"], "lora_rank=4 adapts a trained model: pass --init-from"),
        (["--init-from", "opus_mt_en_de", "--lora-rank", "0"], "--lora-rank"),
        (["--init-from", "opus_mt_en_de", "--lora-rank", "4", "--lora-targets", "ffn"], "invalid choice: 'ffn'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            train.main([*argv, "--output", str(tmp_path / "out")])
        error = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert message in error and "Traceback" not in error and error.strip().splitlines()[-1].count("error:") == 1
    assert not (tmp_path / "out").exists()
