"""Training speed: our TransformerModel vs the same architecture from keras-hub's layers.

Config "bench-small": shared vocabulary 8000, hidden 256, intermediate 1024,
4 heads, 3 encoder + 3 decoder layers, dropout 0.1, batch 32, source and
target length 64, float32, Adam(0.9, 0.98, 1e-9) with the warmup schedule,
label-smoothed cross-entropy (0.1), causal and padding masks (every row is
padded after a random length in [48, 64]).

- `ours`: `keras_transformer.TransformerModel`, compiled as training does
  (`training.compile_model`).
- `keras_hub`: a functional model built from keras-hub's layers:
  `ReversibleEmbedding` (shared by encoder input, decoder input and the
  output projection), `SinePositionEncoding`, `TransformerEncoder` and
  `TransformerDecoder` with `normalize_first=False` (post-LN, as the paper),
  embeddings scaled by sqrt(d_model) and dropout on embedding + position, as
  ours. Same optimizer, schedule, loss and data.

Both are timed alternately in one process (`--rounds` rounds of `--steps`
`train_on_batch` calls each, after a warm-up that compiles), so machine noise
hits both; the ratio ours / keras-hub of target tokens per second is the
figure to read. Target tokens count non-padding labels.

Physical reference: the best float32 2048x2048 matmul throughput measured in
the same process (TensorFlow eager matmul on the TensorFlow backend,
`jax.jit` matmul on JAX, `torch.matmul` on PyTorch), against which the model
FLOP utilisation (MFU) is reported. Training FLOPs per step (forward +
backward = 3 x forward; a multiply-add is 2 FLOPs):

    6 * (encoder parameters * source tokens + decoder parameters * target tokens)
    + 6 * d_model * vocabulary * target tokens                 (output projection)
    + 12 * d_model * layers * (S^2 + T^2 + T*S) * batch       (attention scores and sums)

with "parameters" excluding the embedding and counting padded positions
(the dense kernels compute them).

`--scaling` times one encoder layer (forward + backward, batch 1) at
n = 256 ... 8192 with full self-attention and with `attention_window=129`
(the paper's Table 1 "restricted self-attention": each position sees the
r = 129 positions centered on it, 64 on each side; O(n * r) when computed
blockwise), and plots time against n.

```
python -m benchmarks.train                   # all backends, each in a subprocess
python -m benchmarks.train --backends tensorflow --rounds 3 --steps 5
python -m benchmarks.train --scaling         # sequence-length scaling (TensorFlow)
python -m benchmarks.train --big --mixed-precision mixed_bfloat16   # the big preset (for GPUs)
bash benchmarks/gpu.sh                       # all of it on one GPU
```

Writes `benchmarks/results/train.json` (+ `train_<backend>.json` parts),
`train.png`, and for `--scaling` `scaling.json` / `scaling.png`.
"""

import argparse
import json
import logging
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

import numpy as np

logger = logging.getLogger("benchmarks.train")

RESULTS = pathlib.Path(__file__).parent / "results"
BACKENDS = ("tensorflow", "jax", "torch")

BENCH_SMALL = {
    "vocabulary_size": 8000,
    "num_layers": 3,
    "num_heads": 4,
    "hidden_dim": 256,
    "intermediate_dim": 1024,
    "dropout": 0.1,
    "batch_size": 32,
    "sequence_length": 64,
}


# --------------------------------------------------------------------- #
# Data and FLOPs
# --------------------------------------------------------------------- #
def make_batch(config, seed=0):
    """Random ids, each row padded (0) after a random length in [3/4 L, L]."""
    rng = np.random.default_rng(seed)
    batch, length, vocab = config["batch_size"], config["sequence_length"], config["vocabulary_size"]

    def rows():
        ids = rng.integers(4, vocab, size=(batch, length + 1)).astype("int32")
        lengths = rng.integers(length * 3 // 4, length + 1, size=batch)
        for row, n in enumerate(lengths):
            ids[row, n:] = 0
        return ids

    source = rows()[:, :length]
    target = rows()
    x = {"encoder_token_ids": source, "decoder_token_ids": target[:, :-1]}
    return x, target[:, 1:]


def training_flops(config, encoder_params, decoder_params):
    """FLOPs of one training step (see the module docstring)."""
    return transformer_training_flops(
        encoder_params, decoder_params, config["hidden_dim"], config["vocabulary_size"], config["num_layers"],
        config["num_layers"], config["batch_size"], config["sequence_length"], config["sequence_length"],
    )


def transformer_training_flops(encoder_parameters, decoder_parameters, hidden_dim, vocabulary_size,
                               num_encoder_layers, num_decoder_layers, batch_size, source_length, target_length):
    """FLOPs of one training step (forward + backward = 3 x forward) at padded lengths S and T.

    6 * (encoder parameters * B * S + decoder parameters * B * T) for the
    layers' products, 6 * d * V * B * T for the output projection, and
    12 * d * B * (L_enc * S^2 + L_dec * (T^2 + T * S)) for the attention
    scores and weighted sums; "parameters" exclude the embedding.
    """
    b, s, t, d = batch_size, source_length, target_length, hidden_dim
    dense = 6 * (encoder_parameters * b * s + decoder_parameters * b * t)
    output = 6 * d * vocabulary_size * b * t
    attention = 12 * d * b * (num_encoder_layers * s * s + num_decoder_layers * (t * t + t * s))
    return dense + output + attention


def count_params(layers):
    return int(sum(np.prod(w.shape) for layer in layers for w in layer.weights))


# --------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------- #
def build_ours(config):
    import keras_transformer as kt

    return kt.TransformerModel(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        hidden_dim=config["hidden_dim"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config["dropout"],
        max_sequence_length=config["sequence_length"] + 1,
    )


def build_keras_hub(config):
    """The paper's architecture from keras-hub layers, as a functional model."""
    import keras
    import keras_hub

    d = config["hidden_dim"]
    embedding = keras_hub.layers.ReversibleEmbedding(
        config["vocabulary_size"], d, embeddings_initializer=keras.initializers.RandomNormal(stddev=d**-0.5),
        name="token_embedding",
    )
    positions = keras_hub.layers.SinePositionEncoding()

    def embed(ids, name):
        x = embedding(ids) * (d**0.5)
        x = x + positions(x)
        return keras.layers.Dropout(config["dropout"], name=f"{name}_dropout")(x)

    source = keras.Input((None,), dtype="int32", name="encoder_token_ids")
    target = keras.Input((None,), dtype="int32", name="decoder_token_ids")
    source_mask = keras.ops.not_equal(source, 0)
    target_mask = keras.ops.not_equal(target, 0)
    x = embed(source, "encoder")
    for i in range(config["num_layers"]):
        x = keras_hub.layers.TransformerEncoder(
            config["intermediate_dim"], config["num_heads"], dropout=config["dropout"],
            normalize_first=False, name=f"encoder_{i}",
        )(x, padding_mask=source_mask)
    encoded = x
    y = embed(target, "decoder")
    for i in range(config["num_layers"]):
        y = keras_hub.layers.TransformerDecoder(
            config["intermediate_dim"], config["num_heads"], dropout=config["dropout"],
            normalize_first=False, name=f"decoder_{i}",
        )(y, encoded, decoder_padding_mask=target_mask, encoder_padding_mask=source_mask)
    logits = embedding(y, reverse=True)
    model = keras.Model({"encoder_token_ids": source, "decoder_token_ids": target}, logits, name="keras_hub")
    model.hidden_dim = d  # read by training.compile_model's warmup schedule
    return model


def compile_for_bench(model, jit_compile):
    from keras_transformer import training

    training.compile_model(model, warmup_steps=4000, jit_compile=jit_compile)
    return model


def encoder_decoder_params(model, ours):
    """Non-embedding parameters of the encoder and of the decoder."""
    if ours:
        return count_params(model.encoder_layers), count_params(model.decoder_layers)
    encoder = [layer for layer in model.layers if layer.name.startswith("encoder_") and "dropout" not in layer.name]
    decoder = [layer for layer in model.layers if layer.name.startswith("decoder_") and "dropout" not in layer.name]
    return count_params(encoder), count_params(decoder)


# --------------------------------------------------------------------- #
# Peak
# --------------------------------------------------------------------- #
def matmul_peak(size=2048, repeats=10):
    """Best float32 size x size matmul throughput (FLOP/s) on this backend."""
    import keras

    backend = keras.backend.backend()
    a = np.random.default_rng(0).standard_normal((size, size)).astype("float32")
    b = np.random.default_rng(1).standard_normal((size, size)).astype("float32")
    if backend == "tensorflow":
        import tensorflow as tf

        ta, tb = tf.constant(a), tf.constant(b)

        def run():
            tf.linalg.matmul(ta, tb).numpy()

    elif backend == "jax":
        import jax

        ja, jb = jax.device_put(a), jax.device_put(b)
        mm = jax.jit(lambda x, y: x @ y)

        def run():
            mm(ja, jb).block_until_ready()

    else:
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)

        def run():
            torch.matmul(ta, tb)

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# --------------------------------------------------------------------- #
# One backend (runs in its own process: the backend is fixed at import)
# --------------------------------------------------------------------- #
def _sync(value):
    """Waits for an asynchronous backend (JAX) to finish a step."""
    return float(np.asarray(value if not isinstance(value, (list, tuple)) else value[0]))


def bench_backend(config, rounds, steps, variants):
    import keras

    backend = keras.backend.backend()
    x, y = make_batch(config)
    target_tokens = int((y != 0).sum())
    peak = matmul_peak()
    logger.info("%s: float32 matmul peak %.1f GFLOP/s", backend, peak / 1e9)

    models = {}
    for name, jit in variants:
        keras.utils.set_random_seed(0)
        ours = name.startswith("ours")
        model = build_ours(config) if ours else build_keras_hub(config)
        compile_for_bench(model, jit)
        start = time.perf_counter()
        _sync(model.train_on_batch(x, y))  # builds and compiles
        compile_seconds = time.perf_counter() - start
        for _ in range(2):  # the first steps after compilation are still slow
            _sync(model.train_on_batch(x, y))
        encoder, decoder = encoder_decoder_params(model, ours)
        models[name] = {
            "model": model,
            "jit_compile": jit,
            "compile_seconds": compile_seconds,
            "flops_per_step": training_flops(config, encoder, decoder),
            "parameters": int(model.count_params()),
            "times": [],
        }
        logger.info("%s: built %s (%d parameters, first step %.1f s)", backend, name, model.count_params(),
                    compile_seconds)
    for _ in range(rounds):  # alternate so that noise hits every variant
        for name, entry in models.items():
            model = entry["model"]
            start = time.perf_counter()
            for _ in range(steps):
                loss = model.train_on_batch(x, y)
            _sync(loss)
            entry["times"].append((time.perf_counter() - start) / steps)
    # The peak again after the rounds: on a shared machine one measurement can
    # land in a busy moment, which would overstate the MFU.
    peak = max(peak, matmul_peak())
    rows = {}
    for name, entry in models.items():
        step = float(np.median(entry["times"]))
        rows[name] = {
            "jit_compile": entry["jit_compile"],
            "parameters": entry["parameters"],
            "seconds_per_step": step,
            "step_times": entry["times"],
            "target_tokens_per_second": target_tokens / step,
            "mfu": entry["flops_per_step"] / step / peak,
            "flops_per_step": entry["flops_per_step"],
            "first_step_seconds": entry["compile_seconds"],
        }
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "backend": backend,
        "keras": keras.__version__,
        "config": config,
        "target_tokens_per_step": target_tokens,
        "matmul_peak_gflops": peak / 1e9,
        "process_peak_rss_mb": peak_rss_mb,
        "rounds": rounds,
        "steps_per_round": steps,
        "results": rows,
    }


def variants_for(backend):
    if backend == "tensorflow":
        return [("ours", False), ("keras_hub", False), ("ours_xla", True), ("keras_hub_xla", True)]
    if backend == "jax":
        return [("ours", True), ("keras_hub", True)]
    return [("ours", False), ("keras_hub", False)]


# --------------------------------------------------------------------- #
# The paper's big preset (benchmarks/gpu.sh)
# --------------------------------------------------------------------- #
# The paper (section 5.2): the big model trained on 8 P100 GPUs at 1.0 s per
# step, with batches of about 25,000 target tokens: about 25,000 target
# tokens per second in all, about 3,100 per GPU.
PAPER_BIG_TARGET_TOKENS_PER_SECOND = 25_000
PAPER_BIG_GPUS = 8


def bench_big(batch_size, sequence_length, steps, mixed_precision):
    """Training throughput of `TransformerModel.from_preset("big")` on random batches."""
    import keras

    import keras_transformer as kt

    if mixed_precision:
        keras.mixed_precision.set_global_policy(mixed_precision)
    config = dict(BENCH_SMALL, batch_size=batch_size, sequence_length=sequence_length, vocabulary_size=37000)
    x, y = make_batch(config)
    target_tokens = int((y != 0).sum())
    keras.utils.set_random_seed(0)
    model = kt.TransformerModel.from_preset("big")
    compile_for_bench(model, "auto")
    start = time.perf_counter()
    _sync(model.train_on_batch(x, y))
    first = time.perf_counter() - start
    _sync(model.train_on_batch(x, y))
    start = time.perf_counter()
    for _ in range(steps):
        loss = model.train_on_batch(x, y)
    _sync(loss)
    step = (time.perf_counter() - start) / steps
    per_gpu = PAPER_BIG_TARGET_TOKENS_PER_SECOND / PAPER_BIG_GPUS
    result = {
        "backend": keras.backend.backend(),
        "devices": [str(d) for d in _devices()],
        "preset": "big",
        "parameters": int(model.count_params()),
        "batch_size": batch_size,
        "sequence_length": sequence_length,
        "mixed_precision": mixed_precision or "float32",
        "target_tokens_per_step": target_tokens,
        "seconds_per_step": step,
        "first_step_seconds": first,
        "target_tokens_per_second": target_tokens / step,
        "paper_target_tokens_per_second": PAPER_BIG_TARGET_TOKENS_PER_SECOND,
        "paper_gpus": f"{PAPER_BIG_GPUS} x P100",
        "ratio_to_paper_per_gpu": target_tokens / step / per_gpu,
    }
    logger.info(
        "big: %.0f target tokens/s (%s, batch %d x %d, %.3f s/step); the paper: about %d on %d P100s (%d per GPU)",
        result["target_tokens_per_second"], result["mixed_precision"], batch_size, sequence_length, step,
        PAPER_BIG_TARGET_TOKENS_PER_SECOND, PAPER_BIG_GPUS, per_gpu,
    )
    return result


def _devices():
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.config.list_logical_devices()
    if keras.backend.backend() == "jax":
        import jax

        return jax.devices()
    import torch

    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


# --------------------------------------------------------------------- #
# Sequence-length scaling (Table 1)
# --------------------------------------------------------------------- #
def bench_scaling(lengths, window, repeats):
    import keras

    import keras_transformer as kt
    from benchmarks.timing import median_seconds

    rows = []
    for n in lengths:
        row = {"n": n}
        for name, attention_window in (("full", None), ("window", window)):
            keras.utils.set_random_seed(0)
            layer = kt.layers.TransformerEncoderLayer(
                intermediate_dim=1024, num_heads=4, dropout=0.0, attention_window=attention_window
            )
            x = keras.random.normal((1, n, 256))
            layer(x)
            step = _encoder_layer_step(layer, x)
            row[name] = median_seconds(step, repeats)
        rows.append(row)
        logger.info("n=%d full %.4f s window %.4f s", n, row["full"], row["window"])
    return {"backend": keras.backend.backend(), "window": window, "hidden_dim": 256, "rows": rows}


def _encoder_layer_step(layer, x):
    """Forward + backward of one layer, compiled where the backend allows."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=False, reduce_retracing=True)
        def tf_step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True))
            return tape.gradient(loss, layer.trainable_variables)

        return lambda: [g.numpy() for g in tf_step(x)][:1]
    if backend == "jax":
        import jax

        def loss_fn(trainable, x):
            y, _ = layer.stateless_call(trainable, [v.value for v in layer.non_trainable_variables], x)
            return y.sum()

        grad = jax.jit(jax.grad(loss_fn))
        values = [v.value for v in layer.trainable_variables]
        return lambda: jax.block_until_ready(grad(values, x))
    def torch_step():
        layer(x, training=True).sum().backward()

    return torch_step


# --------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------- #
def _run_child(backend, args, results):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    part = results / f"train_{backend}.json"
    command = [sys.executable, "-m", "benchmarks.train", "--child", "--output", str(part),
               "--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.variants:
        command += ["--variants", args.variants]
    logger.info("running %s", " ".join(command))
    subprocess.run(command, env=env, check=True, cwd=pathlib.Path(__file__).parent.parent)
    return json.loads(part.read_text())


def write_table(results):
    lines = [
        "| backend | variant | XLA/jit | target tok/s | ratio to keras-hub | MFU | s/step |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for result in results:
        rows = result["results"]
        for name, row in rows.items():
            reference = "keras_hub" + ("_xla" if name.endswith("_xla") else "")
            ratio = row["target_tokens_per_second"] / rows[reference]["target_tokens_per_second"]
            lines.append(
                f"| {result['backend']} | {name} | {'on' if row['jit_compile'] else 'off'} "
                f"| {row['target_tokens_per_second']:,.0f} | {ratio:.2f}x | {row['mfu']:.0%} "
                f"| {row['seconds_per_step']:.3f} |"
            )
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for result in results:
        for name, row in result["results"].items():
            labels.append(f"{result['backend']}\n{name}")
            values.append(row["target_tokens_per_second"])
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4))
    ax.bar(range(len(values)), values, color=["C0" if "ours" in label else "C1" for label in labels])
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("target tokens / second")
    ax.set_title("bench-small training throughput (blue: ours, orange: keras-hub)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_scaling(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [row["n"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.loglog(n, [row["full"] for row in result["rows"]], "o-", label="full self-attention")
    ax.loglog(n, [row["window"] for row in result["rows"]], "s-", label=f"window r={result['window']}")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("seconds per forward+backward (one layer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scaling", action="store_true", help="sequence-length scaling instead")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    parser.add_argument("--window", type=int, default=129,
                        help="attention_window r, the window's width (odd; 129 = 64 positions each side)")
    parser.add_argument("--variants", help="comma-separated subset, e.g. ours,keras_hub")
    parser.add_argument("--big", action="store_true",
                        help="time the paper's big preset on the KERAS_BACKEND backend instead (big.json)")
    parser.add_argument("--batch-size", type=int, default=128, help="--big: sentences per batch (default 128)")
    parser.add_argument("--sequence-length", type=int, default=64, help="--big: tokens per sentence (default 64)")
    parser.add_argument("--mixed-precision", default=None,
                        help="--big: a Keras dtype policy, e.g. mixed_bfloat16 (default float32)")
    parser.add_argument("--results", default=str(RESULTS), help="directory for the JSON and plots")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    results_dir = pathlib.Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        result = bench_scaling([int(n) for n in args.lengths.split(",")], args.window, repeats=3)
        result["machine"] = platform.processor() or platform.machine()
        (results_dir / "scaling.json").write_text(json.dumps(result, indent=2))
        plot_scaling(result, results_dir / "scaling.png")
        return
    if args.big:
        result = bench_big(args.batch_size, args.sequence_length, args.steps, args.mixed_precision)
        (results_dir / "big.json").write_text(json.dumps(result, indent=2))
        return
    if args.child:
        import keras

        variants = variants_for(keras.backend.backend())
        if args.variants:
            variants = [v for v in variants if v[0] in args.variants.split(",")]
        result = bench_backend(BENCH_SMALL, args.rounds, args.steps, variants)
        pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
        return
    results = [_run_child(backend, args, results_dir) for backend in args.backends.split(",")]
    summary = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    (results_dir / "train.json").write_text(json.dumps(summary, indent=2))
    plot(results, results_dir / "train.png")
    print(write_table(results))


if __name__ == "__main__":
    main()
