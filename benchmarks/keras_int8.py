"""Keras' own int8 (`TransformerModel.quantize("int8")`) against float32 Keras: speed, size, BLEU.

One process per backend (`KERAS_BACKEND`) loads the preset twice, float32
and int8 (`Translator.from_preset(preset, quantize="int8")`), and measures:

- ms per generated token: `model.generate` (the project's search, compiled
  on TensorFlow and JAX, eager on PyTorch) on the first `--time-sentences`
  test sources, at batch 1 (one sentence at a time) and at `--batch-size`;
  generated tokens are the output ids after the start id up to and with the
  end id. After one warm-up pass per model and setting (compilation), the
  two models take turns, `--rounds` times (float32, int8, int8, float32, ...),
  so that a shared machine's load falls on both alike; the ratio is int8 /
  float32 of the medians, from the same process;
- the weights: bytes of the model's variables, and of a preset's
  `model.weights.h5` (float32: the preset's; int8: the quantized model saved);
- sacreBLEU and chrF on the first `--sentences` sentences of the bundled test
  split (`keras_transformer.evaluate.evaluate`, beam `--beam-size`):
  deterministic, so measured once.

```
KERAS_BACKEND=tensorflow python -m benchmarks.keras_int8 --preset runs/small --sentences 500
KERAS_BACKEND=torch OMP_NUM_THREADS=1 python -m benchmarks.keras_int8 --preset runs/small --sentences 200
```

Writes `benchmarks/results/keras_int8_<backend>.json`.
"""

import argparse
import json
import logging
import os
import pathlib
import platform
import statistics
import tempfile
import time

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = ("float32", "int8")

logger = logging.getLogger("benchmarks.keras_int8")


def weight_bytes(model):
    """Bytes of the model's variables, in their dtypes (int8 kernels: 1 byte a value)."""
    return int(sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in model.weights))


def generated_tokens(ids, start_id, end_id):
    """Output tokens of `generate`'s `[B, L]` ids: after the start id, up to and with the end id (no padding)."""
    ids = np.asarray(ids)
    return int(((ids != 0) & (ids != start_id)).sum())


def _batches(ids, batch_size):
    """`ids` (lists of int) in padded int32 batches of `batch_size` rows, in order."""
    batches = []
    for start in range(0, len(ids), batch_size):
        rows = ids[start: start + batch_size]
        batch = np.zeros((len(rows), max(map(len, rows))), "int32")
        for i, row in enumerate(rows):
            batch[i, : len(row)] = row
        batches.append(batch)
    return batches


def _time_pass(model, batches, beam_size):
    """(seconds, generated tokens) of one `generate` over every batch."""
    tokens, start = 0, time.perf_counter()
    for batch in batches:
        tokens += generated_tokens(model.generate(batch, beam_size=beam_size), model.start_id, model.end_id)
    return time.perf_counter() - start, tokens


def run_benchmark(preset, sentences=200, time_sentences=32, batch_size=32, beam_size=4, rounds=3):
    """Measures float32 and int8 Keras on `preset`; returns a JSON-serializable dict."""
    import keras

    from keras_transformer import datasets
    from keras_transformer.evaluate import evaluate
    from keras_transformer.presets import WEIGHTS_FILE
    from keras_transformer.translator import Translator

    translators = {"float32": Translator.from_preset(preset), "int8": Translator.from_preset(preset, quantize="int8")}
    sources, references = datasets.load_bundled("test")
    sources, references = sources[:sentences], references[:sentences]
    result = {
        "backend": keras.backend.backend(), "preset": os.fspath(preset), "keras": keras.__version__,
        "machine": platform.machine(), "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sentences": len(sources), "beam_size": beam_size, "rounds": rounds, "time_sentences": time_sentences,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        translators["int8"].model.save_to_preset(pathlib.Path(scratch) / "int8")
        files = {"float32": pathlib.Path(preset) / WEIGHTS_FILE, "int8": pathlib.Path(scratch) / "int8" / WEIGHTS_FILE}
        for name, translator in translators.items():
            result["models"][name] = {
                "weight_bytes": weight_bytes(translator.model), "weights_file_bytes": files[name].stat().st_size,
            }
    for name, translator in translators.items():
        start = time.perf_counter()
        scores = evaluate(translator, sources, references, beam_size=beam_size, batch_size=batch_size)
        result["models"][name].update(bleu=scores["bleu"], chrf=scores["chrf"],
                                      evaluate_s=round(time.perf_counter() - start, 1))
        logger.info("%s: BLEU %.2f chrF %.2f", name, scores["bleu"], scores["chrf"])
    ids = translators["float32"].encode(sources[:time_sentences])
    settings = {"batch_1": _batches(ids, 1), f"batch_{batch_size}": _batches(ids, batch_size)}
    for setting, batches in settings.items():
        for name in MODELS:  # warm-up: compilation per shape
            _time_pass(translators[name].model, batches, beam_size)
        per_token = {name: [] for name in MODELS}
        for round_index in range(rounds):
            order = MODELS if round_index % 2 == 0 else MODELS[::-1]
            for name in order:
                seconds, tokens = _time_pass(translators[name].model, batches, beam_size)
                per_token[name].append(1000 * seconds / tokens)
        for name in MODELS:
            result["models"][name][f"ms_per_token_{setting}"] = statistics.median(per_token[name])
            result["models"][name][f"ms_per_token_{setting}_rounds"] = per_token[name]
        result[f"int8_over_float32_{setting}"] = (
            result["models"]["int8"][f"ms_per_token_{setting}"] / result["models"]["float32"][f"ms_per_token_{setting}"]
        )
        logger.info("%s: int8 / float32 time per token %.2fx", setting, result[f"int8_over_float32_{setting}"])
    return result


def table_row(result):
    """One markdown row of benchmarks/README.md's table for `result`."""
    f32, i8 = result["models"]["float32"], result["models"]["int8"]
    settings = [key[len("int8_over_float32_"):] for key in result if key.startswith("int8_over_float32_")]
    times = " | ".join(
        f"{f32[f'ms_per_token_{s}']:.2f} / {i8[f'ms_per_token_{s}']:.2f} ({result[f'int8_over_float32_{s}']:.2f}x)"
        for s in settings
    )
    return (
        f"| {result['backend']} | {times} | {f32['bleu']:.2f} / {i8['bleu']:.2f} ({i8['bleu'] - f32['bleu']:+.2f}) | "
        f"{f32['weight_bytes'] / 2**20:.1f} / {i8['weight_bytes'] / 2**20:.1f} MiB |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keras_int8", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True, help="a trained preset directory (e.g. runs/small)")
    parser.add_argument("--sentences", type=int, default=200, help="test sentences scored (default 200)")
    parser.add_argument("--time-sentences", type=int, default=32, help="test sentences timed (default 32)")
    parser.add_argument("--batch-size", type=int, default=32, help="the batched setting's rows (default 32)")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None, help="JSON file (default results/keras_int8_<backend>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run_benchmark(args.preset, args.sentences, args.time_sentences, args.batch_size, args.beam_size,
                           args.rounds)
    output = pathlib.Path(args.output or RESULTS / f"keras_int8_{result['backend']}.json")
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(table_row(result))


if __name__ == "__main__":
    main()
