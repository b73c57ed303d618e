"""One GPU, JAX and PyTorch, no TensorFlow: training, attention and generation (benchmarks/device.sh).

The GPU machine this workplace lends (one H200; Python 3.12, JAX with its
CUDA plugin, PyTorch with CUDA, no TensorFlow, no network) runs this module
through `benchmarks/device.sh`, which installs the carried Keras wheels first.
Each backend runs in its own process (the backend is fixed at import), one
after the other (PyTorch first: eager, it needs less time, and JAX, which
compiles, gets what it leaves of `--budget`), so each has the GPU to itself.
A section that would start too close to its backend's share of the budget is
skipped and named in the JSON; a worker still running at the end of its share
is stopped, and what it had written stays. Nothing here imports TensorFlow:
the batches are NumPy arrays given to `train_on_batch`, not the tf.data
pipeline of `keras_transformer.data`.

Sections, per backend (`--sections` picks some):

- `matmul`: the bfloat16 rate of a large square matrix product (8192^3,
  random normal data) timed on the device in the same process: the ceiling
  the training MFU is measured against.
- `training`: `TransformerModel.from_preset("base")` and `("big")` under
  `keras.mixed_precision` "mixed_bfloat16", compiled as training does
  (`keras_transformer.training.compile_model`: Adam(0.9, 0.98, 1e-9), the
  warmup schedule, label smoothing 0.1; jit on JAX, eager on PyTorch), on
  batches of the paper's size (section 5.1: about 25,000 target tokens):
  448 rows x 64 positions, each row padded after a random length in
  [48, 64]. If a batch does not fit, it is split into 2 or 4 micro-batches
  with the optimizer's gradient accumulation. `train_on_batch` returns NumPy
  values, so each timed step includes waiting for the last one (the host's
  share of a step is in the figure). The presets' attention dropout is 0
  (the paper's dropout is on sub-layer outputs), so training runs the fused
  attention too. Reported: target (non-padding
  label) tokens per second, seconds per step, MFU (training FLOPs per step,
  as `benchmarks.train.training_flops` counts them, over the step time and
  the measured bf16 rate), peak device memory (PyTorch:
  `torch.cuda.max_memory_allocated` per model; JAX: the device's
  `memory_stats()["peak_bytes_in_use"]`, the process's peak so far, so base
  is measured before big), and the paper's figures beside them (8 P100s:
  base 0.4 s and big 1.0 s per step of ~25k target tokens; 100k steps in 12
  hours, 300k steps in 3.5 days).
- `attention`: `kt.layers.MultiHeadAttention` with the base model's sizes
  (8 heads x 64) in bfloat16, self-attention over a padded batch of about
  16k tokens, at source lengths 64 ... 1024: `use_fused_attention=True`
  (`keras.ops.dot_product_attention`: cuDNN flash attention on JAX when it
  accepts the inputs, PyTorch's scaled_dot_product_attention) against the
  plain path (`use_fused_attention=False`, the same weights). Outputs equal:
  each within `ATTENTION_RTOL` (relative L2 error) of the plain path computed
  in float32, and of each other. Times: forward, and forward + backward.
  The kernels that ran are named (JAX: the compiled HLO's custom calls;
  PyTorch: the profiler's attention kernels).
- `generation`: the base model (float32, random weights, dropout 0) with
  `keras_transformer.generation.generate`, batch 1 and 64, greedy and beam 4,
  16 source tokens and exactly 64 generated positions (the end id is masked
  until the last one, as `benchmarks.generate` does): ms per generated
  position and target tokens per second; compiled on JAX, eager on PyTorch.
- `logits`: the same float32 base model's teacher-forced logits on the GPU
  against the CPU (a separate process of the same backend that loads the
  weights), within `LOGITS_ATOL` (max abs difference), with float32 products
  computed in float32 (JAX's "highest" precision: its default may let XLA use
  TF32 on the GPU; that difference is reported beside it, not checked).

`--smoke` (`KT_DEVICE_SMOKE=1 bash benchmarks/device.sh`) runs the same code at
tiny sizes on the CPU, both backends side by side: it checks the script, not
the figures.

```
bash benchmarks/device.sh                       # on the GPU machine (see its header)
KT_DEVICE_SMOKE=1 bash benchmarks/device.sh     # here, on the CPU, in about a minute
python -m benchmarks.device --table results/device.json   # the table of a saved run
```

Writes `device.json` (or `device_smoke.json`) and one log per backend into
`$KT_DEVICE_RESULTS`, else `$OUT` (the device tool's folder that comes
back), else `benchmarks/results/device/` (smoke: a new temporary folder),
and prints a table last.
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

logger = logging.getLogger("benchmarks.device")

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]
# PyTorch first: eager, it needs less of the budget, and JAX (compiling) gets what it leaves.
BACKENDS = ("torch", "jax")
SECTIONS = ("matmul", "training", "attention", "generation", "logits")

# Relative L2 error allowed between attention outputs in bfloat16 (operands
# rounded to 8 bits of mantissa: errors of 1e-3 to 1e-2 are rounding).
ATTENTION_RTOL = 2e-2
# Largest absolute difference allowed between float32 logits on the GPU and the CPU.
LOGITS_ATOL = 1e-3

# The paper, section 5.2: 8 P100 GPUs, batches of about 25,000 source and
# 25,000 target tokens; base 0.4 s per step (100k steps, 12 hours), big 1.0 s
# per step (300k steps, 3.5 days).
PAPER = {
    "gpus": "8 x P100",
    "target_tokens_per_step": 25_000,
    "base": {"seconds_per_step": 0.4, "steps": 100_000, "hours": 12.0},
    "big": {"seconds_per_step": 1.0, "steps": 300_000, "hours": 3.5 * 24},
}

SIZES = {
    "full": {
        "matmul_size": 8192,
        "train_presets": {"base": {}, "big": {}},
        "train_rows": 448,
        "train_length": 64,
        "train_warmup_steps": 3,
        "train_steps": 10,
        "attention_lengths": (64, 128, 256, 512, 1024),
        "attention_tokens": 16384,
        "attention_heads": 8,
        "attention_head_dim": 64,
        "attention_repeats": 10,
        "generation_preset": ("base", {}),
        "generation_batches": (1, 64),
        "generation_source_length": 16,
        "generation_length": 64,
        "generation_repeats": 3,
        "logits_shape": (4, 32),
    },
    "smoke": {
        "matmul_size": 256,
        "train_presets": {
            "base": {"vocabulary_size": 1000, "num_layers": 1, "hidden_dim": 32, "intermediate_dim": 64,
                     "num_heads": 4},
            "big": {"vocabulary_size": 1000, "num_layers": 1, "hidden_dim": 64, "intermediate_dim": 128,
                    "num_heads": 4},
        },
        "train_rows": 4,
        "train_length": 8,
        "train_warmup_steps": 1,
        "train_steps": 2,
        "attention_lengths": (16,),
        "attention_tokens": 32,
        "attention_heads": 2,
        "attention_head_dim": 8,
        "attention_repeats": 2,
        "generation_preset": ("base", {"vocabulary_size": 1000, "num_layers": 1, "hidden_dim": 32,
                                       "intermediate_dim": 64, "num_heads": 4}),
        "generation_batches": (1, 2),
        "generation_source_length": 4,
        "generation_length": 6,
        "generation_repeats": 1,
        "logits_shape": (2, 6),
    },
}


# --------------------------------------------------------------------- #
# Backend helpers (the worker process; keras is imported there)
# --------------------------------------------------------------------- #
def _backend():
    import keras

    return keras.backend.backend()


def _synchronize(value=None):
    """Waits until the device has finished the work behind `value` (and everything before it)."""
    if _backend() == "jax":
        import jax

        jax.block_until_ready(value)
    elif _backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return value


def _on_gpu():
    if _backend() == "jax":
        import jax

        return jax.devices()[0].platform == "gpu"
    if _backend() == "torch":
        import torch

        return torch.cuda.is_available()
    return False


def _device_name():
    if _backend() == "jax":
        import jax

        device = jax.devices()[0]
        kind = platform.machine() if device.platform == "cpu" else getattr(device, "device_kind", device)
        return f"{device.platform}: {kind}"
    if _backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {platform.machine()}"


def median_device_seconds(run, repeats, warmup=1):
    """Median seconds of `run()`, synchronized, after `warmup` calls (which also compile)."""
    for _ in range(warmup):
        _synchronize(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _synchronize(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reset_peak_memory():
    if _backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def peak_memory():
    """`(gigabytes, source)`: the device's peak allocation, or the process's peak RSS without one."""
    if _backend() == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return stats["peak_bytes_in_use"] / 2**30, "jax memory_stats peak_bytes_in_use (process peak so far)"
    elif _backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process peak RSS (no device memory statistics)"


def _free_memory():
    import keras

    keras.backend.clear_session()
    gc.collect()
    if _backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _is_out_of_memory(error):
    text = f"{type(error).__name__}: {error}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemoryError" in text


# --------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------- #
def environment():
    import keras

    import keras_transformer

    backend = _backend()
    info = {
        "backend": backend,
        "device": _device_name(),
        "on_gpu": _on_gpu(),
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_transformer": keras_transformer.__version__,
        "keras_transformer_path": str(pathlib.Path(keras_transformer.__file__).parent),
        "cpu_count": os.cpu_count(),
    }
    if backend == "jax":
        import jax
        import jaxlib

        stats = jax.devices()[0].memory_stats() or {}
        info.update(jax=jax.__version__, jaxlib=jaxlib.__version__, device_count=jax.device_count(),
                    default_matmul_precision=str(jax.config.jax_default_matmul_precision),
                    device_memory_gb=stats["bytes_limit"] / 2**30 if "bytes_limit" in stats else None,
                    xla_flags=os.environ.get("XLA_FLAGS"))
    else:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    float32_matmul_precision=torch.get_float32_matmul_precision(),
                    device_count=torch.cuda.device_count(),
                    device_memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30
                    if torch.cuda.is_available() else None)
    return info


def bf16_matmul_rate(size, repeats=10, inner=10):
    """FLOP/s of a `size`^3 bfloat16 matrix product (median of `repeats` runs of `inner` products)."""
    if _backend() == "jax":
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.key(0), 2)
        a, b = (jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys)
        product = jax.jit(jnp.matmul)

        def run():
            for _ in range(inner):
                out = product(a, b)
            return out

    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        generator = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(size, size, dtype=torch.bfloat16, device=device, generator=generator) for _ in range(2))

        def run():
            for _ in range(inner):
                out = torch.matmul(a, b)
            return out

    seconds = median_device_seconds(run, repeats, warmup=2) / inner
    return {"size": size, "dtype": "bfloat16", "seconds": seconds, "tflops": 2 * size**3 / seconds / 1e12}


def training_batch(rows, length, vocabulary_size, seed):
    """Random ids `[rows, length]`, each row padded after a random length in [3/4 L, L] (`benchmarks.train`)."""
    from benchmarks.train import make_batch

    return make_batch({"batch_size": rows, "sequence_length": length, "vocabulary_size": vocabulary_size}, seed)


def train_preset(preset, overrides, rows, length, warmup_steps, steps, matmul_tflops):
    """Training steps of one preset in mixed bfloat16; splits the batch into micro-batches if it does not fit."""
    import keras

    import keras_transformer as kt
    from benchmarks.train import encoder_decoder_params, training_flops
    from keras_transformer import training

    failures = []
    for micro in (1, 2, 4):
        _free_memory()
        _reset_peak_memory()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        model = None
        try:
            keras.utils.set_random_seed(0)
            model = kt.TransformerModel.from_preset(preset, **overrides)
            training.compile_model(model, gradient_accumulation_steps=micro)
            x, y = training_batch(rows // micro, length, model.vocabulary_size, seed=0)
            start = time.perf_counter()
            model.train_on_batch(x, y)  # returns NumPy values: the step has finished
            first_step = time.perf_counter() - start
            for _ in range(warmup_steps - 1):
                model.train_on_batch(x, y)
            start = time.perf_counter()
            for _ in range(steps * micro):
                logs = model.train_on_batch(x, y, return_dict=True)
            loss = float(logs["loss"])
            micro_seconds = (time.perf_counter() - start) / (steps * micro)
        except Exception as error:  # noqa: BLE001 - out of memory differs per backend
            if not _is_out_of_memory(error) or micro == 4:
                raise
            failures.append(f"{rows // micro} rows: {type(error).__name__}")
            logger.warning("%s: %d rows do not fit (%s); trying %d micro-batches", preset, rows // micro,
                           type(error).__name__, micro * 2)
            del model
            continue
        finally:
            keras.mixed_precision.set_global_policy("float32")
        memory_gb, memory_source = peak_memory()
        encoder, decoder = encoder_decoder_params(model, ours=True)
        config = {"batch_size": rows // micro, "sequence_length": length, "hidden_dim": model.hidden_dim,
                  "vocabulary_size": model.vocabulary_size, "num_layers": model.num_layers}
        flops = training_flops(config, encoder, decoder)
        tokens = int((y != 0).sum())
        step_seconds = micro_seconds * micro
        tokens_per_second = tokens / micro_seconds
        paper = PAPER.get(preset)
        result = {
            "preset": preset,
            "overrides": overrides,
            "parameters": int(model.count_params()),
            "mixed_precision": "mixed_bfloat16",
            "jit_compile": bool(model.jit_compile),
            "rows": rows,
            "length": length,
            "micro_batches": micro,
            "not_fitting": failures,
            "target_tokens_per_step": tokens * micro,
            "source_tokens_per_step": int((x["encoder_token_ids"] != 0).sum()) * micro,
            "seconds_per_step": step_seconds,
            "first_step_seconds": first_step,
            "target_tokens_per_second": tokens_per_second,
            "flops_per_step": flops * micro,
            "tflops": flops / micro_seconds / 1e12,
            "mfu": flops / micro_seconds / (matmul_tflops * 1e12) if matmul_tflops else None,
            "peak_memory_gb": memory_gb,
            "memory_source": memory_source,
            "final_loss": loss,
        }
        if paper:
            paper_rate = PAPER["target_tokens_per_step"] / paper["seconds_per_step"]
            result.update(
                paper_target_tokens_per_second=paper_rate,
                paper_steps=paper["steps"],
                paper_hours=paper["hours"],
                ratio_to_paper=tokens_per_second / paper_rate,
                # The paper's schedule (its steps of ~25k target tokens) on this one device.
                hours_for_paper_steps=paper["steps"] * PAPER["target_tokens_per_step"] / tokens_per_second / 3600,
            )
        del model
        _free_memory()
        return result
    raise AssertionError("unreachable")


ATTENTION_KERNEL = re.compile(r"fmha|flash|attention|sdpa|cudnn", re.IGNORECASE)


def _attention_functions(layer, x, mask, cotangent):
    """`(forward, forward_backward, kernels)` of one layer on `x` (jitted on JAX).

    `kernels()` names the attention kernels a forward call runs: on JAX the
    custom calls of the compiled program (cuDNN's fused attention is one),
    on PyTorch the profiler's attention operations and GPU kernels.
    """
    import keras

    x = keras.ops.cast(x, layer.compute_dtype)
    if _backend() == "jax":
        import jax
        import jax.numpy as jnp

        values = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]

        def apply(values, x):
            return layer.stateless_call(values, fixed, x, padding_mask=mask)[0]

        forward = jax.jit(apply)

        def loss(values, x):
            return jnp.sum(apply(values, x).astype("float32") * cotangent)

        gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))

        def kernels():
            text = forward.lower(values, x).compile().as_text()
            targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
            return sorted(target for target in targets if ATTENTION_KERNEL.search(target))

        return (lambda: forward(values, x)), (lambda: gradients(values, x)), kernels
    import torch

    def forward():
        with torch.no_grad():
            return layer(x, padding_mask=mask)

    x_grad = x.detach().clone().requires_grad_(True)

    def forward_backward():
        (layer(x_grad, padding_mask=mask).float() * cotangent).sum().backward()
        return x_grad.grad

    def kernels():
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            _synchronize(forward())
        names = {event.key for event in prof.key_averages()}
        return sorted(name for name in names if ATTENTION_KERNEL.search(name))[:8]

    return forward, forward_backward, kernels


def attention(lengths, tokens, num_heads, head_dim, repeats):
    """Fused (`keras.ops.dot_product_attention`) against plain attention, bfloat16, per source length."""
    import keras

    import keras_transformer as kt

    hidden = num_heads * head_dim
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        batch = max(1, tokens // length)
        keras.utils.set_random_seed(length)
        layers = {
            name: kt.layers.MultiHeadAttention(num_heads, head_dim, use_fused_attention=fused, dtype=dtype)
            for name, fused, dtype in (("fused", True, "mixed_bfloat16"), ("plain", False, "mixed_bfloat16"),
                                       ("reference", False, "float32"))
        }
        for layer in layers.values():
            layer.build((batch, length, hidden))
        weights = layers["fused"].get_weights()
        layers["plain"].set_weights(weights)
        layers["reference"].set_weights(weights)
        x = keras.ops.convert_to_tensor(rng.standard_normal((batch, length, hidden)).astype("float32"))
        real = rng.integers(length * 3 // 4, length + 1, size=batch)
        mask = keras.ops.convert_to_tensor(np.arange(length)[None, :] < real[:, None])
        cotangent = keras.ops.convert_to_tensor(rng.standard_normal((batch, length, hidden)).astype("float32"))
        functions = {name: _attention_functions(layer, x, mask, cotangent) for name, layer in layers.items()}
        outputs = {}
        for name, (forward, _, _) in functions.items():
            with highest_precision() if name == "reference" else contextlib.nullcontext():
                outputs[name] = keras.ops.convert_to_numpy(keras.ops.cast(forward(), "float32")).astype("float64")
        reference = outputs["reference"]
        real_queries = np.arange(length)[None, :] < real[:, None]  # padded queries are never read

        def error(a, b):
            return float(np.linalg.norm((a - b)[real_queries]) / np.linalg.norm(b[real_queries]))

        row = {
            "source_length": length,
            "batch": batch,
            "heads": num_heads,
            "head_dim": head_dim,
            "dtype": "bfloat16",
            "fused_vs_plain_rel_error": error(outputs["fused"], outputs["plain"]),
            "fused_vs_float32_rel_error": error(outputs["fused"], reference),
            "plain_vs_float32_rel_error": error(outputs["plain"], reference),
            "fused_vs_plain_max_abs_diff": float(np.abs(outputs["fused"] - outputs["plain"])[real_queries].max()),
            "tolerance_rel_error": ATTENTION_RTOL,
        }
        row["equal"] = all(row[key] <= ATTENTION_RTOL for key in
                           ("fused_vs_plain_rel_error", "fused_vs_float32_rel_error", "plain_vs_float32_rel_error"))
        for name in ("fused", "plain"):
            forward, forward_backward, _ = functions[name]
            row[f"{name}_forward_ms"] = 1000 * median_device_seconds(forward, repeats)
            row[f"{name}_forward_backward_ms"] = 1000 * median_device_seconds(forward_backward, repeats)
        row["speedup_forward"] = row["plain_forward_ms"] / row["fused_forward_ms"]
        row["speedup_forward_backward"] = row["plain_forward_backward_ms"] / row["fused_forward_backward_ms"]
        row["fused_kernels"] = functions["fused"][2]()
        logger.info(
            "attention S=%d batch %d: fused %.3f ms, plain %.3f ms (forward); relative error %.1e; kernels %s",
            length, batch, row["fused_forward_ms"], row["plain_forward_ms"], row["fused_vs_plain_rel_error"],
            row["fused_kernels"] or "-",
        )
        rows.append(row)
        del layers, functions
        _free_memory()
    return rows


def generation(model, batches, source_length, length, repeats):
    """ms per generated position of greedy and beam-4 search (`benchmarks.generate`'s forced lengths)."""
    from benchmarks.generate import Cached
    from keras_transformer.generation import generate

    rng = np.random.default_rng(0)
    wrapper = Cached(model)
    compiled = _backend() == "jax"
    rows = []
    for batch in batches:
        source = rng.integers(4, model.vocabulary_size, size=(batch, source_length)).astype("int32")
        source[:, -1] = model.end_id
        for beam_size in (1, 4):
            def run():
                return generate(wrapper, source, beam_size=beam_size, max_extra_length=length - source_length,
                                compile=compiled)

            start = time.perf_counter()
            ids = np.asarray(run())
            first = time.perf_counter() - start
            generated = {int(np.flatnonzero(row == model.end_id)[0]) for row in ids}
            if generated != {length}:
                raise RuntimeError(f"generated {sorted(generated)} positions, expected {length}")
            seconds = median_device_seconds(run, repeats, warmup=0)
            rows.append({
                "batch": batch,
                "search": "greedy" if beam_size == 1 else f"beam {beam_size}",
                "beam_size": beam_size,
                "source_tokens": source_length,
                "generated_positions": length,
                "compiled": compiled,
                "first_call_seconds": first,
                "ms_per_token": 1000 * seconds / length,
                "target_tokens_per_second": batch * length / seconds,
            })
            logger.info("generation batch %d %s: %.2f ms per position (first call %.1f s)", batch,
                        rows[-1]["search"], rows[-1]["ms_per_token"], first)
    return rows


def logits_inputs(model, shape, seed=0):
    """Source and target ids `[B, L]`: row 0 full, the other rows padded after half the length."""
    rng = np.random.default_rng(seed)
    batch, length = shape
    source = rng.integers(4, model.vocabulary_size, size=(batch, length)).astype("int32")
    target = rng.integers(4, model.vocabulary_size, size=(batch, length)).astype("int32")
    target[:, 0] = model.start_id
    for row in range(batch):
        n = length if row == 0 else length // 2
        source[row, n - 1] = model.end_id
        source[row, n:] = model.pad_id
        target[row, n:] = model.pad_id
    return {"encoder_token_ids": source, "decoder_token_ids": target}


def highest_precision():
    """A context in which float32 products are computed in float32 (JAX on a GPU may use TF32 otherwise)."""
    if _backend() == "jax":
        import jax

        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()  # PyTorch: float32 unless torch.backends.cuda.matmul.allow_tf32 is set


def model_logits(model, inputs, highest=False):
    """float32 teacher-forced logits; `highest`: full float32 products (no TF32)."""
    with highest_precision() if highest else contextlib.nullcontext():
        # Compiled on JAX, and traced inside the context: its precision holds.
        return np.asarray(model.predict_on_batch(inputs), "float32")


# --------------------------------------------------------------------- #
# The worker: one backend in this process
# --------------------------------------------------------------------- #
class Part:
    """The worker's results, rewritten to `path` after every section (a killed worker still reports)."""

    def __init__(self, path, backend):
        self.path = pathlib.Path(path)
        self.data = {"backend": backend, "errors": {}, "skipped": []}
        self.save()

    def save(self):
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(temporary, self.path)

    @contextlib.contextmanager
    def section(self, name, deadline, reserve):
        """Runs a section unless fewer than `reserve` seconds are left; records its error and goes on."""
        if time.time() + reserve > deadline:
            logger.warning("%s: skipped, %.0f s left of the budget", name, deadline - time.time())
            self.data["skipped"].append(name)
            self.save()
            yield False
            return
        start = time.perf_counter()
        logger.info("%s: started", name)
        try:
            yield True
        except Exception as error:  # noqa: BLE001 - reported in the JSON, the other sections still run
            self.data["errors"][name] = f"{type(error).__name__}: {error}"[:2000]
            self.data.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            logger.error("%s failed:\n%s", name, traceback.format_exc())
        finally:
            self.data.setdefault("section_seconds", {})[name] = time.perf_counter() - start
            self.save()


def run_worker(part_path, scratch, sections, sizes, deadline, require_gpu):
    import keras

    backend = keras.backend.backend()
    part = Part(part_path, backend)
    full = sizes is SIZES["full"]
    part.data["environment"] = environment()
    part.save()
    if require_gpu and not part.data["environment"]["on_gpu"]:
        part.data["errors"]["environment"] = f"{backend} sees no GPU ({part.data['environment']['device']})"
        part.save()
        return part.data
    matmul_tflops = None
    if "matmul" in sections:
        with part.section("matmul", deadline, reserve=10 if full else 0) as go:
            if go:
                part.data["matmul"] = bf16_matmul_rate(sizes["matmul_size"])
                matmul_tflops = part.data["matmul"]["tflops"]
                logger.info("bf16 matmul %d^3: %.1f TFLOP/s", sizes["matmul_size"], matmul_tflops)
    if "training" in sections:
        part.data["training"] = {}
        for preset, overrides in sizes["train_presets"].items():
            with part.section(f"training_{preset}", deadline, reserve=60 if full else 0) as go:
                if go:
                    row = train_preset(preset, overrides, sizes["train_rows"], sizes["train_length"],
                                       sizes["train_warmup_steps"], sizes["train_steps"], matmul_tflops)
                    part.data["training"][preset] = row
                    logger.info("training %s: %.0f target tokens/s, %.3f s/step, MFU %s, peak %.1f GB", preset,
                                row["target_tokens_per_second"], row["seconds_per_step"],
                                f"{row['mfu']:.0%}" if row["mfu"] is not None else "-", row["peak_memory_gb"])
    if "attention" in sections:
        with part.section("attention", deadline, reserve=30 if full else 0) as go:
            if go:
                part.data["attention"] = attention(
                    sizes["attention_lengths"], sizes["attention_tokens"], sizes["attention_heads"],
                    sizes["attention_head_dim"], sizes["attention_repeats"],
                )
    models = {}

    def float32_model():
        """The base model in float32 with dropout 0 (built once, for the logits and the generation)."""
        if not models:
            import keras_transformer as kt

            keras.mixed_precision.set_global_policy("float32")
            keras.utils.set_random_seed(0)
            models["base"] = kt.TransformerModel.from_preset(preset, dropout=0.0, **overrides)
        return models["base"]

    preset, overrides = sizes["generation_preset"]
    if "logits" in sections:
        with part.section("logits", deadline, reserve=20 if full else 0) as go:
            if go:
                model = float32_model()
                inputs = logits_inputs(model, sizes["logits_shape"])
                model.save_weights(pathlib.Path(scratch) / f"{backend}.weights.h5")
                np.savez(
                    pathlib.Path(scratch) / f"{backend}_logits.npz",
                    highest=model_logits(model, inputs, highest=True), default=model_logits(model, inputs),
                    **inputs,
                )
                (pathlib.Path(scratch) / f"{backend}_model.json").write_text(
                    json.dumps({"preset": preset, "overrides": dict(overrides, dropout=0.0)})
                )
                part.data["logits"] = {"device": part.data["environment"]["device"],
                                       "shape": list(sizes["logits_shape"])}
    if "generation" in sections:
        with part.section("generation", deadline, reserve=40 if full else 0) as go:
            if go:
                part.data["generation"] = generation(
                    float32_model(), sizes["generation_batches"], sizes["generation_source_length"],
                    sizes["generation_length"], sizes["generation_repeats"],
                )
    # Information, not a check: where TensorFlow is installed, keras.utils.set_random_seed imports it
    # (to seed it too); where it is not, nothing here needs it (the smoke test blocks it).
    part.data["tensorflow_loaded"] = "tensorflow" in sys.modules
    part.save()
    return part.data


def run_cpu_logits(scratch, backend):
    """The CPU half of the logits check (a process that sees no GPU): loads the weights, writes logits."""
    import keras_transformer as kt

    scratch = pathlib.Path(scratch)
    spec = json.loads((scratch / f"{backend}_model.json").read_text())
    saved = np.load(scratch / f"{backend}_logits.npz")
    model = kt.TransformerModel.from_preset(spec["preset"], **spec["overrides"])
    model.load_weights(scratch / f"{backend}.weights.h5")
    inputs = {name: saved[name] for name in ("encoder_token_ids", "decoder_token_ids")}
    np.save(scratch / f"{backend}_cpu_logits.npy", model_logits(model, inputs, highest=True))
    return _device_name()


def compare_logits(scratch, backend):
    scratch = pathlib.Path(scratch)
    saved = np.load(scratch / f"{backend}_logits.npz")
    cpu = np.load(scratch / f"{backend}_cpu_logits.npy")
    real = saved["decoder_token_ids"] != 0  # logits at padded target positions are never read
    result = {"tolerance_max_abs_diff": LOGITS_ATOL, "logits_max_abs": float(np.abs(cpu[real]).max())}
    for precision in ("highest", "default"):
        difference = np.abs(saved[precision] - cpu)[real]
        result[f"max_abs_diff_{precision}"] = float(difference.max())
        result[f"rel_error_{precision}"] = float(
            np.linalg.norm(difference) / np.linalg.norm(cpu[real])
        )
    result["within_tolerance"] = bool(result["max_abs_diff_highest"] <= LOGITS_ATOL)
    return result


# --------------------------------------------------------------------- #
# The driver: one worker per backend, then the CPU logits, then the table
# --------------------------------------------------------------------- #
def _stream(command, env, log_path, timeout):
    """Runs `command`, copying its output to stdout and to `log_path`; returns its exit status (None: killed)."""
    import threading

    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, env=env, cwd=REPOSITORY, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def copy():
            for line in process.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.error("%s: over its %.0f s budget, stopped", " ".join(command[2:4]), timeout)
            os.killpg(process.pid, 9)
            process.wait()
            status = None
        reader.join(timeout=10)
        return status


def _worker_env(backend, cpu_only=False, smoke=False):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPOSITORY), env.get("PYTHONPATH")) if p)
    if cpu_only:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    if smoke:  # tiny programs: XLA's slower optimizations only cost compile time there
        flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    return env


# Seconds a worker leaves at the end of its share for the CPU half of the logits check.
CPU_LOGITS_SECONDS = 60


def run_backend(backend, scratch, results_dir, sections, smoke, seconds):
    """One backend: its worker (GPU), then the CPU half of the logits check; returns its results."""
    start = time.time()
    log = results_dir / f"device_{backend}.log"
    log.write_text("")
    part_path = scratch / f"{backend}.json"
    reserve = CPU_LOGITS_SECONDS if "logits" in sections else 5
    command = [sys.executable, "-m", "benchmarks.device", "--worker", str(part_path), "--scratch", str(scratch),
               "--sections", ",".join(sections), "--deadline", str(start + seconds - reserve)]
    if smoke:
        command.append("--smoke")
    logger.info("%s: %.0f s of the budget", backend, seconds)
    status = _stream(command, _worker_env(backend, smoke=smoke), log, timeout=seconds)
    data = json.loads(part_path.read_text()) if part_path.is_file() else {"backend": backend}
    data.setdefault("errors", {})
    if status != 0:
        data["errors"]["worker"] = "stopped at the end of its budget" if status is None else f"exit {status}"
    if "logits" in data and "logits" not in data["errors"]:
        command = [sys.executable, "-m", "benchmarks.device", "--cpu-logits", str(scratch), "--backend", backend]
        status = _stream(command, _worker_env(backend, cpu_only=True, smoke=smoke), log,
                         timeout=max(30, start + seconds - time.time()))
        if status == 0:
            data["logits"]["reference"] = "the same backend in a process that sees no GPU"
            data["logits"].update(compare_logits(scratch, backend))
        else:
            data["errors"]["logits_cpu"] = f"the CPU process ended with {status}"
    data["wall_seconds"] = time.time() - start
    return data


def run_benchmark(results_dir, backends=BACKENDS, sections=SECTIONS, smoke=False, budget_seconds=420):
    """Runs every backend's worker and the CPU logits check; returns the merged results (also written).

    On the device the backends run one after the other (each has the GPU to
    itself) and share `budget_seconds`; in smoke mode they run side by side.
    """
    results_dir = pathlib.Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    merged = {
        "benchmark": "device",
        "smoke": smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_seconds": budget_seconds,
        "sections": list(sections),
        "paper": PAPER,
        "tolerances": {"attention_rel_error": ATTENTION_RTOL, "logits_max_abs_diff": LOGITS_ATOL},
        "backends": {},
    }
    path = results_dir / ("device_smoke.json" if smoke else "device.json")

    def write():
        merged["wall_seconds"] = time.time() - start
        path.write_text(json.dumps(merged, indent=1, default=str) + "\n")

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kt-device-"))
    try:
        if smoke:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(backends)) as pool:
                futures = {backend: pool.submit(run_backend, backend, scratch, results_dir, sections, smoke,
                                                budget_seconds) for backend in backends}
            merged["backends"] = {backend: future.result() for backend, future in futures.items()}
            write()
        else:
            for index, backend in enumerate(backends):
                share = (budget_seconds - (time.time() - start)) / (len(backends) - index)
                merged["backends"][backend] = run_backend(backend, scratch, results_dir, sections, smoke, share)
                write()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return merged


def failures(results):
    """What went wrong, one line each (empty: every section ran and every check passed)."""
    lines = []
    for backend, data in results["backends"].items():
        for section, message in data.get("errors", {}).items():
            lines.append(f"{backend} {section}: {message.splitlines()[0] if message else ''}")
        for section in data.get("skipped", []):
            lines.append(f"{backend} {section}: skipped (time budget)")
        for row in data.get("attention", []):
            if not row["equal"]:
                lines.append(f"{backend} attention S={row['source_length']}: outputs differ beyond "
                             f"{ATTENTION_RTOL} (fused vs plain {row['fused_vs_plain_rel_error']:.1e})")
        logits = data.get("logits", {})
        if logits.get("within_tolerance") is False:
            lines.append(f"{backend} logits: GPU vs CPU max abs diff {logits['max_abs_diff_highest']:.1e} "
                         f"> {LOGITS_ATOL}")
    return lines


# --------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------- #
def _f(value, spec):
    return "-" if value is None else format(value, spec)


def format_table(results):
    lines = []
    backends = results["backends"]
    title = "smoke run (tiny sizes, CPU: checks the script, not the figures)" if results["smoke"] else "device run"
    lines.append(f"benchmarks/device.py: {title}, {results.get('wall_seconds', 0):.0f} s")
    for backend, data in backends.items():
        env = data.get("environment", {})
        version = env.get("jax") or env.get("torch") or "?"
        matmul = data.get("matmul", {})
        lines.append(f"  {backend} {version} on {env.get('device', '?')}, keras {env.get('keras', '?')}, "
                     f"bf16 matmul {matmul.get('size', '-')}^3: {_f(matmul.get('tflops'), '.3g')} TFLOP/s")
    paper = results["paper"]
    lines += ["", f"Training (mixed_bfloat16; paper: {paper['gpus']}, ~{paper['target_tokens_per_step']:,} target "
                  "tokens per step)",
              "| backend | preset | rows x len | micro | target tok/step | s/step | target tok/s | MFU | peak GB "
              "| paper tok/s (8 GPUs) | paper steps on 1 device |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for backend, data in backends.items():
        for preset, row in data.get("training", {}).items():
            hours = row.get("hours_for_paper_steps")
            schedule = "-" if hours is None else f"{row['paper_steps']:,} in {hours:.1f} h"
            lines.append(
                f"| {backend} | {preset} | {row['rows']} x {row['length']} | {row['micro_batches']} "
                f"| {row['target_tokens_per_step']:,} | {row['seconds_per_step']:.3f} "
                f"| {row['target_tokens_per_second']:,.0f} | {_f(row['mfu'], '.0%')} | {row['peak_memory_gb']:.1f} "
                f"| {_f(row.get('paper_target_tokens_per_second'), ',.0f')} "
                f"| {schedule} |"
            )
    lines += ["", f"Attention, bf16: fused (keras.ops.dot_product_attention) vs plain; equal = relative L2 error "
                  f"<= {ATTENTION_RTOL} (vs each other and vs float32)",
              "| backend | S | batch | fused fwd ms | plain fwd ms | x | fused fwd+bwd ms | plain fwd+bwd ms | x "
              "| rel. error | equal | fused kernels |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for backend, data in backends.items():
        for row in data.get("attention", []):
            lines.append(
                f"| {backend} | {row['source_length']} | {row['batch']} | {row['fused_forward_ms']:.3f} "
                f"| {row['plain_forward_ms']:.3f} | {row['speedup_forward']:.2f} "
                f"| {row['fused_forward_backward_ms']:.3f} | {row['plain_forward_backward_ms']:.3f} "
                f"| {row['speedup_forward_backward']:.2f} | {row['fused_vs_plain_rel_error']:.1e} "
                f"| {'yes' if row['equal'] else 'NO'} | {', '.join(row['fused_kernels'])[:60] or '-'} |"
            )
    lines += ["", "Generation (base, float32, forced length): ms per generated position",
              "| backend | batch | search | positions | compiled | ms/position | target tok/s | first call s |",
              "|---|---:|---|---:|---|---:|---:|---:|"]
    for backend, data in backends.items():
        for row in data.get("generation", []):
            lines.append(
                f"| {backend} | {row['batch']} | {row['search']} | {row['generated_positions']} "
                f"| {'jit' if row['compiled'] else 'eager'} | {row['ms_per_token']:.2f} "
                f"| {row['target_tokens_per_second']:,.0f} | {row['first_call_seconds']:.1f} |"
            )
    lines += ["", f"float32 logits, {'GPU' if not results['smoke'] else 'device'} vs CPU "
                  f"(max abs diff <= {LOGITS_ATOL})",
              "| backend | max abs diff | rel. error | default precision: max abs diff | within |",
              "|---|---:|---:|---:|---|"]
    for backend, data in backends.items():
        row = data.get("logits", {})
        if "max_abs_diff_highest" in row:
            lines.append(f"| {backend} | {row['max_abs_diff_highest']:.1e} | {row['rel_error_highest']:.1e} "
                         f"| {row['max_abs_diff_default']:.1e} | {'yes' if row['within_tolerance'] else 'NO'} |")
    problems = failures(results)
    lines += ["", "All sections ran; every check passed." if not problems else "Problems:"]
    lines += [f"  {line}" for line in problems]
    return "\n".join(lines)


# --------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------- #
def default_results_dir(smoke):
    chosen = os.environ.get("KT_DEVICE_RESULTS") or os.environ.get("OUT")
    if chosen:
        return pathlib.Path(chosen)
    if smoke:
        return pathlib.Path(tempfile.mkdtemp(prefix="kt-device-smoke-"))
    return REPOSITORY / "benchmarks" / "results" / "device"


def _names(text, allowed, what):
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{what}={text!r}: each must be one of {', '.join(allowed)}")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any machine (checks the script)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        type=lambda text: _names(text, BACKENDS, "--backends"))
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        type=lambda text: _names(text, SECTIONS, "--sections"))
    parser.add_argument("--results", type=pathlib.Path, default=None,
                        help="folder for the JSON and logs (default: $KT_DEVICE_RESULTS, else $OUT, "
                             "else benchmarks/results/device)")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("KT_DEVICE_BUDGET_S", 420)),
                        help="seconds for all backends together (default 420; KT_DEVICE_BUDGET_S)")
    parser.add_argument("--table", type=pathlib.Path, help="print the table of a saved device.json and exit")
    parser.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-logits", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s device: %(message)s", datefmt="%H:%M:%S")
    if args.table:
        print(format_table(json.loads(args.table.read_text())))
        return 0
    if args.worker:
        sizes = SIZES["smoke" if args.smoke else "full"]
        run_worker(args.worker, args.scratch, args.sections, sizes, args.deadline, require_gpu=not args.smoke)
        return 0
    if args.cpu_logits:
        logger.info("CPU logits on %s", run_cpu_logits(args.cpu_logits, args.backend))
        return 0
    results_dir = args.results or default_results_dir(args.smoke)
    results = run_benchmark(results_dir, args.backends, args.sections, args.smoke, args.budget)
    print(format_table(results))
    print(f"\nwritten: {results_dir / ('device_smoke.json' if args.smoke else 'device.json')}")
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
