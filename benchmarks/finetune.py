"""Fine-tuning speed: ours on each Keras backend vs Hugging Face's `MarianMTModel` (PyTorch).

The user this measures: someone fine-tuning an OPUS-MT checkpoint on their own
data, who would otherwise use `transformers`. Both sides start from the same
checkpoint (random weights written by `transformers`, imported by ours with
`TransformerModel.from_preset(dir)`) and train on the same batches.

- Shapes: `base`, OPUS-MT's (6 + 6 layers, d_model 512, d_ff 2048, 8 heads,
  swish, a 58,101-entry vocabulary as opus-mt-en-de's), and `small`, the
  Quick start's (3 + 3 layers, d_model 256, d_ff 1024, 4 heads, relu, 8,000
  entries). Both are Marian checkpoints (sin|cos-halves positions, a logits
  bias), built by `keras_transformer.convert.standin` from SentencePiece
  models trained on the bundled corpus, the vocabulary filled up to its size
  with unused entries.
- Batches: the bundled training split cut into token-budget batches
  (`keras_transformer.data.make_dataset`, `--budgets`, default about 2,000
  and 8,000 tokens a side) at its real lengths; the first `--batches` of
  them, in our ids and, for Hugging Face, the same tokens in Marian's ids.
- Ours: `training.compile_model` (Adam(0.9, 0.98, 1e-9), the paper's warmup
  schedule, label-smoothed cross-entropy 0.1) and `train_on_batch`, as
  `python -m keras_transformer.train` trains; dropout 0.1.
- Hugging Face: `MarianMTModel.from_pretrained(dir)` in train mode (dropout
  0.1), `torch.optim.AdamW(betas=(0.9, 0.98), eps=1e-9, weight_decay=0)` on the
  same schedule (`LambdaLR`), `F.cross_entropy(logits, labels,
  label_smoothing=0.1, ignore_index=-100)`, `zero_grad(set_to_none=True)`.

Each contender runs in its own process. Hugging Face's process lives through
the whole (shape, budget) group; ours start one backend at a time beside it
(two processes in memory at once). After a warm-up pass over the batches
(JAX compiles once per batch shape), the two take turns: `--rounds` rounds
of `--steps` steps each, so that the shared machine's noise hits both; the
figure is the median step. `ratio` is ours / Hugging Face from the rounds
that alternated with that backend. Hugging Face also steps with no process
of ours alive, before the first backend starts and after the last one ends
(`huggingface alone`, half the rounds at each end), and each backend gets
`ratio_to_huggingface_alone` too: the idle partner's resident memory slows
Hugging Face's page faults (below), so the paired ratio can flatter ours.

Figures: target tokens/s (non-padding labels), s/step, the process's peak
RSS, and MFU: training FLOPs (`benchmarks.train.transformer_training_flops`,
padded positions included) per second over the best float32 2048^3 matmul
measured in this run (each process measures its own framework's before and
after its steps; the best of all of them is the reference). And the kernel's
share: the median step's system time and memory faulted in (`getrusage`).
A process whose step maps its largest buffers afresh (glibc unmaps a freed
block over its mmap threshold) waits on the kernel for them, and the kernel
takes longer when the machine's memory is short: Hugging Face at base, 8,000
tokens, faulted in 11 GB and spent 7.7 s of CPU in the kernel a step
(2026-12-07), and its step took 19-32 s within the hour, alone or beside ours.

Correctness column: a separate process per contender with dropout 0 and the
same constant-rate optimizer (Adam(1e-4, 0.9, 0.98, 1e-9) / AdamW with weight
decay 0) trains `--check-steps` steps on the first batches of the smallest
budget; the losses of those steps are compared with Hugging Face's. Our
vocabulary has one more entry than Marian's (the start id, which takes
`<pad>`'s row, see `MarianTokenizer`), so the softmax holds `<pad>`'s logit
twice: the losses agree to about 1e-4, not bitwise.

The base shape at 8,000 tokens holds [8000, 58102] float32 logits (1.9 GB) and
their gradient in each of the two processes that are alive at once: run it with
nothing else in memory (beside a test suite, a 24 GB machine ran out).

```
python -m benchmarks.finetune                                  # everything (most of an hour on 2 cores)
python -m benchmarks.finetune --shapes small --budgets 2000 --backends torch
git worktree add ../before HEAD~1                              # an A/B of a change: the code before it ...
python -m benchmarks.finetune --shapes small --budgets 8000 --no-check --baseline ../before   # ... in turns with ours
```

`--baseline DIR` measures a change: a second checkout's code on each backend
(`<backend>@baseline`) takes turns with ours and Hugging Face's in the same
rounds, and ours gets `speedup_over_baseline` (the ratio of median steps).
Writes `benchmarks/results/finetune.json` (`--output`), after each group; the
checkpoints and batches are kept in `runs/bench-finetune/` and reused.
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

logger = logging.getLogger("benchmarks.finetune")

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "runs" / "bench-finetune"
BACKENDS = ("tensorflow", "jax", "torch")
CONTENDERS = ("huggingface",) + BACKENDS
BASELINE_SUFFIX = "@baseline"  # the row of a backend run from `--baseline DIR`, a second checkout
ALONE = "huggingface alone"  # the row of Hugging Face's steps with no process of ours alive

# Marian checkpoints of the two shapes (MarianConfig fields), built by `convert.standin`.
SHAPES = {
    "base": dict(
        d_model=512, encoder_ffn_dim=2048, decoder_ffn_dim=2048, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_layers=6, decoder_layers=6, activation_function="swish",
        vocabulary_size=58101, pieces=8000,
    ),
    "small": dict(
        d_model=256, encoder_ffn_dim=1024, decoder_ffn_dim=1024, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_layers=3, decoder_layers=3, activation_function="relu",
        vocabulary_size=8000, pieces=3000,
    ),
}
MAX_LENGTH = 128
CHECK_LEARNING_RATE = 1e-4
PAGE_BYTES = resource.getpagesize()
WARMUP_STEPS = 4000
LABEL_SMOOTHING = 0.1
DROPOUT = 0.1
SCHEDULE_STEPS = 10_000


# --------------------------------------------------------------------- #
# Checkpoints and batches (the coordinator, once)
# --------------------------------------------------------------------- #
def checkpoint_dir(shape):
    return WORK / shape


def batches_path(shape, budget):
    return WORK / f"{shape}-batches-{budget}.npz"


def prepare(shape, budgets, count):
    """Builds the shape's checkpoint and its batches, unless already there."""
    directory = checkpoint_dir(shape)
    if not (directory / "model.safetensors").is_file():
        from keras_transformer.convert.standin import build_marian_checkpoint

        sizes = dict(SHAPES[shape])
        vocabulary_size, pieces = sizes.pop("vocabulary_size"), sizes.pop("pieces")
        build_marian_checkpoint(
            directory, source_vocabulary_size=pieces, target_vocabulary_size=pieces, max_sentences=10**6,
            vocabulary_size=vocabulary_size, random_extras=False, **sizes,
        )
    missing = [b for b in budgets if not batches_path(shape, b).is_file()]
    if not missing:
        return
    from keras_transformer import data as data_lib
    from keras_transformer.datasets import load_bundled
    from keras_transformer.convert import read_hf_config
    from keras_transformer.convert.marian import convert_tokenizer
    from keras_transformer.schedules import warmup_learning_rate

    tokenizer = convert_tokenizer(directory, read_hf_config(directory))
    english, german = load_bundled("train")
    sources, targets = data_lib.encode_pairs(tokenizer, english, german, MAX_LENGTH)
    for budget in missing:
        dataset = data_lib.make_dataset(sources, targets, tokens_per_batch=budget, shuffle=True, seed=0)
        arrays = {}
        for i, (x, y) in enumerate(dataset.take(count)):
            arrays[f"source_{i}"] = x["encoder_token_ids"].numpy()
            arrays[f"decoder_{i}"] = x["decoder_token_ids"].numpy()
            arrays[f"labels_{i}"] = y.numpy()
        arrays["marian_ids"] = tokenizer.marian_ids
        # The paper's schedule at steps 1, 2, ... for Hugging Face's LambdaLR (its process imports no Keras).
        arrays["learning_rates"] = np.asarray(
            warmup_learning_rate(np.arange(1, SCHEDULE_STEPS + 1), SHAPES[shape]["d_model"], WARMUP_STEPS)
        )
        path = batches_path(shape, budget)
        np.savez(path.with_suffix(".tmp.npz"), **arrays)
        os.replace(path.with_suffix(".tmp.npz"), path)


def load_batches(shape, budget):
    """`(batches, arrays)`: a list of `(source, decoder_inputs, labels)` in our ids, and the file's other arrays
    (`marian_ids`, `learning_rates`)."""
    with np.load(batches_path(shape, budget)) as arrays:
        count = sum(1 for name in arrays.files if name.startswith("source_"))
        batches = [(arrays[f"source_{i}"], arrays[f"decoder_{i}"], arrays[f"labels_{i}"]) for i in range(count)]
        return batches, {name: arrays[name] for name in ("marian_ids", "learning_rates")}


# --------------------------------------------------------------------- #
# The contenders (each in a worker process)
# --------------------------------------------------------------------- #
class HuggingFace:
    """`MarianMTModel` trained as a `transformers` user would, on Marian's ids."""

    framework = "torch"

    def __init__(self, directory, tables, dropout, constant_rate=None, precision="float32"):
        import contextlib

        import torch
        import transformers

        torch.manual_seed(0)
        self.torch = torch
        # Mixed precision as a transformers user writes it on a CPU: autocast to bfloat16.
        self.autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision != "float32" else (
            contextlib.nullcontext)
        self.model = transformers.MarianMTModel.from_pretrained(str(directory), dropout=dropout)
        self.model.train()
        config = self.model.config
        self.pad = config.pad_token_id
        self.marian_ids = torch.from_numpy(np.asarray(tables["marian_ids"], "int64"))
        self.hidden_dim = config.d_model
        rate = constant_rate if constant_rate is not None else 1.0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=rate, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0
        )
        self.scheduler = None
        if constant_rate is None:
            rates = [float(r) for r in tables["learning_rates"]]  # the rate of steps 1, 2, ...
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: rates[step])

    def parameters(self):
        def count(module):
            return sum(p.numel() for p in module.parameters())

        model = self.model.model
        return count(self.model), count(model.encoder.layers), count(model.decoder.layers)

    def batch(self, source, decoder, labels):
        torch = self.torch
        source = self.marian_ids[torch.from_numpy(source.astype("int64"))]
        decoder = self.marian_ids[torch.from_numpy(decoder.astype("int64"))]
        mapped = self.marian_ids[torch.from_numpy(labels.astype("int64"))]
        labels = torch.where(torch.from_numpy(labels != 0), mapped, torch.full_like(mapped, -100))
        return source, source.ne(self.pad), decoder, labels

    def step(self, batch):
        torch = self.torch
        source, mask, decoder, labels = batch
        with self.autocast():
            logits = self.model(input_ids=source, attention_mask=mask, decoder_input_ids=decoder).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100,
            label_smoothing=LABEL_SMOOTHING,
        )
        loss.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


class Ours:
    """`TransformerModel.from_preset(dir)` compiled as the trainer compiles it."""

    def __init__(self, directory, tables, dropout, constant_rate=None, precision="float32"):
        import keras

        from keras_transformer import training
        from keras_transformer.losses import LabelSmoothedCrossEntropy
        from keras_transformer.model import TransformerModel

        self.framework = keras.backend.backend()
        set_random_seed(0)
        dtype = {"float32": "float32", "bfloat16": "mixed_bfloat16"}[precision]
        self.model = TransformerModel.from_preset(str(directory), dropout=dropout, dtype=dtype)
        if constant_rate is None:
            training.compile_model(self.model, warmup_steps=WARMUP_STEPS, label_smoothing=LABEL_SMOOTHING)
        else:
            self.model.compile(
                optimizer=keras.optimizers.Adam(constant_rate, beta_1=0.9, beta_2=0.98, epsilon=1e-9),
                loss=LabelSmoothedCrossEntropy(LABEL_SMOOTHING),
            )

    def parameters(self):
        from benchmarks.train import count_params

        return (int(self.model.count_params()), count_params(self.model.encoder_layers),
                count_params(self.model.decoder_layers))

    def batch(self, source, decoder, labels):
        return {"encoder_token_ids": source, "decoder_token_ids": decoder}, labels

    def step(self, batch):
        loss = self.model.train_on_batch(*batch)
        return float(np.asarray(loss[0] if isinstance(loss, (list, tuple)) else loss))


def set_random_seed(seed):
    """`keras.utils.set_random_seed`, without importing TensorFlow on JAX and PyTorch unless it is loaded.

    Keras' function imports TensorFlow wherever it is installed, to seed `tf.data`: about 470 MB
    resident in a JAX or PyTorch process (measured 2026-12-06), which Hugging Face's process does not
    hold. These workers feed NumPy batches, not `tf.data`; the trainer's pipeline
    (`keras_transformer.data`) still imports it.
    """
    import keras
    from keras.src.utils import module_utils

    lazy = module_utils.tensorflow
    if keras.backend.backend() == "tensorflow" or lazy.module is not None or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    available = lazy._available
    lazy._available = False  # read by set_random_seed: skip tf.random.set_seed
    try:
        keras.utils.set_random_seed(seed)
    finally:
        lazy._available = available


def _contender(name, directory, tables, dropout, constant_rate=None, precision="float32"):
    if name == "huggingface":
        return HuggingFace(directory, tables, dropout, constant_rate, precision)
    return Ours(directory, tables, dropout, constant_rate, precision)


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _matmul_peak(framework):
    if framework == "torch":
        import torch

        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(10):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
        return 2 * 2048**3 / best
    from benchmarks.train import matmul_peak

    return matmul_peak()


def worker(name, shape, budget, mode, check_steps, precision):
    """Runs in its own process: commands on stdin, one JSON line each on stdout."""
    batches, tables = load_batches(shape, budget)
    send = _sender()
    if mode == "check":
        contender = _contender(name, checkpoint_dir(shape), tables, 0.0, CHECK_LEARNING_RATE)
        losses = [contender.step(contender.batch(*batches[i % len(batches)])) for i in range(check_steps)]
        send({"losses": losses})
        return
    contender = _contender(name, checkpoint_dir(shape), tables, DROPOUT, precision=precision)
    prepared = [contender.batch(*b) for b in batches]
    peaks = [_matmul_peak(contender.framework)]
    start = time.perf_counter()
    first = None
    for batch in prepared:  # warm-up: one pass, so that every batch shape is compiled
        contender.step(batch)
        first = first or time.perf_counter() - start
    total, encoder, decoder = contender.parameters()
    send({"ready": True, "first_step_seconds": first, "warmup_seconds": time.perf_counter() - start,
          "parameters": total, "encoder_parameters": encoder, "decoder_parameters": decoder})
    position = 0
    for line in sys.stdin:
        command = line.split()
        if command[0] == "steps":
            times, indices, kernel, faults = [], [], [], []
            for _ in range(int(command[1])):
                index = position % len(prepared)
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                contender.step(prepared[index])  # the loss is read back: the step has finished
                times.append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_SELF)
                kernel.append(after.ru_stime - before.ru_stime)
                faults.append(after.ru_minflt - before.ru_minflt)
                indices.append(index)
                position += 1
            send({"times": times, "batches": indices, "system_seconds": kernel, "minor_faults": faults})
        elif command[0] == "done":
            peaks.append(_matmul_peak(contender.framework))
            send({"peak_rss_mb": _peak_rss_mb(), "matmul_peak_gflops": max(peaks) / 1e9})
            return


def _sender():
    out = sys.stdout

    def send(message):
        out.write(json.dumps(message) + "\n")
        out.flush()

    return send


# --------------------------------------------------------------------- #
# The coordinator
# --------------------------------------------------------------------- #
class Process:
    def __init__(self, name, shape, budget, mode="speed", check_steps=3, precision="float32", root=ROOT):
        backend = "torch" if name == "huggingface" else name
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        if root != ROOT:  # a second checkout's code (`--baseline`): its package, not the installed one
            env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
        command = [sys.executable, "-m", "benchmarks.finetune", "--worker", name, "--shapes", shape,
                   "--budgets", str(budget), "--mode", mode, "--check-steps", str(check_steps),
                   "--precision", precision]
        self.name = name if root == ROOT else f"{name}{BASELINE_SUFFIX}"
        self.process = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)

    def ask(self, command=None):
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the {self.name} worker stopped (exit {code}); its log is above")
        return json.loads(line)

    def finish(self):
        reply = self.ask("done")
        self.process.stdin.close()
        self.process.wait()
        return reply


def flops_per_batch(batch, parameters, shape):
    from benchmarks.train import transformer_training_flops

    source, decoder, _ = batch
    sizes = SHAPES[shape]
    return transformer_training_flops(
        encoder_parameters=parameters["encoder_parameters"], decoder_parameters=parameters["decoder_parameters"],
        hidden_dim=sizes["d_model"], vocabulary_size=sizes["vocabulary_size"],
        num_encoder_layers=sizes["encoder_layers"], num_decoder_layers=sizes["decoder_layers"],
        batch_size=source.shape[0], source_length=source.shape[1], target_length=decoder.shape[1],
    )


def _extend(measured, reply):
    """Adds a worker's reply to `steps` (a list per figure) to `measured`, figure by figure."""
    for field, values in reply.items():
        measured.setdefault(field, []).extend(values)


def summarize(measured, batches, flops):
    """Median step, target tokens/s and FLOP/s over the measured steps, and the kernel's share of them.

    `measured`: the workers' replies to `steps` merged by `_extend` (lists `times`, `batches`,
    `system_seconds`, `minor_faults`); the system time and the memory faulted in are medians per step.
    """
    times, indices = measured["times"], measured["batches"]
    tokens = [int((batches[i][2] != 0).sum()) for i in indices]
    return {
        "seconds_per_step": float(np.median(times)),
        "target_tokens_per_second": float(np.sum(tokens) / np.sum(times)),
        "flops_per_second": float(np.sum([flops[i] for i in indices]) / np.sum(times)),
        "steps": len(times),
        "system_seconds_per_step": float(np.median(measured["system_seconds"])),
        "faulted_mb_per_step": float(np.median(measured["minor_faults"])) * PAGE_BYTES / 2**20,
    }


def run_group(shape, budget, backends, rounds, steps, precision, baseline=None):
    """One (shape, budget, precision): Hugging Face beside each of our backends in turn.

    With `baseline` (a second checkout of this repository), that checkout's code on the same backend takes
    turns too: its row is `<backend>@baseline`, and ours gets `speedup_over_baseline`, from the same rounds.
    """
    batches, _ = load_batches(shape, budget)
    logger.info("%s, budget %d: %d batches, shapes %s, %d target tokens", shape, budget, len(batches),
                sorted({b[0].shape + b[1].shape for b in batches}), sum(int((b[2] != 0).sum()) for b in batches))
    hf = Process("huggingface", shape, budget, precision=precision)
    hf_ready = hf.ask()
    flops = [flops_per_batch(b, hf_ready, shape) for b in batches]
    rows, hf_measured, alone = {}, {}, {}

    def hf_alone():
        """Hugging Face's steps with no process of ours alive: a partner's resident memory slows its page faults."""
        for _ in range(max(1, rounds // 2)):
            _extend(alone, hf.ask(f"steps {steps}"))

    hf_alone()
    for backend in backends:
        ours = Process(backend, shape, budget, precision=precision)
        ready = ours.ask()
        if (ready["encoder_parameters"], ready["decoder_parameters"]) != (
                hf_ready["encoder_parameters"], hf_ready["decoder_parameters"]):
            raise RuntimeError(f"{backend}: the layers' parameter counts differ from Hugging Face's: {ready} {hf_ready}")
        turns = [("ours", ours), ("hf", hf)]
        if baseline is not None:
            old = Process(backend, shape, budget, precision=precision, root=baseline)
            old_ready = old.ask()
            turns.insert(1, ("baseline", old))
        measured = {key: {} for key, _ in turns}
        for _ in range(rounds):
            for key, process in turns:
                _extend(measured[key], process.ask(f"steps {steps}"))
        done = ours.finish()
        if baseline is not None:
            old_done = old.finish()
            old_row = summarize(measured["baseline"], batches, flops)
        row = summarize(measured["ours"], batches, flops)
        reference = summarize(measured["hf"], batches, flops)
        _extend(hf_measured, measured["hf"])
        row.update(
            ratio=row["target_tokens_per_second"] / reference["target_tokens_per_second"],
            huggingface_alongside=reference, peak_rss_mb=done["peak_rss_mb"],
            matmul_peak_gflops=done["matmul_peak_gflops"], first_step_seconds=ready["first_step_seconds"],
            parameters=ready["parameters"],
        )
        rows[backend] = row
        logger.info("%s %d %s: %.0f target tokens/s, %.3f s/step, %.2fx Hugging Face, peak RSS %.0f MB", shape,
                    budget, backend, row["target_tokens_per_second"], row["seconds_per_step"], row["ratio"],
                    row["peak_rss_mb"])
        if baseline is not None:
            old_row.update(
                ratio=old_row["target_tokens_per_second"] / reference["target_tokens_per_second"],
                peak_rss_mb=old_done["peak_rss_mb"], matmul_peak_gflops=old_done["matmul_peak_gflops"],
                first_step_seconds=old_ready["first_step_seconds"], parameters=old_ready["parameters"],
                checkout=str(baseline),
            )
            row["speedup_over_baseline"] = old_row["seconds_per_step"] / row["seconds_per_step"]
            rows[backend + BASELINE_SUFFIX] = old_row
            logger.info("%s %d %s: %.3f s/step; ours %.3f s/step, %.2fx it", shape, budget, old.name,
                        old_row["seconds_per_step"], row["seconds_per_step"], row["speedup_over_baseline"])
    hf_alone()
    done = hf.finish()
    row = summarize(hf_measured, batches, flops)
    row.update(peak_rss_mb=done["peak_rss_mb"], matmul_peak_gflops=done["matmul_peak_gflops"],
               first_step_seconds=hf_ready["first_step_seconds"], parameters=hf_ready["parameters"], ratio=1.0)
    rows["huggingface"] = row
    logger.info("%s %d huggingface: %.0f target tokens/s, %.3f s/step, peak RSS %.0f MB", shape, budget,
                row["target_tokens_per_second"], row["seconds_per_step"], row["peak_rss_mb"])
    alone_row = summarize(alone, batches, flops)
    alone_row.update(peak_rss_mb=done["peak_rss_mb"], matmul_peak_gflops=done["matmul_peak_gflops"], ratio=1.0)
    rows[ALONE] = alone_row
    for name, contender in rows.items():
        if name not in ("huggingface", ALONE):
            contender["ratio_to_huggingface_alone"] = (contender["target_tokens_per_second"]
                                                       / alone_row["target_tokens_per_second"])
    logger.info("%s %d huggingface alone (before and after the others): %.0f target tokens/s, %.3f s/step", shape,
                budget, alone_row["target_tokens_per_second"], alone_row["seconds_per_step"])
    return {
        "shape": shape, "budget": budget, "precision": precision, "batches": len(batches),
        "target_tokens_per_batch": [int((b[2] != 0).sum()) for b in batches],
        "batch_shapes": [list(b[0].shape) + [b[1].shape[1]] for b in batches],
        "contenders": rows,
    }


def run_check(shape, budget, backends, check_steps):
    """Losses of the first steps with dropout 0 and a constant-rate Adam, against Hugging Face's."""
    losses = {name: Process(name, shape, budget, "check", check_steps).ask()["losses"]
              for name in ("huggingface",) + tuple(backends)}
    reference = np.asarray(losses["huggingface"])
    differences = {b: float(np.max(np.abs(np.asarray(losses[b]) - reference))) for b in backends}
    logger.info("%s check: losses %s; largest difference to Hugging Face %s", shape, losses, differences)
    return {"budget": budget, "steps": check_steps, "learning_rate": CHECK_LEARNING_RATE, "losses": losses,
            "max_abs_difference": differences}


def _versions():
    import importlib.metadata as metadata

    names = ("keras", "tensorflow", "jax", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def table(results):
    """benchmarks/README.md's table: one row per (shape, budget, contender)."""
    lines = ["| shape | budget | precision | contender | target tokens/s | ratio to HF (to HF alone) | s/step | MFU | "
             "system s/step (GB faulted in) | peak RSS (MB) | loss difference |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    peak = results["matmul_peak_gflops"] * 1e9
    for group in results["groups"]:
        check = results["checks"].get(group["shape"], {}).get("max_abs_difference", {})
        if group["precision"] != "float32":
            check = {}
        for name in ("huggingface", ALONE) + tuple(n for b in BACKENDS for n in (b, b + BASELINE_SUFFIX)):
            row = group["contenders"].get(name)
            if row is None:
                continue
            difference = "reference" if name in ("huggingface", ALONE) else (
                f"{check[name]:.1e}" if name in check else "-")
            ratio = f"{row['ratio']:.2f}x" + (
                f" ({row['ratio_to_huggingface_alone']:.2f}x)" if "ratio_to_huggingface_alone" in row else "")
            lines.append(
                f"| {group['shape']} | {group['budget']} | {group['precision']} | {name} | {row['target_tokens_per_second']:,.0f} | "
                f"{ratio} | {row['seconds_per_step']:.3f} | {row['flops_per_second'] / peak:.0%} | "
                f"{_kernel_share(row)} | {row['peak_rss_mb']:,.0f} | {difference} |"
            )
    return "\n".join(lines)


def _kernel_share(row):
    """`0.37 (0.6)`: the median step's system seconds and GB of memory faulted in; `-` in results from before."""
    if "system_seconds_per_step" not in row:
        return "-"
    return f"{row['system_seconds_per_step']:.2f} ({row['faulted_mb_per_step'] / 1024:.1f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="base,small")
    parser.add_argument("--budgets", default="2000,8000", help="token budgets per side of a batch")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--batches", type=int, default=3, help="batches per budget (each one a warm-up step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--precisions", default="float32",
                        help="float32 and/or bfloat16 (ours: mixed_bfloat16; Hugging Face: autocast to bfloat16)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness column")
    parser.add_argument("--output", default=str(RESULTS / "finetune.json"))
    parser.add_argument("--baseline", metavar="DIR",
                        help="a second checkout of this repository (e.g. `git worktree add DIR REF`): its code on "
                             "each backend takes turns with ours, as `<backend>@baseline` (an A/B of a change)")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("speed", "check"), default="speed", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.worker:
        worker(args.worker, shapes[0], budgets[0], args.mode, args.check_steps, args.precision)
        return 0
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    precisions = args.precisions.split(",")
    if set(precisions) - {"float32", "bfloat16"}:
        parser.error("--precisions: float32 and/or bfloat16")
    backends = [b for b in args.backends.split(",") if b]
    if set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {','.join(BACKENDS)}")
    baseline = _baseline(parser, args.baseline) if args.baseline else None
    for shape in shapes:
        prepare(shape, budgets, args.batches)
    if baseline is not None:
        _share_work(baseline)
    results = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "versions": _versions(), "rounds": args.rounds, "steps_per_round": args.steps,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "groups": [], "checks": {}}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        if not args.no_check:
            results["checks"][shape] = run_check(shape, min(budgets), backends, args.check_steps)
        for budget in budgets:
            for precision in precisions:
                results["groups"].append(
                    run_group(shape, budget, backends, args.rounds, args.steps, precision, baseline))
                _write(results, output)  # after each group: a later failure (memory) keeps what was measured
    print(table(results))
    return 0


def _baseline(parser, directory):
    """`--baseline DIR` resolved, or a parser error in one line."""
    root = pathlib.Path(directory).expanduser().resolve()
    if not (root / "benchmarks" / "finetune.py").is_file() or not (root / "keras_transformer").is_dir():
        parser.error(f"--baseline {directory}: not a checkout of this repository (no benchmarks/finetune.py and "
                     "keras_transformer/ there); make one with `git worktree add DIR REF`")
    if root == ROOT.resolve():
        parser.error(f"--baseline {directory}: that is this checkout; give a second one (`git worktree add DIR REF`)")
    return root


def _share_work(root):
    """The baseline's workers read the same checkpoints and batches: its `runs/bench-finetune` is a link to ours.

    An existing directory there is left alone (its batches come from the same corpus and budgets).
    """
    link = root / "runs" / "bench-finetune"
    if link.exists() or link.is_symlink():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(WORK.resolve(), target_is_directory=True)
    logger.info("linked %s to %s for the baseline's workers", link, WORK)


def _write(results, output):
    results["matmul_peak_gflops"] = max(
        row["matmul_peak_gflops"] for group in results["groups"] for row in group["contenders"].values()
    )
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    temporary = output.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(temporary, output)


if __name__ == "__main__":
    sys.exit(main())
