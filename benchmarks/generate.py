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
model and source (`--batch-sizes` rows of 8 source tokens, default 1). The output length is forced:
both wrappers set the end id's logit to -inf, so the search runs until the
maximum length (source length + `max_extra_length`), where it forces the
end id. Each time is the median of `--repeats` runs after one warm-up run
(which also compiles, and is reported as `first_call_s`); ratios are
recompute / cached from the same run.

On PyTorch the search runs eagerly unless `--torch-compile BACKEND` sets
`keras_transformer.generation.TORCH_COMPILE_BACKEND` (each search step
captured with `torch.export` and compiled with `torch.compile`, once per
shape). The reference is then the eager loop in the same run: the variant
`cached_eager` (the cached step with `compile=False`), and the ratio is
cached_eager / cached, and both must give the same tokens.

```
python -m benchmarks.generate                       # tiny and small, TensorFlow unless KERAS_BACKEND is set
KERAS_BACKEND=jax python -m benchmarks.generate --presets tiny
KERAS_BACKEND=torch python -m benchmarks.generate --torch-compile inductor --threads 1 \
    --presets small --lengths 64 --batch-sizes 1 8 --variants cached cached_eager
```

Writes `benchmarks/results/generate_<backend>[_eager|_<torch backend>].json` and `.png`.
"""

import argparse
import json
import logging
import os
import pathlib
import platform
import time

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


VARIANTS = ("cached", "recompute", "cached_eager")


def run_benchmark(presets=("tiny", "small"), lengths=(16, 32, 64, 128), beam_sizes=(1, 4), repeats=3,
                  compile=True, seed=0, batch_sizes=(1,), variants=("cached", "recompute")):
    """Times cached and recomputing generation; returns a JSON-serializable dict.

    `variants` name what is timed (one or two of `VARIANTS`); with two, the
    first is the reference of each case's `speedup` (the second's ms per
    token over the first's).
    """
    import keras

    import keras_transformer as kt
    from keras_transformer import generation
    from keras_transformer.generation import generate

    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or len(variants) not in (1, 2):
        raise ValueError(f"variants={list(variants)} must be one or two of {list(VARIANTS)}")
    backend = keras.backend.backend()
    torch_compile = generation.TORCH_COMPILE_BACKEND if backend == "torch" else None
    compiled = compile and (backend in ("tensorflow", "jax") or torch_compile is not None)
    results = {
        "backend": backend,
        "compiled": compiled,
        "torch_compile_backend": torch_compile,
        "batch_sizes": list(batch_sizes),
        "variants": list(variants),
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
        wrappers = {"cached": (Cached(model), compile), "recompute": (Recompute(model), compile),
                    "cached_eager": (Cached(model), False)}
        for batch_size in batch_sizes:
            source = rng.integers(4, model.vocabulary_size, size=(batch_size, SOURCE_LENGTH)).astype("int32")
            source[:, -1] = model.end_id
            for beam_size in beam_sizes:
                for length in lengths:
                    extra = length - SOURCE_LENGTH
                    case = {"preset": preset, "batch_size": batch_size, "beam_size": beam_size,
                            "output_tokens": length}
                    tokens = None
                    for name in variants:
                        wrapper, compile_variant = wrappers[name]

                        def run():
                            return generate(wrapper, source, beam_size=beam_size, max_extra_length=extra,
                                            compile=compile_variant)

                        start = time.perf_counter()
                        ids = run()
                        case[f"{name}_first_call_s"] = time.perf_counter() - start
                        generated = {int(np.flatnonzero(row == model.end_id)[0]) for row in ids}
                        if generated != {length}:
                            raise RuntimeError(f"{name}: generated {sorted(generated)} tokens, expected {length}")
                        # recompute runs other float ops, so only the cached variants must agree bit for bit.
                        if tokens is not None and "recompute" not in variants and not np.array_equal(ids, tokens):
                            raise RuntimeError(f"{name} gave other tokens than {variants[0]}")
                        tokens = ids
                        seconds = median_seconds(run, repeats)
                        case[f"{name}_ms_per_token"] = 1000 * seconds / length
                    if len(variants) == 2:
                        reference, other = variants
                        case["speedup"] = case[f"{other}_ms_per_token"] / case[f"{reference}_ms_per_token"]
                    logger.info(
                        "%-5s batch %d beam %d %3d tokens: %s", preset, batch_size, beam_size, length,
                        ", ".join(f"{name} {case[name + '_ms_per_token']:.2f} ms/token" for name in variants),
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
    """ms/token against output length per variant, one panel per preset, batch size and search."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    cases = results["cases"]
    rows = list(dict.fromkeys((c["preset"], c["batch_size"]) for c in cases))
    beams = sorted({c["beam_size"] for c in cases})
    figure = Figure(figsize=(4.2 * len(beams), 3.3 * len(rows)), layout="constrained")
    axes = figure.subplots(len(rows), len(beams), squeeze=False)
    for i, (preset, batch) in enumerate(rows):
        for j, beam in enumerate(beams):
            panel = [c for c in cases if (c["preset"], c["batch_size"], c["beam_size"]) == (preset, batch, beam)]
            lengths = [c["output_tokens"] for c in panel]
            ax = axes[i, j]
            for name, style in zip(results["variants"], ("o-", "s--")):  # one or two
                ax.plot(lengths, [c[f"{name}_ms_per_token"] for c in panel], style, label=name)
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
            ax.set_title(f"{preset}, batch {batch}, {search}", fontsize=10)
            ax.legend(fontsize=8)
    mode = _mode(results)
    figure.suptitle(f"generate: {results['backend']} ({mode}), {results['environment']['cpu_count']} CPUs")
    figure.savefig(path, dpi=110)


def _mode(results):
    if not results["compiled"]:
        return "eager"
    if results["backend"] == "torch":
        return f"torch.compile {results['torch_compile_backend']}"
    return "compiled"


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
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["cached", "recompute"],
                        help="one or two timings per case; the ratio is the second's ms/token over the first's")
    parser.add_argument("--torch-compile", default=None, metavar="BACKEND",
                        help="PyTorch: compile each search step with torch.compile(backend=BACKEND), e.g. inductor")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/generate_<backend>.json)")
    args = parser.parse_args(argv)
    if min(args.lengths) <= SOURCE_LENGTH:
        parser.error(f"--lengths must be > the source length {SOURCE_LENGTH}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from keras_transformer import generation

    if args.no_xla:
        generation.TF_JIT_COMPILE = False
    if args.threads is not None or args.torch_compile is not None:
        import keras

        if keras.backend.backend() != "torch":
            parser.error("--threads and --torch-compile are for the torch backend")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    generation.TORCH_COMPILE_BACKEND = args.torch_compile
    results = run_benchmark(args.presets, args.lengths, args.beam_sizes, args.repeats, compile=not args.no_compile,
                            batch_sizes=args.batch_sizes, variants=args.variants)
    results["threads"] = args.threads
    results["xla"] = results["compiled"] and results["backend"] == "tensorflow" and not args.no_xla
    suffix = ("" if results["compiled"] else "_eager") + ("_noxla" if args.no_xla else "")
    if results["compiled"] and args.torch_compile is not None:
        suffix += f"_{args.torch_compile}"
    output = pathlib.Path(args.output or RESULTS / f"generate_{results['backend']}{suffix}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, output.with_suffix(".png"))
    reference, other = results["variants"][0], results["variants"][-1]
    print(f"{'preset':6s} {'batch':>5s} {'search':7s} {'tokens':>6s} {reference + ' ms/tok':>18s} "
          f"{other + ' ms/tok':>18s} {'ratio':>6s} {'1st call s':>10s}")
    for c in results["cases"]:
        search = "greedy" if c["beam_size"] == 1 else f"beam {c['beam_size']}"
        print(f"{c['preset']:6s} {c['batch_size']:5d} {search:7s} {c['output_tokens']:6d} "
              f"{c[reference + '_ms_per_token']:18.2f} {c[other + '_ms_per_token']:18.2f} {c.get('speedup', 1.0):6.1f} "
              f"{c[reference + '_first_call_s']:10.1f}")
    print(f"Wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
