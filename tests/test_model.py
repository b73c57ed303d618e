import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.model import INPUT_NAMES
from conftest import BACKEND, random_ids, tiny_model, to_numpy


def logits(model, src, tgt):
    return to_numpy(model({"encoder_token_ids": src, "decoder_token_ids": tgt}))


def test_output_shape_and_dtype(rng):
    model = tiny_model()
    out = logits(model, random_ids(rng, 3, 7), random_ids(rng, 3, 5))
    assert out.shape == (3, 5, 50)
    assert out.dtype == np.float32
    assert tuple(model.encode(random_ids(rng, 3, 7)).shape) == (3, 7, 16)


def test_embedding_matrix_is_shared_with_the_output_projection(rng):
    model = tiny_model()
    embeddings = [w for w in model.weights if "embeddings" in w.path and "token_embedding" in w.path]
    assert len(embeddings) == 1, [w.path for w in model.weights]
    # Logits are the decoder output times the (shared) embedding matrix transposed.
    table = to_numpy(embeddings[0])
    assert table.shape == (50, 16)
    src, tgt = random_ids(rng, 1, 4), random_ids(rng, 1, 3)
    before = logits(model, src, tgt)
    embeddings[0].assign(table * 2.0)
    assert not np.allclose(before, logits(model, src, tgt))


def test_config_round_trip():
    model = tiny_model(key_dim=3, value_dim=5, position_encoding="learned", normalize_first=True,
                       attention_window=5, num_decoder_layers=3)
    clone = kt.TransformerModel.from_config(model.get_config())
    assert clone.get_config() == model.get_config()
    assert clone.count_params() == model.count_params()


def test_keras_file_round_trip(tmp_path, rng):
    model = tiny_model(position_encoding="learned")
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 4)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kt.TransformerModel)
    np.testing.assert_allclose(logits(loaded, src, tgt), logits(model, src, tgt), rtol=1e-6, atol=1e-6)


def test_build_on_the_built_model_keeps_its_weights(tmp_path, rng):
    # The constructor builds the model; `model.build(...)` as called on any
    # Keras model must leave it as it is.
    model = tiny_model()
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 4)
    before, count = logits(model, src, tgt), len(model.weights)
    model.build({"encoder_token_ids": (2, 6), "decoder_token_ids": (2, 4)})
    model.build()
    assert len(model.weights) == count
    np.testing.assert_array_equal(logits(model, src, tgt), before)
    path = str(tmp_path / "model.keras")
    model.save(path)
    np.testing.assert_allclose(logits(keras.saving.load_model(path), src, tgt), before, rtol=1e-6, atol=1e-6)


def test_preset_directory_round_trip_gives_identical_logits(tmp_path, rng):
    model = tiny_model()
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 4)
    model.save_to_preset(tmp_path / "preset", metadata={"note": "test"})
    assert sorted(os.listdir(tmp_path / "preset")) == ["config.json", "metadata.json", "model.weights.h5"]
    assert json.loads((tmp_path / "preset" / "metadata.json").read_text()) == {"note": "test"}
    loaded = kt.TransformerModel.from_preset(str(tmp_path / "preset"))
    np.testing.assert_array_equal(logits(loaded, src, tgt), logits(model, src, tgt))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "staging directory left behind"


def test_save_to_preset_refuses_to_overwrite(tmp_path):
    model = tiny_model()
    model.save_to_preset(tmp_path / "p")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        model.save_to_preset(tmp_path / "p")
    model.save_to_preset(tmp_path / "p", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["p"]
    # overwrite=True replaces an earlier preset only, never a directory of other files.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files but is not a preset directory .save_to_preset., so it is not"):
        model.save_to_preset(tmp_path / "mine", overwrite=True)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


@pytest.mark.parametrize("missing", ["config.json", "model.weights.h5"])
def test_preset_directory_missing_file_is_named(tmp_path, missing):
    tiny_model().save_to_preset(tmp_path / "p")
    os.remove(tmp_path / "p" / missing)
    with pytest.raises(FileNotFoundError, match=missing):
        kt.TransformerModel.from_preset(str(tmp_path / "p"))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="base, big, big_en_fr, small, tiny"):
        kt.TransformerModel.from_preset("huge")


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        kt.TransformerModel.from_preset("tiny", hidden_size=8)


def test_presets_property_describes_every_preset():
    architectures = {"base", "big", "big_en_fr", "small", "tiny"}
    pretrained = {"opus_mt_en_de", "opus_mt_de_en", "opus_mt_en_fr", "opus_mt_fr_en", "opus_mt_en_es", "opus_mt_es_en",
                  "nllb_200_distilled_600m", "nllb_200_distilled_1_3b"}
    assert set(kt.TransformerModel.presets) == architectures | pretrained
    assert all(isinstance(d, str) and d for d in kt.TransformerModel.presets.values())


def test_from_preset_applies_overrides():
    model = kt.TransformerModel.from_preset("tiny", vocabulary_size=123, dropout=0.0)
    assert model.vocabulary_size == 123 and model.dropout == 0.0


def test_causality(rng):
    """Changing future target tokens leaves earlier logits unchanged."""
    model = tiny_model()
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 8)
    changed = tgt.copy()
    changed[:, 5:] = random_ids(rng, 2, 3)
    a, b = logits(model, src, tgt), logits(model, src, changed)
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_source_padding_invariance(rng):
    model = tiny_model()
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 5)
    padded = np.concatenate([src, np.zeros((2, 4), "int32")], axis=1)
    np.testing.assert_allclose(logits(model, padded, tgt), logits(model, src, tgt), rtol=1e-5, atol=1e-5)


def test_target_padding_invariance(rng):
    model = tiny_model()
    src, tgt = random_ids(rng, 2, 6), random_ids(rng, 2, 5)
    padded = np.concatenate([tgt, np.zeros((2, 3), "int32")], axis=1)
    np.testing.assert_allclose(logits(model, src, padded)[:, :5], logits(model, src, tgt), rtol=1e-5, atol=1e-5)


def test_batch_rows_are_independent(rng):
    model = tiny_model()
    src = random_ids(rng, 3, 6)
    src[1, 3:] = 0  # a shorter source in the middle of the batch
    tgt = random_ids(rng, 3, 4)
    batch = logits(model, src, tgt)
    for i in range(3):
        length = int((src[i] > 0).sum())
        alone = logits(model, src[i:i + 1, :length], tgt[i:i + 1])
        np.testing.assert_allclose(batch[i], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"position_encoding": "learned"}, {"normalize_first": True}, {"key_dim": 3, "value_dim": 6},
     {"attention_window": 3}, {"key_dim": 3}],
    ids=["paper", "learned", "pre_ln", "dk_dv", "window", "dk_only"],
)
def test_cached_decoding_equals_full_decoding(rng, overrides):
    model = tiny_model(**overrides)
    src = random_ids(rng, 2, 7)
    src[0, 4:] = 0
    tgt = random_ids(rng, 2, 6)
    full = logits(model, src, tgt)
    cache = model.init_cache(model.encode(src), src, max_length=6)
    for t in range(6):
        step, cache = model.decode_step(tgt[:, t], t, cache)
        np.testing.assert_allclose(to_numpy(step), full[:, t], rtol=1e-5, atol=1e-5)


def closed_form_parameter_count(vocabulary, n, d_model, d_ff, h, d_k, d_v):
    """Parameters of the paper's architecture with a shared embedding matrix.

    Per attention block: W^Q, W^K (d_model x h d_k, + biases), W^V (d_model x
    h d_v + bias), W^O (h d_v x d_model + bias). FFN: d_model x d_ff + d_ff +
    d_ff x d_model + d_model. LayerNorm: 2 d_model. Encoder layer: 1 attention,
    1 FFN, 2 norms; decoder layer: 2 attentions, 1 FFN, 3 norms. Sinusoidal
    positions have no parameters.
    """
    attention = 2 * (d_model * h * d_k + h * d_k) + (d_model * h * d_v + h * d_v) + (h * d_v * d_model + d_model)
    ffn = d_model * d_ff + d_ff + d_ff * d_model + d_model
    norm = 2 * d_model
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return vocabulary * d_model + n * (encoder_layer + decoder_layer)


@pytest.mark.parametrize(
    "preset,dims,paper_millions",
    [("base", (37000, 6, 512, 2048, 8, 64, 64), 65), ("big", (37000, 6, 1024, 4096, 16, 64, 64), 213)],
)
def test_parameter_counts_match_closed_form(preset, dims, paper_millions):
    model = kt.TransformerModel.from_preset(preset)
    expected = closed_form_parameter_count(*dims)
    assert model.count_params() == expected
    # Within 4% of the paper's rounded figure (docs/presets.md explains the difference).
    assert abs(expected / 1e6 - paper_millions) / paper_millions < 0.04


# Paper Table 3: every row is a constructor call (vocabulary shrunk to keep the test fast).
TABLE_3 = {
    "A1": dict(num_heads=1, key_dim=512, value_dim=512),
    "A2": dict(num_heads=4, key_dim=128, value_dim=128),
    "A3": dict(num_heads=16, key_dim=32, value_dim=32),
    "A4": dict(num_heads=32, key_dim=16, value_dim=16),
    "B1": dict(key_dim=16, value_dim=64),
    "B2": dict(key_dim=32, value_dim=64),
    "B1_key_dim_only": dict(key_dim=16),  # the paper's row B: d_v stays 64
    "C_N2": dict(num_layers=2),
    "C_N4": dict(num_layers=4),
    "C_N8": dict(num_layers=8),
    "C_d256": dict(hidden_dim=256, key_dim=32, value_dim=32),
    "C_d1024": dict(hidden_dim=1024, key_dim=128, value_dim=128),
    "C_ff1024": dict(intermediate_dim=1024),
    "C_ff4096": dict(intermediate_dim=4096),
    "D_drop0": dict(dropout=0.0),
    "D_drop02": dict(dropout=0.2),
    "E_learned": dict(position_encoding="learned"),
}


@pytest.mark.parametrize("row", sorted(TABLE_3))
def test_table_3_variant_is_expressible(row):
    overrides = TABLE_3[row]
    model = kt.TransformerModel.from_preset("base", vocabulary_size=64, **overrides)
    config = {**kt.presets.PRESETS["base"]["config"], **overrides}
    h, d_model = config["num_heads"], config["hidden_dim"]
    d_k = config.get("key_dim") or d_model // h
    d_v = config.get("value_dim") or d_model // h  # independent of d_k
    attention = model.decoder_layers[0].cross_attention
    assert tuple(attention.query_dense.kernel.shape) == (d_model, h * d_k)
    assert tuple(attention.value_dense.kernel.shape) == (d_model, h * d_v)
    assert tuple(attention.output_dense.kernel.shape) == (h * d_v, d_model)
    assert len(model.encoder_layers) == len(model.decoder_layers) == config["num_layers"]
    assert model.encoder_layers[0].feedforward_intermediate.units == config["intermediate_dim"]
    assert model.dropout == config["dropout"]
    out = model({"encoder_token_ids": np.array([[5, 6, 3]]), "decoder_token_ids": np.array([[2, 7]])})
    assert tuple(out.shape) == (1, 2, 64)


def test_table_3_row_b_is_key_dim_alone():
    """Row B (d_k = 16, d_v = 64, ~58M in the paper) from `key_dim=16` alone, counted in closed form."""
    model = kt.TransformerModel.from_preset("base", key_dim=16)
    assert (model.head_key_dim, model.head_value_dim) == (16, 64)
    attention = model.encoder_layers[0].self_attention
    assert (attention.key_dim, attention.value_dim) == (16, 64)
    expected = closed_form_parameter_count(37000, 6, 512, 2048, 8, 16, 64)
    assert model.count_params() == expected
    assert abs(expected / 1e6 - 58) / 58 < 0.04


def preset_as_format_1(directory, **old_config):
    """Rewrites a saved preset's config.json as format 1 (before value_dim and attention_window changed)."""
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    saved["format_version"] = 1
    saved["config"].update(old_config)
    path.write_text(json.dumps(saved))


def test_format_1_preset_loads_as_the_same_model(tmp_path, rng):
    """Format 1: key_dim without value_dim meant d_v = d_k, attention_window=w meant |i - j| <= w."""
    model = tiny_model(key_dim=3, value_dim=3, attention_window=5)  # what format 1's (3, None, 2) built
    model.save_to_preset(tmp_path / "old")
    preset_as_format_1(tmp_path / "old", key_dim=3, value_dim=None, attention_window=2)
    loaded = kt.TransformerModel.from_preset(str(tmp_path / "old"))
    assert (loaded.head_key_dim, loaded.head_value_dim, loaded.attention_window) == (3, 3, 5)
    src, tgt = random_ids(rng, 2, 12), random_ids(rng, 2, 9)
    np.testing.assert_array_equal(logits(loaded, src, tgt), logits(model, src, tgt))
    # Overrides are in today's meaning; a re-saved preset is format 2 and loads the same.
    assert kt.TransformerModel.from_preset(str(tmp_path / "old"), attention_window=3).attention_window == 3
    loaded.save_to_preset(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["format_version"] == 2
    again = kt.TransformerModel.from_preset(str(tmp_path / "new"))
    np.testing.assert_array_equal(logits(again, src, tgt), logits(model, src, tgt))


def test_unknown_preset_format_is_refused(tmp_path):
    tiny_model().save_to_preset(tmp_path / "p")
    saved = json.loads((tmp_path / "p" / "config.json").read_text())
    saved["format_version"] = 4
    (tmp_path / "p" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="format_version=4; this version of keras_transformer reads formats 1, 2, 3"):
        kt.TransformerModel.from_preset(str(tmp_path / "p"))


def test_restricted_attention_model_runs(rng):
    model = tiny_model(attention_window=3)
    assert logits(model, random_ids(rng, 1, 9), random_ids(rng, 1, 4)).shape == (1, 4, 50)


@pytest.mark.parametrize(
    "src,match",
    [
        (np.array([5, 6, 7], "int32"), r"rank 2 \[batch, length\], received shape \(3,\)"),
        (np.ones((1, 3), "float32"), "integer tensor of token ids, received dtype float32"),
        (np.array([[5, 50, 3]], "int32"), r"token id 50, outside \[0, 50\)"),
        (np.array([[5, -1, 3]], "int32"), r"token id -1, outside \[0, 50\)"),
    ],
    ids=["rank", "dtype", "too_large", "negative"],
)
def test_bad_token_ids_are_clear_errors(src, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        model({"encoder_token_ids": src, "decoder_token_ids": np.array([[2, 5, 6]])})


def test_bad_decoder_ids_are_named():
    with pytest.raises(ValueError, match="decoder_token_ids contains token id 99"):
        tiny_model()({"encoder_token_ids": np.array([[5, 3]]), "decoder_token_ids": np.array([[2, 99]])})


def test_inputs_must_be_the_named_dict():
    with pytest.raises(ValueError, match="'encoder_token_ids' and 'decoder_token_ids'"):
        tiny_model()([np.array([[5, 3]]), np.array([[2, 5]])])


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_heads=7), "num_heads=7 must divide hidden_dim=16"),
        (dict(vocabulary_size=0), "vocabulary_size=0"),
        (dict(position_encoding="rotary"), "position_encoding='rotary'"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(end_id=50), "end_id=50"),
    ],
)
def test_bad_constructor_arguments(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(**overrides)


@pytest.mark.slow
@pytest.mark.own_processes  # spawns all three backends itself: runs once, beside the notebooks (conftest.py)
def test_one_weights_file_gives_the_same_logits_on_all_backends(tmp_path):
    """Save on one backend, load on TensorFlow, JAX and PyTorch in fresh processes."""
    tiny_model(position_encoding="learned").save_to_preset(tmp_path / "preset")
    rng = np.random.default_rng(0)
    src, tgt = random_ids(rng, 2, 7), random_ids(rng, 2, 5)
    src[1, 4:] = 0
    np.save(tmp_path / "src.npy", src)
    np.save(tmp_path / "tgt.npy", tgt)
    script = (
        "import sys, numpy as np, keras, keras_transformer as kt\n"
        "d = sys.argv[1]\n"
        "m = kt.TransformerModel.from_preset(d + '/preset')\n"
        "out = m({'encoder_token_ids': np.load(d + '/src.npy'), 'decoder_token_ids': np.load(d + '/tgt.npy')})\n"
        "np.save(d + '/' + keras.backend.backend() + '.npy', keras.ops.convert_to_numpy(out))\n"
    )
    for backend in ("tensorflow", "jax", "torch"):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=300)
    reference = np.load(tmp_path / "tensorflow.npy")
    for backend in ("jax", "torch"):
        np.testing.assert_allclose(np.load(tmp_path / f"{backend}.npy"), reference, rtol=1e-4, atol=1e-4)


def test_summary_shows_every_layers_output_shape_and_parameters():
    model = tiny_model()
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    table = "\n".join(lines)
    for name in ("encoder_position", "encoder_embedding_dropout", "encoder_layer_1", "decoder_layer_0"):
        row = next(line for line in lines if name in line)
        assert "(None, None, 16)" in row, row
    assert "?" not in table
    assert f"Total params: {model.count_params():,}" in table


def _export_inputs(rng):
    # Other batch and lengths than the first call's, with padding.
    src, tgt = random_ids(rng, 3, 9), random_ids(rng, 3, 6)
    src[0, 6:] = 0
    tgt[1, 4:] = 0
    return {"encoder_token_ids": src, "decoder_token_ids": tgt}


@pytest.mark.skipif(BACKEND == "torch", reason="Keras' SavedModel export on PyTorch takes no dict inputs (refusal tested below)")
def test_keras_export_tf_saved_model_gives_keras_logits(tmp_path, rng):
    import tensorflow as tf

    model = tiny_model()
    logits(model, random_ids(rng, 2, 5), random_ids(rng, 2, 4))
    model.export(str(tmp_path / "saved"), format="tf_saved_model", verbose=False)
    inputs = _export_inputs(rng)
    loaded = tf.saved_model.load(str(tmp_path / "saved"))  # kept: `serve` needs its variables
    served = loaded.serve(inputs).numpy()
    np.testing.assert_allclose(served, logits(model, inputs["encoder_token_ids"], inputs["decoder_token_ids"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="ONNX export of any shape: TensorFlow (tf2onnx); "
                    "JAX needs jax2onnx, PyTorch fixed shapes (tested below)")
def test_keras_export_onnx_gives_keras_logits_at_other_shapes(tmp_path, rng):
    import onnxruntime

    model = tiny_model()
    model.export(str(tmp_path / "m.onnx"), format="onnx", verbose=False)  # never called before
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == ["decoder_token_ids", "encoder_token_ids"]
    for batch, source, target in ((3, 9, 6), (1, 2, 11)):
        inputs = {"encoder_token_ids": random_ids(rng, batch, source), "decoder_token_ids": random_ids(rng, batch, target)}
        inputs["encoder_token_ids"][0, -1] = 0
        served = session.run(None, inputs)[0]
        np.testing.assert_allclose(served, logits(model, inputs["encoder_token_ids"], inputs["decoder_token_ids"]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's limits of Keras' export")
def test_keras_export_on_torch_refuses_in_one_line_or_takes_fixed_shapes(tmp_path, rng):
    import onnxruntime

    model = tiny_model()
    for fmt, command in (("onnx", "python -m export.onnx"), ("tf_saved_model", "python -m export.saved_model")):
        with pytest.raises(RuntimeError, match=f"format='{fmt}' on the torch backend .*`{command} ") as error:
            model.export(str(tmp_path / fmt), format=fmt)
        assert "\n" not in str(error.value)
    # An explicit signature with an unknown size is refused as well, before PyTorch's exporter fails inside.
    for signature in (model.export_input_signature(),
                      [{name: keras.InputSpec(shape=(None, 5), dtype="int32", name=name) for name in INPUT_NAMES}]):
        with pytest.raises(RuntimeError, match=r"format='onnx' on the torch backend \(input_signature has unknown "
                                               r"sizes \(.*\(None, .*`python -m export.onnx ") as error:
            model.export(str(tmp_path / "m.onnx"), format="onnx", input_signature=signature)
        assert "\n" not in str(error.value)
    inputs = _export_inputs(rng)
    signature = [{name: keras.InputSpec(shape=value.shape, dtype="int32", name=name) for name, value in inputs.items()}]
    model.export(str(tmp_path / "m.onnx"), format="onnx", verbose=False, input_signature=signature)
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, inputs)[0],
                               logits(model, inputs["encoder_token_ids"], inputs["decoder_token_ids"]),
                               rtol=1e-5, atol=1e-5)


def test_keras_export_refuses_a_signature_of_several_entries(tmp_path):
    # Keras passes each entry as a positional argument; the model takes one dict.
    specs = [keras.InputSpec(shape=(2, 4), dtype="int32", name=name) for name in INPUT_NAMES]
    with pytest.raises(ValueError, match=r"input_signature has 2 entries; the model takes one dict of inputs"):
        tiny_model().export(str(tmp_path / "m.onnx"), format="onnx", input_signature=specs)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's ONNX export needs jax2onnx")
def test_keras_export_onnx_on_jax_without_jax2onnx_names_the_project_exporter(tmp_path):
    import importlib.util

    if importlib.util.find_spec("jax2onnx") is not None:
        pytest.skip("jax2onnx is installed")
    with pytest.raises(RuntimeError, match=r"format='onnx' on the jax backend \(ImportError: .*jax2onnx.*`python -m export.onnx "):
        tiny_model().export(str(tmp_path / "m.onnx"), format="onnx")


@pytest.mark.parametrize("name", ["args", "cache", "attention", "adapters"])
def test_the_old_model_helper_paths_re_export_the_modeling_modules(name):
    import importlib

    old_module = importlib.import_module(f"keras_transformer.model_{name}")
    new_module = importlib.import_module(f"keras_transformer.modeling.{name}")
    public = [key for key in vars(new_module) if not key.startswith("_")]
    assert public and all(getattr(old_module, key) is getattr(new_module, key) for key in public)
    assert kt.TransformerModel.__module__ == "keras_transformer.model"
