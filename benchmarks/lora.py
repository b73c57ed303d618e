"""LoRA vs full fine-tuning: step time and peak memory on the OPUS-MT base shape.

The model: `TransformerModel` in the shape of Helsinki-NLP/opus-mt-* (Marian
base): 6 + 6 layers, d_model 512, d_ff 2048, 8 heads, a 58,101-token shared
vocabulary, swish (`silu`), sinusoidal positions in halves, a logits bias,
dropout 0.1; random weights (the speed and memory do not depend on them).
Each variant is compiled as `run_training` compiles (`training.compile_model`:
Adam with the warmup schedule, label-smoothed loss) and trained with
`train_on_batch` on one batch of 16 x 32-token sources and targets (no
padding), `--warmup` steps first (tracing), then the median of `--steps`.

Variants (each in a process of its own, so that each peak RSS is its own):
- `full`: every weight trains (fine-tuning as `--init-from` does);
- `lora`: `enable_lora(rank)` on the attention projections (the default);
- `lora_ffn`: the attention and feed-forward projections.

Peak RSS is the process' `ru_maxrss` (model, optimizer state, gradients and
the step's activations); `rss_after_build_mb` is the resident size after the
model and its optimizer state were built (before the first step), so the
difference is mostly what the steps add. The machine's load average is
recorded beside each process: on a shared machine the times move with it,
so `--rounds` runs the variants' processes in turn that many times (full,
lora, lora_ffn, full, ...) and the median is over every round's steps.

```
python -m benchmarks.lora                     # TensorFlow backend, writes benchmarks/results/lora.json
python -m benchmarks.lora --rank 16 --steps 10 --rounds 3
```
"""

import argparse
import json
import logging
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
# Helsinki-NLP/opus-mt-en-de's shape (Marian base), as `convert` imports it.
OPUS_MT_BASE = dict(
    vocabulary_size=58101, num_layers=6, num_heads=8, hidden_dim=512, intermediate_dim=2048, dropout=0.1,
    max_sequence_length=512, activation="silu", position_encoding="sinusoidal_halves", logits_bias=True,
)
VARIANTS = {"full": None, "lora": ("attention",), "lora_ffn": ("attention", "feedforward")}

logger = logging.getLogger("benchmarks.lora")


def _rss_mb():
    """The process' resident set now, in MiB (Linux /proc)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_variant(variant, rank, batch_size, length, warmup, steps, seed=0):
    """One variant's step times and memory, in this process."""
    import keras
    import numpy as np

    from keras_transformer import training
    from keras_transformer.model import TransformerModel

    keras.utils.set_random_seed(seed)
    model = TransformerModel(**OPUS_MT_BASE)
    if VARIANTS[variant] is not None:
        model.enable_lora(rank, targets=list(VARIANTS[variant]))
    training.compile_model(model)
    model.optimizer.build(model.trainable_variables)  # its state counts in the memory before the steps
    rng = np.random.default_rng(seed)
    vocabulary = OPUS_MT_BASE["vocabulary_size"]
    inputs = {"encoder_token_ids": rng.integers(4, vocabulary, (batch_size, length)).astype("int32"),
              "decoder_token_ids": rng.integers(4, vocabulary, (batch_size, length)).astype("int32")}
    labels = rng.integers(4, vocabulary, (batch_size, length)).astype("int32")
    rss_after_build = _rss_mb()
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        loss = model.train_on_batch(inputs, labels)
        times.append(time.perf_counter() - start)
    assert np.isfinite(float(np.asarray(loss).ravel()[0]))
    timed = times[warmup:]
    return {
        "variant": variant,
        "lora_rank": rank if VARIANTS[variant] is not None else None,
        "lora_targets": list(VARIANTS[variant] or []),
        "parameters": int(model.count_params()),
        "trainable_parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_weights)),
        "optimizer_variables_mb": sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables) / 2**20,
        "seconds_per_step": statistics.median(timed),
        "step_seconds": timed,
        "warmup_seconds": times[:warmup],
        "rss_after_build_mb": rss_after_build,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _run_child(variant, args, part):
    """One process of `variant`: its result, with the load average before and after it."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, "-m", "benchmarks.lora", "--child", variant, "--output", str(part),
               "--rank", str(args.rank), "--batch-size", str(args.batch_size), "--length", str(args.length),
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
    load_before = os.getloadavg()
    logger.info("running %s (load average %.2f)", variant, load_before[0])
    subprocess.run(command, env=env, check=True, cwd=pathlib.Path(__file__).parent.parent)
    result = json.loads(part.read_text())
    part.unlink()
    result["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    return result


def write_table(results):
    full = results.get("full")
    lines = ["| variant | trainable params | s/step (median of every round) | vs full | peak RSS MiB | vs full |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in results.items():
        time_ratio = f"{row['seconds_per_step'] / full['seconds_per_step']:.2f}x" if full else "-"
        memory_ratio = f"{row['peak_rss_mb'] / full['peak_rss_mb']:.2f}x" if full else "-"
        lines.append(f"| {name} | {row['trainable_parameters']:,} | {row['seconds_per_step']:.3f} | {time_ratio} "
                     f"| {row['peak_rss_mb']:,.0f} | {memory_ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--rank", type=int, default=8, help="the LoRA rank (default 8)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=32, help="source and target tokens per sentence")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (tracing)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant, run in turn (default 2)")
    parser.add_argument("--results", default=str(RESULTS), help="directory for lora.json")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.child:
        result = bench_variant(args.child, args.rank, args.batch_size, args.length, args.warmup, args.steps)
        pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
        return
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    results_dir = pathlib.Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    rounds = [{variant: _run_child(variant, args, results_dir / f"lora_{variant}.part.json") for variant in variants}
              for _ in range(args.rounds)]
    results = {}
    for variant in variants:
        runs = [round_[variant] for round_ in rounds]
        steps = [seconds for run in runs for seconds in run["step_seconds"]]
        results[variant] = {
            **{key: runs[0][key] for key in ("variant", "lora_rank", "lora_targets", "parameters",
                                             "trainable_parameters", "optimizer_variables_mb")},
            "seconds_per_step": statistics.median(steps),
            "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
            "rss_after_build_mb": max(run["rss_after_build_mb"] for run in runs),
            "rounds": [{key: run[key] for key in ("seconds_per_step", "step_seconds", "warmup_seconds", "peak_rss_mb",
                                                  "rss_after_build_mb", "load_average_1min")} for run in runs],
        }
    import keras
    import tensorflow as tf

    summary = {
        "model": OPUS_MT_BASE,
        "batch": {"sentences": args.batch_size, "source_tokens": args.length, "target_tokens": args.length},
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "rounds": args.rounds,
        "backend": "tensorflow",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "machine": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "results": results,
    }
    (results_dir / "lora.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(write_table(results))


if __name__ == "__main__":
    main()
