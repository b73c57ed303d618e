"""The export contract (export/contract.py): one table, consistent, and the checks derived from it.

Framework-free and fast; the exported graphs are compared with the table in
test_export_onnx.py and test_export_saved_model.py (TensorFlow backend).
"""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from export import contract
from keras_transformer.presets import jsonable_config

SIZES = {"hidden_dim": 16, "num_decoder_layers": 2, "num_heads": 4, "head_key_dim": 4, "head_value_dim": 3,
         "vocabulary_size": 60}


def test_every_axis_is_named_and_every_graph_is_in_a_format():
    named = set(contract.DYNAMIC_AXES) | set(contract.FIXED_AXES)
    for export_format in (contract.ONNX, contract.SAVED_MODEL):
        for name, graph in export_format.graphs.items():
            for tensor in (*graph.inputs, *graph.outputs):
                assert set(tensor.axes) <= named, (name, tensor)
            assert len(set(graph.input_names())) == len(graph.inputs), name
    # The SavedModel's protocol signatures are the ONNX protocol graphs, not copies.
    assert contract.SAVED_MODEL.graphs["decode_step"] is contract.ONNX.graphs["decoder_step"]
    assert contract.SAVED_MODEL.graphs["encode"] is contract.ONNX.graphs["encoder"]


def test_the_cache_init_cache_returns_is_what_decoder_step_takes():
    cache = {tensor.name: tensor for tensor in contract.INIT_CACHE.outputs}
    step_inputs = {tensor.name: tensor for tensor in contract.DECODE_STEP.inputs}
    assert all(step_inputs[name] == tensor for name, tensor in cache.items())
    # The updated self-attention cache has the layout of the one fed in.
    for tensor in contract.DECODE_STEP.outputs[1:]:
        assert tensor.name.startswith("updated_")
        original = cache[tensor.name[len("updated_"):]]
        assert (tensor.dtype, tensor.axes) == (original.dtype, original.axes)


def test_shapes_dtypes_and_descriptions_follow_the_table():
    (self_key,) = [t for t in contract.DECODE_STEP.inputs if t.name == "self_key"]
    assert contract.shape(self_key, SIZES) == [None, 2, 4, None, 4]
    assert contract.dtype(self_key, "float16") == "float16"
    assert contract.describe(self_key, "float32") == "[B, L, N, T_max, K] float32"
    described = contract.describe_graphs(contract.SAVED_MODEL, "float32")
    assert described["decode_step"]["outputs"] == {
        "logits": "[B, V] float32",
        "updated_self_key": "[B, L, N, T_max, K] float32",
        "updated_self_value": "[B, L, N, T_max, Vh] float32",
    }
    assert described["translate"] == {"inputs": {"text": "[B] string"}, "outputs": {"translation": "[B] string"}}


def _actual(graph, kind, dynamic="unk__1", **changes):
    """`graph`'s tensors as a runtime reports them (dynamic dims as `dynamic`); `changes`: name -> (dtype, shape)."""
    exported = {
        t.name: (contract.dtype(t, "float32"), [dynamic if dim is None else dim for dim in contract.shape(t, SIZES)])
        for t in getattr(graph, kind)
    }
    return [(name, *changes.get(name, exported[name])) for name in exported]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"step": ("int64", [])}, r"decoder_step\.onnx step has dtype int64; expected int32"),
        ({"self_key": ("float32", ["b", 2, 4, "t", 5])},
         r"decoder_step\.onnx self_key axis 4 \(head_key_dim\) is 5; the model's head_key_dim is 4"),
        ({"encoder_padding_mask": ("bool", [3, "s"])},
         r"decoder_step\.onnx encoder_padding_mask axis 0 \(batch\) is fixed to 3; it must be dynamic"),
        ({"decoder_token_ids": ("int32", ["b", 1])},
         r"decoder_step\.onnx decoder_token_ids has rank 2 \(shape \['b', 1\]\); expected rank 1 \[B\] int32"),
    ],
)
def test_check_tensors_names_the_graph_the_tensor_and_the_difference(changes, message):
    def check(actual):
        contract.check_tensors("decoder_step.onnx", contract.DECODE_STEP, "inputs", actual, SIZES, "float32")

    for dynamic in ("unk__1", None):  # ONNX Runtime's symbolic dims; TensorFlow's unknown ones.
        check(_actual(contract.DECODE_STEP, "inputs", dynamic))
    with pytest.raises(contract.ValidationError, match=message):
        check(_actual(contract.DECODE_STEP, "inputs", **changes))


def test_check_tensors_rejects_missing_or_extra_names():
    actual = _actual(contract.ENCODE, "outputs") + [("extra", "float32", [])]
    with pytest.raises(contract.ValidationError, match=r"encoder\.onnx has outputs \['encoder_outputs', 'extra'\]; "
                       r"expected \['encoder_outputs'\]"):
        contract.check_tensors("encoder.onnx", contract.ENCODE, "outputs", actual, SIZES, "float32")


def test_feeds_take_the_contract_dtypes_and_names():
    feeds = contract.feeds(
        contract.BEAM_SEARCH,
        {"encoder_token_ids": np.array([[5, 3]], np.int64), "beam_size": 4, "alpha": 0.6, "max_extra_length": 5},
        "float32",
    )
    assert {name: value.dtype.name for name, value in feeds.items()} == {
        "encoder_token_ids": "int32", "beam_size": "int32", "alpha": "float32", "max_extra_length": "int32"
    }
    ids = np.array([[5, 3]], np.int32)
    assert contract.feeds(contract.ENCODE, {"encoder_token_ids": ids}, "float32")["encoder_token_ids"] is ids
    with pytest.raises(ValueError, match=r"takes \['encoder_token_ids', 'beam_size', 'alpha', 'max_extra_length'\], "
                       r"received \['encoder_token_ids'\]"):
        contract.feeds(contract.BEAM_SEARCH, {"encoder_token_ids": ids}, "float32")
    # translate.onnx's search arguments are optional (defaults in the graph).
    feeds = contract.feeds(contract.TEXT_GRAPH, {"text": ["a"], "beam_size": 2}, None)
    assert (feeds["text"].dtype, feeds["beam_size"].dtype) == (np.dtype(object), np.dtype(np.int32))


def test_jsonable_stores_a_dtype_policy_by_name():
    config = {"dtype": {"class_name": "DTypePolicy", "config": {"name": "mixed_float16"}}, "path": pathlib.Path("a")}
    assert jsonable_config(config) == {"dtype": "mixed_float16", "path": "a"}


BLOCK_FRAMEWORKS = """
import sys

class NoFramework:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"tensorflow", "keras", "jax", "torch", "tf2onnx"}:
            raise ImportError(name + " must not be imported")

sys.meta_path.insert(0, NoFramework())
import export.contract, export.validate
"""


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="backend-independent: run once")
def test_the_contract_and_the_validator_import_no_framework():
    root = pathlib.Path(contract.__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_FRAMEWORKS], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- #
# What an export may replace
# --------------------------------------------------------------------------- #
def test_is_export_of_reads_the_format_name_of_any_version(tmp_path):
    assert not contract.is_export_of(contract.ONNX)(tmp_path)
    (tmp_path / "config.json").write_text('{"format": "keras_transformer.onnx", "format_version": 1}')
    assert contract.is_export_of(contract.ONNX)(tmp_path)
    assert not contract.is_export_of(contract.SAVED_MODEL)(tmp_path)
    (tmp_path / "config.json").write_text("[not json")
    assert not contract.is_export_of(contract.ONNX)(tmp_path)


@pytest.mark.parametrize("exporter", ["onnx", "ctranslate2", "saved_model", "huggingface"])
def test_an_exporter_never_replaces_the_preset_or_a_directory_of_yours(exporter, tiny_preset_dir, tmp_path, capsys):
    """`--output` the preset itself (with --overwrite) or a directory of other files: one line, exit 2, all kept."""
    import importlib
    import shutil

    main = importlib.import_module(f"export.{exporter}").main
    preset = tmp_path / "preset"
    shutil.copytree(tiny_preset_dir, preset)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    files = {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()}
    for output, says in ((preset, "is the directory of the model being read: writing there would delete the model"),
                         (mine, "holds files but is not a")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--preset", str(preset), "--output", str(output), "--overwrite"])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and says in error, error
    assert {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()} == files
