"""benchmarks/device.sh, the one-GPU proof on JAX and PyTorch, in its smoke mode here.

The GPU machine it is made for has no TensorFlow; the smoke run happens where
importing TensorFlow fails (a `sitecustomize` import blocker on PYTHONPATH,
which every process the script starts inherits), on both backends, each in
its own process, at tiny sizes on the CPU.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import device

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]

# Makes `import tensorflow` (and its companions) fail as on a machine without
# it. `importlib.util.find_spec` still answers (with no origin) instead of
# raising, as PyTorch's dynamo asks it about optional libraries at import.
BLOCKER = '''
import importlib.machinery
import sys

BLOCKED = {"tensorflow", "tensorflow_text", "tf_keras", "tf2onnx", "keras_hub"}


class _Absent:
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (blocked by the test)", name=spec.name)

    def exec_module(self, module):
        pass


class BlockTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, _Absent(), origin=None)
        return None


sys.meta_path.insert(0, BlockTensorFlow())
'''


def numbers(value, path="$"):
    """Every number in a JSON value, with its path."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")


@pytest.mark.slow
@pytest.mark.own_processes
def test_device_smoke_runs_every_section_on_jax_and_torch_without_tensorflow(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    results = tmp_path / "results"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p),
        "KT_DEVICE_SMOKE": "1",
        "KT_DEVICE_RESULTS": str(results),
        "KT_DEVICE_PYTHON": sys.executable,
    }
    env.pop("OUT", None)
    blocked = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env, capture_output=True, text=True)
    assert "No module named 'tensorflow'" in blocked.stderr

    run = subprocess.run(["bash", str(REPOSITORY / "benchmarks" / "device.sh")], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "All sections ran; every check passed." in run.stdout

    data = json.loads((results / "device_smoke.json").read_text())
    assert data["smoke"] is True
    assert list(data["backends"]) == ["torch", "jax"]
    for path, number in numbers(data):
        assert math.isfinite(number), f"{path} = {number}"
    for backend, part in data["backends"].items():
        assert part["errors"] == {} and part["skipped"] == [], (backend, part["errors"], part["skipped"])
        # keras.utils.set_random_seed imports TensorFlow where it can: not here, so the blocker reached the workers.
        assert part["tensorflow_loaded"] is False
        assert part["environment"]["backend"] == backend
        assert part["environment"]["keras_transformer_path"] == str(REPOSITORY / "keras_transformer")
        assert part["matmul"]["tflops"] > 0
        assert set(part["training"]) == {"base", "big"}
        for preset, row in part["training"].items():
            assert row["mixed_precision"] == "mixed_bfloat16"
            assert row["target_tokens_per_step"] > 0 and row["seconds_per_step"] > 0
            assert row["target_tokens_per_second"] > 0 and 0 < row["mfu"] and row["peak_memory_gb"] > 0
            assert row["ratio_to_paper"] > 0 and row["hours_for_paper_steps"] > 0
            assert math.isfinite(row["final_loss"])
        assert [row["source_length"] for row in part["attention"]] == list(device.SIZES["smoke"]["attention_lengths"])
        for row in part["attention"]:
            assert row["equal"] is True
            assert row["fused_vs_plain_rel_error"] <= device.ATTENTION_RTOL
            assert min(row[f"{name}_{kind}_ms"] for name in ("fused", "plain")
                       for kind in ("forward", "forward_backward")) > 0
        assert [(row["batch"], row["beam_size"]) for row in part["generation"]] == [
            (batch, beam) for batch in device.SIZES["smoke"]["generation_batches"] for beam in (1, 4)
        ]
        assert all(row["ms_per_token"] > 0 for row in part["generation"])
        logits = part["logits"]
        assert logits["within_tolerance"] is True
        assert logits["max_abs_diff_highest"] <= device.LOGITS_ATOL and logits["logits_max_abs"] > 0
    for backend in ("jax", "torch"):
        assert (results / f"device_{backend}.log").stat().st_size > 0
        assert f"| {backend} | base |" in run.stdout and f"| {backend} | big |" in run.stdout


def test_failures_name_each_failed_check():
    results = {
        "smoke": False,
        "paper": device.PAPER,
        "backends": {
            "jax": {
                "errors": {"training_big": "XlaRuntimeError: RESOURCE_EXHAUSTED\n..."},
                "skipped": ["generation"],
                "attention": [{"source_length": 512, "equal": False, "fused_vs_plain_rel_error": 0.5,
                               "batch": 32, "fused_forward_ms": 1.0, "plain_forward_ms": 2.0, "speedup_forward": 2.0,
                               "fused_forward_backward_ms": 3.0, "plain_forward_backward_ms": 6.0,
                               "speedup_forward_backward": 2.0, "fused_kernels": []}],
                "logits": {"within_tolerance": False, "max_abs_diff_highest": 0.01, "max_abs_diff_default": 0.02,
                           "rel_error_highest": 0.001},
            },
        },
    }
    assert device.failures(results) == [
        "jax training_big: XlaRuntimeError: RESOURCE_EXHAUSTED",
        "jax generation: skipped (time budget)",
        "jax attention S=512: outputs differ beyond 0.02 (fused vs plain 5.0e-01)",
        "jax logits: GPU vs CPU max abs diff 1.0e-02 > 0.001",
    ]
    table = device.format_table(results)
    assert "| jax | 512 | 32 |" in table and "| NO |" in table and "Problems:" in table


def test_compare_logits_reads_only_real_target_positions(tmp_path):
    rng = np.random.default_rng(0)
    cpu = rng.standard_normal((2, 3, 5)).astype("float32")
    targets = np.array([[2, 7, 8], [2, 9, 0]], "int32")
    gpu = cpu.copy()
    gpu[1, 2] += 100.0  # a padded target position: never read
    gpu[0, 1, 4] += 5e-4
    np.savez(tmp_path / "jax_logits.npz", highest=gpu, default=gpu + 2e-3,
                              encoder_token_ids=targets, decoder_token_ids=targets)
    np.save(tmp_path / "jax_cpu_logits.npy", cpu)
    result = device.compare_logits(tmp_path, "jax")
    assert result["max_abs_diff_highest"] == pytest.approx(5e-4, rel=1e-3)
    assert result["within_tolerance"] is True
    assert result["max_abs_diff_default"] == pytest.approx(2e-3 + 5e-4, rel=1e-2)


def test_a_batch_that_does_not_fit_is_split_into_micro_batches(monkeypatch):
    from keras_transformer.model import TransformerModel

    rows = []

    def small_device(self, x, y, return_dict=False):
        rows.append(len(y))
        if len(y) > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
        assert self.optimizer.gradient_accumulation_steps == 4
        return {"loss": 7.5} if return_dict else [7.5]

    monkeypatch.setattr(TransformerModel, "train_on_batch", small_device)
    overrides = device.SIZES["smoke"]["train_presets"]["base"]
    row = device.train_preset("base", overrides, rows=8, length=8, warmup_steps=1, steps=1, matmul_tflops=1.0)
    assert row["micro_batches"] == 4 and row["not_fitting"] == ["8 rows: RuntimeError", "4 rows: RuntimeError"]
    assert rows == [8, 4] + [2] * (1 + 4)  # the first (compiling) step, then one update of 4 micro-batches
    assert row["target_tokens_per_step"] % 4 == 0 and row["final_loss"] == 7.5
    assert row["seconds_per_step"] > 0 and row["mfu"] > 0

    def broken(self, x, y, return_dict=False):
        raise ValueError("not a memory error")

    monkeypatch.setattr(TransformerModel, "train_on_batch", broken)
    with pytest.raises(ValueError, match="not a memory error"):
        device.train_preset("base", overrides, rows=8, length=8, warmup_steps=1, steps=1, matmul_tflops=1.0)
