"""Keras' own int8 quantization (`TransformerModel.quantize("int8")`) on every backend.

The int8 quality on a trained model (BLEU against float32) is measured by
`python -m benchmarks.keras_int8` (benchmarks/README.md); here: what is
quantized, how close the logits stay, that the search runs the quantized
model, the preset round trip, and the one-line refusals.
"""

import json
import logging
import warnings

import h5py
import keras
import numpy as np
import pytest

from conftest import BACKEND, TINY_CORPUS, random_ids, tiny_model, to_numpy
import keras_transformer as kt
from keras_transformer.layers.dense import Dense
from keras_transformer.translator import Translator

START, END = 2, 3
# Keras' int8 rounds each weight to 1/254 of its output channel's largest
# magnitude and each input row to 1/254 of its largest, so every product
# is off by a few tenths of a percent, and the errors add up through the
# 2 + 2 layers. Measured on these tiny models: the largest logit change is
# 0.04-0.08 of the float32 logits' standard deviation (three seeds, d_model
# 16 and 64, three backends); twice that is the bound. A change below 1e-4
# would mean nothing was quantized.
LOGITS_TOLERANCE = 0.15  # x the float32 logits' standard deviation


def batch(rng, rows=3, source_length=9, target_length=7):
    src = random_ids(rng, rows, source_length)
    src[:, -1] = END
    src[-1, 5:] = 0  # a padded row
    src[-1, 4] = END
    tgt = random_ids(rng, rows, target_length)
    tgt[:, 0] = START
    return src, tgt


def logits(model, src, tgt):
    return to_numpy(model({"encoder_token_ids": src, "decoder_token_ids": tgt}))


def quantized(**overrides):
    model = tiny_model(**overrides)
    model.quantize("int8")
    return model


def test_every_projection_and_the_shared_embedding_are_int8():
    model = quantized()
    dense = [layer for layer in model._flatten_layers() if isinstance(layer, Dense)]
    # Per encoder layer W^Q, W^K, W^V, W^O, W_1, W_2; per decoder layer those and the cross-attention's four.
    assert len(dense) == 2 * 6 + 2 * 10
    assert all(layer.quantization_mode == "int8" and layer._kernel.dtype == "int8" for layer in dense)
    assert model.token_embedding.quantization_mode == "int8"
    assert model.token_embedding.embeddings.dtype == "int8"
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.LayerNormalization)]
    assert norms and all(layer.quantization_mode is None and layer.gamma.dtype == "float32" for layer in norms)
    assert model.quantization == "int8" and tiny_model().quantization is None


def test_logits_stay_close_to_float32(rng):
    src, tgt = batch(rng)
    for seed in (1234, 7):
        expected, found = logits(tiny_model(seed=seed), src, tgt), logits(quantized(seed=seed), src, tgt)
        difference = np.abs(found - expected).max()
        assert 1e-4 < difference < LOGITS_TOLERANCE * expected.std(), (seed, difference, expected.std())


def test_the_tied_output_projection_reads_the_int8_embedding(rng):
    """The logits are the final states times the one int8 matrix (transposed), descaled per token."""
    model = quantized(logits_bias=True)
    src, tgt = batch(rng)
    model.logits_bias_weight.assign(np.linspace(-1, 1, model.vocabulary_size).astype("float32"))
    embedding = model.token_embedding
    states = []  # the decoder's final states, as `_logits` receives them
    original = model._logits
    model._logits = lambda x: states.append(to_numpy(x)) or original(x)
    found = logits(model, src, tgt)
    # NumPy reference of Keras' int8 product: the states quantized per row (AbsMaxQuantizer: scale
    # 127 / max |x|, rounded half to even), times the int8 matrix transposed, descaled by both scales.
    x = states[0].astype("float64")  # [B, T, D]
    x_scale = 127.0 / (np.abs(x).max(-1, keepdims=True) + keras.backend.epsilon())
    x_int = np.clip(np.round(x * x_scale), -127, 127)
    table = to_numpy(embedding._embeddings).astype("float64")  # [V, D] int8 values
    expected = (x_int @ table.T) / (x_scale * to_numpy(embedding.embeddings_scale))
    expected += to_numpy(model.logits_bias_weight)
    np.testing.assert_allclose(found, expected, rtol=1e-4, atol=1e-4)
    # The same matrix (dequantized) is what the lookup reads.
    lookup = to_numpy(embedding(np.array([[5, 9]], "int32")))[0]
    np.testing.assert_allclose(lookup, table[[5, 9]] / to_numpy(embedding.embeddings_scale)[[5, 9], None], rtol=1e-6)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_greedy_search_runs_the_quantized_model(rng, compile):
    """Greedy output = the teacher-forced argmax of the quantized model (so the search ran it, cached)."""
    from keras_transformer.generation import generate

    model = quantized()
    src, _ = batch(rng, rows=3)
    ids = generate(model, src, beam_size=1, max_extra_length=6, compile=compile)
    expected = logits(model, src, ids[:, :-1])
    expected[..., [0, START]] = -np.inf  # never chosen by the search
    max_lengths = (src > 0).sum(1) + 6
    checked = 0
    for row in range(len(src)):
        end = int(np.flatnonzero(ids[row] == END)[0])
        for t in range(1, min(end, max_lengths[row] - 1) + 1):
            assert ids[row, t] == expected[row, t - 1].argmax(), (row, t)
            checked += 1
    assert checked >= 10
    beams = model.generate(src, beam_size=4, max_extra_length=6)
    assert beams.dtype == np.int32 and (beams[:, 0] == START).all() and ((beams == END).sum(1) == 1).all()


def test_a_search_compiled_before_quantize_is_not_reused(rng):
    """`generate` on the float32 model, then `quantize`: the next search runs the int8 model, not the traced float32."""
    model, reference = tiny_model(), quantized()
    src = random_ids(rng, 8, 6)  # 8 rows: the segmented search on TensorFlow and JAX
    src[:, -1] = END
    model.generate_hypotheses(src, beam_size=1, max_extra_length=5)
    model.quantize("int8")
    found = model.generate_hypotheses(src, beam_size=1, max_extra_length=5)
    expected = reference.generate_hypotheses(src, beam_size=1, max_extra_length=5)
    np.testing.assert_array_equal(found.sequences, expected.sequences)
    # The log-probabilities tell int8 from float32 even where the tokens agree.
    np.testing.assert_allclose(found.log_probs, expected.log_probs, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def quantized_preset(tmp_path_factory):
    """A float32 preset with a tokenizer, and the same model quantized and saved as a preset: (float_dir, int8_dir).

    Read only: copy a directory to change it.
    """
    tokenizer = kt.train_tokenizer(TINY_CORPUS, 60)
    root = tmp_path_factory.mktemp("presets")
    float_dir, int8_dir = root / "float32", root / "int8"
    tiny_model(vocabulary_size=60).save_to_preset(float_dir, tokenizer=tokenizer)
    quantized(vocabulary_size=60).save_to_preset(int8_dir, tokenizer=tokenizer)
    return float_dir, int8_dir


def test_preset_round_trip_gives_identical_logits_and_tokens(quantized_preset, rng):
    float_dir, int8_dir = quantized_preset
    saved = json.loads((int8_dir / "config.json").read_text())
    assert saved["quantization"] == "int8" and saved["format_version"] == 3
    assert "quantization" not in json.loads((float_dir / "config.json").read_text())
    with h5py.File(int8_dir / "model.weights.h5") as handle:
        dtypes = []
        handle.visititems(lambda name, item: dtypes.append(item.dtype) if isinstance(item, h5py.Dataset) else None)
    assert dtypes.count(np.dtype("int8")) == 1 + 32  # the embedding and the 32 kernels
    assert (int8_dir / "model.weights.h5").stat().st_size < (float_dir / "model.weights.h5").stat().st_size
    src, tgt = batch(rng, source_length=9)
    src, tgt = src % 60, tgt % 60
    reference = quantized(vocabulary_size=60)
    loaded = kt.TransformerModel.from_preset(int8_dir)
    assert loaded.quantization == "int8"
    np.testing.assert_array_equal(logits(loaded, src, tgt), logits(reference, src, tgt))
    np.testing.assert_array_equal(loaded.generate(src, beam_size=4), reference.generate(src, beam_size=4))
    # Quantized on loading: the same int8 weights as quantizing the float32 model.
    from_float = kt.TransformerModel.from_preset(float_dir, quantize="int8")
    np.testing.assert_array_equal(logits(from_float, src, tgt), logits(reference, src, tgt))
    # An int8 preset is int8 with or without the option.
    assert kt.TransformerModel.from_preset(int8_dir, quantize="int8").quantization == "int8"


def test_translator_and_the_command_translate_with_int8(quantized_preset, tmp_path, capsys):
    from keras_transformer.evaluate import main as evaluate_main
    from keras_transformer.translate import main as translate_main

    float_dir, int8_dir = quantized_preset
    texts = ["the cat sees a dog.", "my bird likes the big fish."]
    translator = Translator.from_preset(float_dir, quantize="int8")
    assert translator.model.quantization == "int8"
    found = translator.translate(texts, beam_size=4, max_extra_length=4)
    assert found == Translator.from_preset(int8_dir).translate(texts, beam_size=4, max_extra_length=4)
    src = tmp_path / "in.en"
    src.write_text("\n".join(texts) + "\n")
    translate_main(["--preset", str(float_dir), "--quantize", "int8", "--src", str(src), "--max-extra-length", "4",
                    "--no-progress"])
    assert capsys.readouterr().out.split("\n")[:-1] == found
    ref = tmp_path / "ref.de"
    ref.write_text("die katze sieht einen hund.\nmein vogel mag den großen fisch.\n")
    evaluate_main(["--preset", str(float_dir), "--quantize", "int8", "--src", str(src), "--ref", str(ref),
                   "--max-extra-length", "4", "--json", "--no-progress"])
    assert json.loads(capsys.readouterr().out)["quantize"] == "int8"
    with pytest.raises(SystemExit) as error:
        translate_main(["--preset", str(float_dir), "--quantize", "int4"])
    assert error.value.code == 2
    assert "error: argument --quantize: invalid choice: 'int4' (choose from 'int8')" in capsys.readouterr().err


def test_lines_name_what_keras_cannot_quantize(caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "keras_transformer"):
        warnings.simplefilter("always")
        quantized()
        quantized(position_encoding="learned")
    assert not [w for w in caught if "quantize" in str(w.message)]  # Keras' per-layer warnings, replaced by:
    records = [r for r in caplog.records if r.name == "keras_transformer.quantization"]
    assert [r.levelname for r in records] == ["INFO", "WARNING"]
    assert records[0].getMessage() == (
        "quantize('int8'): 1 ReversibleEmbedding, 32 Dense quantized; left float32: 10 LayerNormalization"
    )
    assert records[1].getMessage().startswith(
        "quantize('int8'): Keras cannot quantize encoder_position (LearnedPositionEmbedding), "
        "decoder_position (LearnedPositionEmbedding), left float32"
    )


def test_refusals_are_one_line(quantized_preset):
    model = quantized()
    with pytest.raises(ValueError, match=r"^quantize\('int8'\): the model is already quantized \('int8'\); "):
        model.quantize("int8")
    with pytest.raises(ValueError, match=r"^quantize='int4' must be None \(float32\) or one of 'int8' "):
        tiny_model().quantize("int4")
    float_dir, int8_dir = quantized_preset
    with pytest.raises(ValueError, match=r"^quantize='int4' must be None"):
        kt.TransformerModel.from_preset(float_dir, quantize="int4")
    lora = tiny_model()
    lora.enable_lora(2)
    with pytest.raises(ValueError, match=r"LoRA adapters \(rank=2\) is not supported: quantize the merged model, "
                                         r"model\.merge_lora\(\)\.quantize\('int8'\)"):
        lora.quantize("int8")
    with pytest.raises(ValueError, match=r"enable_lora on a quantized model \(quantization_mode='int8'\)"):
        model.enable_lora(2)


@pytest.mark.parametrize("edit, match", [
    (dict(quantization="int4"), r"config\.json: quantization='int4' must be None \(float32\) or one of 'int8'"),
    (dict(format_version=2), r"config\.json has format_version=2 and quantization='int8': format 3 \(and only it\)"),
    (dict(quantization=None), r"config\.json has format_version=3 and quantization=None: format 3"),
])
def test_a_preset_config_with_a_bad_quantization_is_refused(quantized_preset, tmp_path, edit, match):
    import shutil

    int8_dir = shutil.copytree(quantized_preset[1], tmp_path / "int8")
    path = int8_dir / "config.json"
    saved = json.loads(path.read_text())
    saved.update(edit)
    if saved["quantization"] is None:
        del saved["quantization"]
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=match):
        kt.TransformerModel.from_preset(int8_dir)


def test_exporters_refuse_a_keras_int8_model(tmp_path):
    from keras_transformer.quantization import refuse_quantized

    model = quantized()
    refuse_quantized(tiny_model(), "python -m export.onnx", "--quantize int8")  # a float model passes
    with pytest.raises(ValueError, match=r"^python -m export\.onnx: the model is quantized by Keras \('int8'\), "
                                         r"which this exporter does not read; export the float32 preset, with "
                                         r"--quantize int8$"):
        refuse_quantized(model, "python -m export.onnx", "--quantize int8")
    exporters = []
    if BACKEND == "tensorflow":
        pytest.importorskip("tf2onnx")
        from export.onnx import export_onnx

        exporters.append((export_onnx, r"python -m export\.onnx: .* with --quantize int8 \(ONNX Runtime's int8\)"))
    try:
        from export.ctranslate2 import _import_ctranslate2, export_ctranslate2

        _import_ctranslate2()
        exporters.append((export_ctranslate2, r"python -m export\.ctranslate2: .* with --quantization int8"))
    except ImportError:
        pass
    for export, match in exporters:
        with pytest.raises(ValueError, match=match):
            export(model, tmp_path / export.__name__)
        assert not (tmp_path / export.__name__).exists()


def test_fine_tuning_refuses_an_int8_preset(quantized_preset, tmp_path):
    from keras_transformer import training

    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("the cat sees a dog.\na dog likes the cat.\n")
    tgt.write_text("die katze sieht einen hund.\nein hund mag die katze.\n")
    with pytest.raises(training.UserInputError, match=r"--init-from .*int8 is quantized \('int8'\): its int8 "
                                                      r"weights cannot be trained; fine-tune the float32 preset"):
        training.run_training(tmp_path / "out", init_from=str(quantized_preset[1]), train_src=str(src),
                              train_tgt=str(tgt), verbose=0)
    assert not (tmp_path / "out").exists()
