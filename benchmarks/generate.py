"""Generation speed: the cached decoder step vs recomputing the full decoder each step.

For each preset, search (greedy, beam 4) and output length (16, 32, 64, 128
generated tokens), times `keras_transformer.generation.generate` driving

- `cached`: the model's own `init_cache` / `decode_step` (keys and values of
  earlier positions kept in a fixed-size cache, one position computed per
  step);
- `recompute`: a decoding-protocol wrapper whose `decode_step` runs the full
  decoder (`TransformerModel.decode`) over the whole prefix and reads the
  logits at the current position. Inside a compiled loop shapes are fixed,
  so it runs over the whole output buffer (the causal mask hides positions
  not generated yet); eagerly (`--no-compile`, and always on PyTorch) it
  runs over the prefix generated so far, which grows by one each step.

Both use the same search, compiled the same way, on the same random-weight
model and source (batch 1, 8 source tokens). The output length is forced:
both wrappers set the end id's logit to -inf, so the search runs until the
maximum length (source length + `max_extra_length`), where it forces the
end id. Each time is the median of `--repeats` runs after one warm-up run
(which also compiles); ratios are recompute / cached from the same run.

```
python -m benchmarks.generate                       # tiny and small, TensorFlow unless KERAS_BACKEND is set
KERAS_BACKEND=jax python -m benchmarks.generate --presets tiny
```

Writes `benchmarks/results/generate_<backend>[_eager].json` and `.png`.
"""

import argparse
import json
import logging
import os
import pathlib
import platform

import numpy as np

from benchmarks.timing import median_seconds

logger = logging.getLogger("benchmarks.generate")

RESULTS = pathlib.Path(__file__).parent / "results"
SOURCE_LENGTH = 8  # 7 tokens + the end id


class _NoEnd:
    """Decoding-protocol wrapper that never predicts the end id (the search forces it at max length)."""

    def __init__(self, model):
        self.model = model
        self.variables = model.variables  # lets generate() compile the search
        self.vocabulary_size = model.vocabulary_size
        self.pad_id, self.start_id, self.end_id = model.pad_id, model.start_id, model.end_id
        self.max_sequence_length = model.max_sequence_length

    def encode(self, encoder_token_ids):
        return self.model.encode(encoder_token_ids)

    def _mask_end(self, logits):
        from keras import ops

        is_end = ops.equal(ops.arange(self.vocabulary_size, dtype="int32"), self.end_id)
        return ops.where(is_end, float("-inf"), ops.cast(logits, "float32"))


class Cached(_NoEnd):
    """The model's cached decoder step."""

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        return self.model.init_cache(encoder_outputs, encoder_token_ids, max_length)

    def decode_step(self, token_ids, index, cache):
        logits, cache = self.model.decode_step(token_ids, index, cache)
        return self._mask_end(logits), cache


class Recompute(_NoEnd):
    """Recomputes the full decoder over the prefix at every step (no key/value cache)."""

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        from keras import ops

        batch = encoder_outputs.shape[0]
        return {
            "prefix": ops.zeros((batch, max_length), "int32"),  # [B, L], batch on axis 0 like any cache
            "encoder_outputs": encoder_outputs,
            "encoder_token_ids": ops.cast(encoder_token_ids, "int32"),
        }

    def decode_step(self, token_ids, index, cache):
        from keras import ops

        prefix = cache["prefix"]
        here = ops.equal(ops.arange(prefix.shape[1], dtype="int32"), index)
        prefix = ops.where(here, ops.expand_dims(ops.cast(token_ids, "int32"), 1), prefix)
        if isinstance(index, int):  # eager: only the prefix generated so far
            logits = self.model.decode(prefix[:, : index + 1], cache["encoder_outputs"], cache["encoder_token_ids"])
            logits = logits[:, -1]
        else:  # compiled: fixed shapes, the whole buffer
            logits = self.model.decode(prefix, cache["encoder_outputs"], cache["encoder_token_ids"])
            logits = ops.take(logits, index, axis=1)
        return self._mask_end(logits), dict(cache, prefix=prefix)


def run_benchmark(presets=("tiny", "small"), lengths=(16, 32, 64, 128), beam_sizes=(1, 4), repeats=3,
                  compile=True, seed=0):
    """Times cached and recomputing generation; returns a JSON-serializable dict."""
    import keras

    import keras_transformer as kt
    from keras_transformer.generation import generate

    backend = keras.backend.backend()
    compiled = compile and backend in ("tensorflow", "jax")
    results = {
        "backend": backend,
        "compiled": compiled,
        "batch_size": 1,
        "source_length": SOURCE_LENGTH,
        "repeats": repeats,
        "environment": {
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "load_average_start": os.getloadavg(),
            "keras": keras.__version__,
            "backend_version": _backend_version(backend),
        },
        "cases": [],
    }
    rng = np.random.default_rng(seed)
    for preset in presets:
        keras.utils.set_random_seed(seed)
        model = kt.TransformerModel.from_preset(preset, dropout=0.0)
        source = rng.integers(4, model.vocabulary_size, size=(1, SOURCE_LENGTH)).astype("int32")
        source[:, -1] = model.end_id
        variants = {"cached": Cached(model), "recompute": Recompute(model)}
        for beam_size in beam_sizes:
            for length in lengths:
                extra = length - SOURCE_LENGTH
                case = {"preset": preset, "beam_size": beam_size, "output_tokens": length}
                for name, wrapper in variants.items():
                    def run():
                        return generate(wrapper, source, beam_size=beam_size, max_extra_length=extra,
                                        compile=compile)

                    ids = run()
                    generated = int(np.flatnonzero(ids[0] == model.end_id)[0])
                    if generated != length:
                        raise RuntimeError(f"{name}: generated {generated} tokens, expected {length}")
                    seconds = median_seconds(run, repeats)
                    case[f"{name}_ms_per_token"] = 1000 * seconds / length
                case["speedup"] = case["recompute_ms_per_token"] / case["cached_ms_per_token"]
                logger.info(
                    "%-5s beam %d %3d tokens: cached %.2f ms/token, recompute %.2f ms/token, x%.1f",
                    preset, beam_size, length, case["cached_ms_per_token"], case["recompute_ms_per_token"],
                    case["speedup"],
                )
                results["cases"].append(case)
    results["environment"]["load_average_end"] = os.getloadavg()
    return results


def _backend_version(backend):
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.__version__
    if backend == "jax":
        import jax

        return jax.__version__
    import torch

    return torch.__version__


def plot(results, path):
    """ms/token against output length, cached vs recompute, one panel per preset and search."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    presets = sorted({c["preset"] for c in results["cases"]}, key=[c["preset"] for c in results["cases"]].index)
    beams = sorted({c["beam_size"] for c in results["cases"]})
    figure = Figure(figsize=(4.2 * len(beams), 3.3 * len(presets)), layout="constrained")
    axes = figure.subplots(len(presets), len(beams), squeeze=False)
    for i, preset in enumerate(presets):
        for j, beam in enumerate(beams):
            cases = [c for c in results["cases"] if c["preset"] == preset and c["beam_size"] == beam]
            lengths = [c["output_tokens"] for c in cases]
            ax = axes[i, j]
            for name, style in (("cached", "o-"), ("recompute", "s--")):
                ax.plot(lengths, [c[f"{name}_ms_per_token"] for c in cases], style, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.xaxis.set_minor_formatter(FormatStrFormatter(""))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
            ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_xlabel("output tokens")
            ax.set_ylabel("ms per token")
            search = "greedy" if beam == 1 else f"beam {beam}"
            ax.set_title(f"{preset}, {search}", fontsize=10)
            ax.legend(fontsize=8)
    mode = "compiled" if results["compiled"] else "eager"
    figure.suptitle(f"generate: {results['backend']} ({mode}), batch 1, {results['environment']['cpu_count']} CPUs")
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--beam-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="run the search eagerly (compile=False)")
    parser.add_argument("--no-xla", action="store_true",
                        help="TensorFlow: compile with a plain tf.function graph instead of XLA")
    parser.add_argument("--threads", type=int, default=None,
                        help="PyTorch: torch.set_num_threads(N) (1 avoids spin-wait contention on a busy machine)")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/generate_<backend>.json)")
    args = parser.parse_args(argv)
    if min(args.lengths) <= SOURCE_LENGTH:
        parser.error(f"--lengths must be > the source length {SOURCE_LENGTH}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.no_xla:
        from keras_transformer import generation

        generation.TF_JIT_COMPILE = False
    if args.threads is not None:
        import keras

        if keras.backend.backend() != "torch":
            parser.error("--threads is for the torch backend")
        import torch

        torch.set_num_threads(args.threads)
    results = run_benchmark(args.presets, args.lengths, args.beam_sizes, args.repeats, compile=not args.no_compile)
    results["threads"] = args.threads
    results["xla"] = results["compiled"] and results["backend"] == "tensorflow" and not args.no_xla
    suffix = ("" if results["compiled"] else "_eager") + ("_noxla" if args.no_xla else "")
    output = pathlib.Path(args.output or RESULTS / f"generate_{results['backend']}{suffix}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, output.with_suffix(".png"))
    print(f"{'preset':6s} {'search':7s} {'tokens':>6s} {'cached ms/tok':>14s} {'recompute ms/tok':>17s} {'ratio':>6s}")
    for c in results["cases"]:
        search = "greedy" if c["beam_size"] == 1 else f"beam {c['beam_size']}"
        print(f"{c['preset']:6s} {search:7s} {c['output_tokens']:6d} {c['cached_ms_per_token']:14.2f} "
              f"{c['recompute_ms_per_token']:17.2f} {c['speedup']:6.1f}")
    print(f"Wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
