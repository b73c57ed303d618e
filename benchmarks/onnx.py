"""ONNX Runtime vs Keras (TensorFlow) speed: encoder and greedy/beam-4 generation.

Exports a preset (random weights unless a trained preset directory is given)
to float32 and int8 ONNX, then times, in the same process and run:

- the encoder: `TransformerModel.encode` in a `tf.function` vs the
  `encoder.onnx` session;
- generation: `TransformerModel.generate` (the compiled XLA search) vs
  `OnnxSeq2Seq.generate` (the same search, exported and run by ONNX Runtime),
  greedy and beam 4;

at batch 1 and 8. Each time is the median of `--repeats` runs after a
warm-up run (which also compiles); ratios are Keras time / ONNX time from
the same run. Results: `benchmarks/results/onnx.json` and `onnx.png`.

Run from the repository root (a script named onnx.py must not sit on
sys.path in front of the onnx package):

```
python -m benchmarks.onnx --preset small
```
"""

if not __package__:
    raise SystemExit("Run as a module from the repository root: python -m benchmarks.onnx")

import argparse
import json
import logging
import os
import pathlib
import platform
import tempfile

import numpy as np

from benchmarks.timing import median_seconds

logger = logging.getLogger("benchmarks.onnx")

RESULTS = pathlib.Path(__file__).parent / "results"


def _sources(rng, batch, length, vocabulary_size, end_id):
    ids = rng.integers(4, vocabulary_size, size=(batch, length)).astype(np.int32)
    ids[:, -1] = end_id
    return ids


def run_benchmark(preset="small", batch_sizes=(1, 8), source_length=20, max_extra_length=20, repeats=5, seed=0):
    """Times Keras and ONNX Runtime; returns the results as a JSON-serializable dict."""
    import keras
    import onnxruntime
    import tensorflow as tf

    import keras_transformer as kt
    from export.onnx import export_onnx
    from export.runtime import OnnxSeq2Seq

    keras.utils.set_random_seed(seed)
    model = kt.TransformerModel.from_preset(preset, dropout=0.0)
    keras_encode = tf.function(
        model.encode, input_signature=[tf.TensorSpec([None, None], tf.int32)], reduce_retracing=True
    )
    rng = np.random.default_rng(seed)
    threads = os.cpu_count()
    results = {
        "preset": preset if isinstance(preset, str) else str(preset),
        "source_length": source_length,
        "max_extra_length": max_extra_length,
        "repeats": repeats,
        "environment": {
            "cpu_count": threads,
            "machine": platform.machine(),
            "keras": keras.__version__,
            "tensorflow": tf.__version__,
            "onnxruntime": onnxruntime.__version__,
            "providers": None,
        },
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        runtimes = {}
        for quantize in (None, "int8"):
            name = f"onnx-{quantize or 'float32'}"
            directory = export_onnx(model, pathlib.Path(scratch) / name, quantize=quantize)
            runtimes[quantize or "float32"] = OnnxSeq2Seq(directory)
        results["environment"]["providers"] = runtimes["float32"].providers

        for batch in batch_sizes:
            src = _sources(rng, batch, source_length, model.vocabulary_size, model.end_id)
            keras_times = {
                "encoder": median_seconds(lambda: keras_encode(src).numpy(), repeats),
            }
            for beam_size in (1, 4):
                keras_times[f"beam{beam_size}"] = median_seconds(
                    lambda: model.generate(src, beam_size=beam_size, max_extra_length=max_extra_length), repeats
                )
            keras_tokens = {
                beam: model.generate(src, beam_size=beam, max_extra_length=max_extra_length) for beam in (1, 4)
            }
            for precision, runtime in runtimes.items():
                for task in ("encoder", "beam1", "beam4"):
                    if task == "encoder":
                        onnx_time = median_seconds(lambda: runtime.encode(src), repeats)
                        same = None
                    else:
                        beam = int(task[-1])
                        onnx_time = median_seconds(
                            lambda: runtime.generate(src, beam_size=beam, max_extra_length=max_extra_length),
                            repeats,
                        )
                        ids = runtime.generate(src, beam_size=beam, max_extra_length=max_extra_length)
                        same = bool(ids.shape == keras_tokens[beam].shape and (ids == keras_tokens[beam]).all())
                    case = {
                        "task": task,
                        "batch": batch,
                        "precision": precision,
                        "keras_seconds": keras_times[task],
                        "onnx_seconds": onnx_time,
                        "speedup": keras_times[task] / onnx_time,
                        "same_tokens_as_keras": same,
                    }
                    logger.info("%s", case)
                    results["cases"].append(case)
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    labels = [f"{c['task']}\nB={c['batch']}" for c in cases if c["precision"] == "float32"]
    x = np.arange(len(labels))
    figure, axis = plt.subplots(figsize=(max(6, len(labels) * 1.2), 4))
    for offset, precision in ((-0.2, "float32"), (0.2, "int8")):
        speedups = [c["speedup"] for c in cases if c["precision"] == precision]
        axis.bar(x + offset, speedups, width=0.4, label=f"ONNX Runtime {precision}")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(x, labels)
    axis.set_ylabel("speed-up over Keras TF (x)")
    environment = results["environment"]
    axis.set_title(
        f"{results['preset']}: ONNX Runtime vs Keras/TensorFlow "
        f"({environment['cpu_count']} CPUs, {environment['providers'][0]})"
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.onnx", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", help="preset name or directory (default small)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--source-length", type=int, default=20)
    parser.add_argument("--max-extra-length", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS), help="directory for onnx.json and onnx.png")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    results = run_benchmark(
        args.preset, tuple(args.batch_sizes), args.source_length, args.max_extra_length, args.repeats
    )
    output = pathlib.Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "onnx.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, output / "onnx.png")
    for case in results["cases"]:
        print(
            f"{case['task']:8s} B={case['batch']:<2d} {case['precision']:8s}"
            f" keras {case['keras_seconds'] * 1e3:8.1f} ms"
            f"  onnx {case['onnx_seconds'] * 1e3:8.1f} ms  x{case['speedup']:.2f}"
            f"  same tokens: {case['same_tokens_as_keras']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
