"""Serving benchmark: Keras (XLA), ONNX Runtime and CTranslate2, side by side in one run.

Five systems translate the same source ids:

- `keras`: `TransformerModel.generate`, the XLA-compiled search on TensorFlow;
- `ort-float32`, `ort-int8`: `export.runtime.OnnxSeq2Seq.generate`, the
  search's exported start and update graphs around the fused decoder step,
  driven step by step, finished rows leaving the batch (`export/steps.py`;
  `export.onnx`, float32 and int8 weights);
- `ct2-float32`, `ct2-int8`: CTranslate2's `translate_batch` on the model
  written by `export.ctranslate2` (skipped, with a message, when that module
  or `ctranslate2` is missing).

Each system runs in its own worker process (`--worker`), so none loads the
libraries of another and each one's memory is its own; the parent sends the
same requests to all of them, one at a time, in rounds (the order of the
systems rotates every round), so a change in the machine's load hits every
system alike. Settings: batch 1 and 16, greedy and beam 4 (length penalty
0.6), one thread per system (ONNX Runtime `intra_op_num_threads=1` without
spinning; CTranslate2 `intra_threads=1, inter_threads=1` with
`OMP_WAIT_POLICY=PASSIVE`; TensorFlow intra- and inter-op threads 1, set
before first use), and optionally more (`--threads 1 2`). Every source of a
batch has `--source-length` pieces (plus the end id), so every system allows
the same number of output tokens (source + `--max-extra-length`; for
CTranslate2 `export.ctranslate2.max_decoding_length`). A model with random
weights practically never emits the end id, so every system then generates
exactly that many tokens; the tokens per row are checked and reported
(`tokens_per_row`), and the float32 tokens of each system are compared with
Keras' (`agreement`).

Reported per system and setting: the median over `--rounds` rounds of the
seconds per call, ms per generated token (call time / tokens generated in
the whole batch, end ids not counted), sentences per second, the speed-up
over Keras and the ONNX Runtime / CTranslate2 time ratios (same run), and
the CPU time / wall time of the worker while it ran (1.0 = one busy core),
and CPU ms per token (the worker's CPU time per call / tokens: with one
thread, less sensitive to other load on the machine than the wall time).

Then the serving paths as a user starts them, one sentence on stdin, each
run `--cold-repeats` times (after one untimed run that fills the page cache,
writes the repository's bytecode as an installed package has it, and fills
`export.runtime`'s optimised-graph cache, kept in the work directory):
`python -m export.runtime --threads 1`, `python -m keras_transformer.translate`
and a minimal CTranslate2 + SentencePiece script (`CT2_SCRIPT`): seconds from
process start to the first translation on stdout, and the process's peak
resident memory (`ru_maxrss` from `os.wait4`). And the installed size of each
path's Python distributions (their RECORD files, dependencies included).

`--profile` adds ONNX Runtime's profiler on the server's search (the step
driver's graphs, float32, beam 4, batch 1 and 16, one thread): time per
graph, the driver's own time, time per graph and op type, top first.

The model: a preset directory (a trained `runs/small`), or a built-in preset
name, which gets random weights (`--seed`) and a tokenizer trained on the
bundled corpus, saved as a preset directory in the work directory. Exports
are cached there too (`--work`, default `runs/serve`) and made again when
the preset or the export format changes.

```
python -m benchmarks.serve --preset small                # < 10 min on a quiet 2-core CPU once exported
python -m benchmarks.serve --preset runs/small --threads 1 2 --profile
python -m benchmarks.serve --quick                       # tiny preset, few rounds: a smoke run
```

Writes `serve.json` and `serve.png` (`serve_quick.*` with `--quick`) into
`--results` (default `benchmarks/results`) and prints a markdown table and
the issue's goals.
"""

if not __package__:
    raise SystemExit("Run as a module from the repository root: python -m benchmarks.serve")

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import platform
import resource
import select
import statistics
import subprocess
import sys
import time

import numpy as np

logger = logging.getLogger("benchmarks.serve")

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT_WORK = REPO / "runs" / "serve"

KERAS = "keras"
ENGINES = ("keras", "ort-float32", "ort-int8", "ct2-float32", "ct2-int8")
SEARCHES = {"greedy": 1, "beam4": 4}
LENGTH_PENALTY = 0.6
BATCH_SIZES = (1, 16)

# The goals (issue 25), on the same run (1 thread).
GOAL_ORT_SPEEDUP = 2.0  # ORT float32 and int8 over Keras/XLA, every forced-length setting, at least
GOAL_ORT_CT2_FLOAT32 = 1.0  # ORT float32 time / CTranslate2 float32 time, every setting, at most
GOAL_ORT_CT2_INT8 = 1.2  # ORT int8 time / CTranslate2 int8 time, every setting, at most
GOAL_COLD_START_SECONDS = 0.5
GOAL_RSS_MB = 150
GOAL_NATURAL_OVER_CT2 = 1.0  # natural lengths: ORT float32 and Keras sentences/s over CTranslate2's, at least
GOAL_NATURAL_SCALING = 4.0  # natural lengths: batch 64 sentences/s over batch 1's, at least

# The natural-length table (`--natural`): a trained model's own output lengths.
NATURAL_ENGINES = ("ort-float32", "keras", "ct2-float32")
NATURAL_SENTENCES = 128
NATURAL_BATCH_SIZES = (1, 16, 64)
NATURAL_BEAM_SIZE = 4
NATURAL_MAX_EXTRA_LENGTH = 50  # the paper's and the commands' default
# Beam search's `patience` per natural-length system: None is ours (the exact search: a row stops when no
# live beam can win); 1 is CTranslate2's rule with a length penalty (a row stops once K hypotheses ended),
# which CTranslate2 always runs (its default patience). Ours also run it: the same stop rule as CTranslate2.
NATURAL_PATIENCE = {"ort-float32": (None, 1), "keras": (None, 1), "ct2-float32": (None,)}

# Each timed measurement runs a system this long at least (several calls when one is short).
MIN_MEASUREMENT_SECONDS = 0.3
WORKER_TIMEOUT_SECONDS = 900
COLD_START_TIMEOUT_SECONDS = 300

# The CTranslate2 serving path, as small as it gets: ctranslate2 + sentencepiece.
CT2_SCRIPT = """\
import os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import ctranslate2, sentencepiece
d = sys.argv[1]
t = ctranslate2.Translator(d, device="cpu", intra_threads=1, inter_threads=1)
sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
p = sp.encode(sys.stdin.read().splitlines(), out_type=str)
r = t.translate_batch(p, beam_size=4, length_penalty=0.6, min_decoding_length=0,
                      max_decoding_length=max(map(len, p)) + 50)
print("\\n".join(sp.decode(x.hypotheses[0]) for x in r), flush=True)
"""

# Runs one serving command and measures it from a small process of its own:
# Linux carries a process's peak RSS across fork and exec into `ru_maxrss`,
# so a child of the benchmark (which may hold TensorFlow) would report at
# least the benchmark's own peak. Standard library only, started with -I -S.
COLD_START_SCRIPT = r"""
import json, os, select, subprocess, sys, time
command, cwd, text, timeout, log = json.loads(sys.argv[1])
with open(log, "wb") as errors:
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
    process.stdin.write(text.encode() + b"\n")
    process.stdin.close()
    output, seconds, deadline = b"", None, start + timeout
    while True:
        ready = select.select([process.stdout], [], [], max(deadline - time.perf_counter(), 0))[0]
        if not ready:
            process.kill()
            break
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        output += chunk
        if seconds is None and b"\n" in output:
            seconds = time.perf_counter() - start
    process.stdout.close()
    _, status, usage = os.wait4(process.pid, 0)
print(json.dumps({"seconds": seconds, "exit": os.waitstatus_to_exitcode(status), "peak_rss_kb": usage.ru_maxrss,
                  "output": output.split(b"\n", 1)[0].decode(errors="replace")}))
"""

# The serving paths: name of the command, and the distributions it needs (with their dependencies).
PATHS = {
    "ort": "python -m export.runtime --threads 1",
    "keras": "python -m keras_transformer.translate",
    "ct2": "CTranslate2 + SentencePiece script",
}


# ---------------------------------------------------------------------- #
# Token rows
# ---------------------------------------------------------------------- #
def id_batch(sources, end_id):
    """`[B, n + 1]` int32 source ids (pieces + end id) from rows of piece ids."""
    length = max(len(row) for row in sources) + 1
    batch = np.zeros((len(sources), length), np.int32)
    for i, row in enumerate(sources):
        batch[i, : len(row) + 1] = list(row) + [end_id]
    return batch


def generated_tokens(rows, start_id, end_id):
    """Rows `[start, tokens..., end, 0...]` (as `generate` returns) -> the tokens, per row."""
    tokens = []
    for row in np.asarray(rows).tolist():
        if row and row[0] == start_id:
            row = row[1:]
        if end_id in row:
            row = row[: row.index(end_id)]
        else:
            while row and row[-1] == 0:
                row = row[:-1]
        tokens.append(row)
    return tokens


# ---------------------------------------------------------------------- #
# The systems, as run inside a worker process
# ---------------------------------------------------------------------- #
class _ModelSystem:
    """A system whose model has `generate` with `TransformerModel.generate`'s arguments."""

    patience = None  # beam search's (`_translate_pass` sets it)

    def generate(self, sources, beam_size):
        model = self.model
        rows = model.generate(
            id_batch(sources, model.end_id), beam_size=beam_size, length_penalty=LENGTH_PENALTY,
            max_extra_length=self.max_extra_length, patience=self.patience,
        )
        return generated_tokens(rows, model.start_id, model.end_id)


class KerasSystem(_ModelSystem):
    """`TransformerModel.generate` on TensorFlow (XLA), `threads` intra-op threads, 1 inter-op."""

    def __init__(self, directory, threads, max_extra_length):
        os.environ["KERAS_BACKEND"] = "tensorflow"
        import tensorflow as tf

        # Before the first op: the thread pools are made once per process.
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from keras_transformer.model import TransformerModel

        self.model = TransformerModel.from_preset(directory, dropout=0.0)
        self.max_extra_length = max_extra_length


class OrtSystem(_ModelSystem):
    """`OnnxSeq2Seq.generate` on the CPU execution provider."""

    def __init__(self, directory, threads, max_extra_length):
        from export.runtime import CPU, OnnxSeq2Seq

        self.model = OnnxSeq2Seq(directory, providers=[CPU], intra_op_threads=threads)
        self.max_extra_length = max_extra_length


class Ct2System:
    """CTranslate2 `translate_batch` on pieces (the end piece appended by CTranslate2)."""

    def __init__(self, directory, threads, max_extra_length):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import ctranslate2

        from export.ctranslate2 import VOCABULARY_FILE, max_decoding_length, read_metadata, translation_options

        metadata = read_metadata(directory)
        self.tokens = json.loads((pathlib.Path(directory) / VOCABULARY_FILE).read_text(encoding="utf-8"))
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.max_sequence_length = int(metadata["max_sequence_length"])
        self.max_decoding_length = max_decoding_length
        self.translation_options = translation_options
        self.max_extra_length = max_extra_length
        self.translator = ctranslate2.Translator(
            str(directory), device="cpu", intra_threads=threads, inter_threads=1
        )

    def generate(self, sources, beam_size):
        pieces = [[self.tokens[i] for i in row] for row in sources]
        limit = self.max_decoding_length(
            max(len(row) for row in sources), self.max_sequence_length, self.max_extra_length
        )
        results = self.translator.translate_batch(
            pieces, max_decoding_length=limit, **self.translation_options(beam_size, LENGTH_PENALTY)
        )
        return [[self.index[token] for token in result.hypotheses[0]] for result in results]


SYSTEMS = {"keras": KerasSystem, "ort": OrtSystem, "ct2": Ct2System}


def peak_rss_mb():
    """This process's peak resident memory since it started (exec), in MB.

    `VmHWM` (Linux) belongs to the process image, so unlike `ru_maxrss` it
    does not include the parent's peak inherited across fork and exec.
    """
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _time_calls(system, sources, beam_size, calls):
    """Runs `calls` generations; returns (seconds per call, CPU seconds in all, tokens of the last)."""
    times, cpu = [], _cpu_seconds()
    for _ in range(calls):
        start = time.perf_counter()
        tokens = system.generate(sources, beam_size)
        times.append(time.perf_counter() - start)
    return times, _cpu_seconds() - cpu, tokens


def _translate_pass(system, batches, beam_size, max_extra_length, patience=None):
    """Translates `batches` (lists of rows of piece ids, any lengths) one after another.

    `patience`: beam search's, for our systems (None: the exact search);
    CTranslate2 runs its own rule. Returns the seconds and CPU seconds of
    the whole pass and the tokens of every row, in order.
    """
    saved, system.max_extra_length = system.max_extra_length, max_extra_length
    if patience is not None:
        system.patience = patience
    try:
        tokens, cpu = [], _cpu_seconds()
        start = time.perf_counter()
        for batch in batches:
            tokens += system.generate(batch, beam_size)
        seconds = time.perf_counter() - start
    finally:
        system.max_extra_length = saved
        if patience is not None:
            del system.patience
    return {"seconds": seconds, "cpu_seconds": _cpu_seconds() - cpu, "tokens": tokens}


def profile_search(directory, sources_by_batch, beam_size, max_extra_length, threads, prefix, calls=2):
    """ONNX Runtime's profile of the server's search (`OnnxSeq2Seq.generate`, the step driver), per batch size.

    Every session of the search (the start graph, the fused decoder step,
    the update graph) profiles its nodes; the report gives the time per
    graph (`graphs_us`, ONNX Runtime's `model_run`), the rest of the wall
    time (`python_us`: the driver's loop, feeds and copies) and the summed
    node time per `graph/op type`, top first.
    """
    import onnxruntime as ort

    from export.runtime import CPU, OnnxSeq2Seq

    report = {}
    for batch, sources in sources_by_batch.items():
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = f"{prefix}_b{batch}"
        model = OnnxSeq2Seq(directory, providers=[CPU], session_options=options)
        ids = id_batch(sources, _end_id(directory))
        start = time.perf_counter()
        for _ in range(calls):
            model.generate(ids, beam_size=beam_size, length_penalty=LENGTH_PENALTY, max_extra_length=max_extra_length)
        wall = (time.perf_counter() - start) / calls
        by_op, count, graphs_us, traces = {}, {}, {}, []
        for graph, session in model._sessions.items():
            trace = pathlib.Path(session.end_profiling())
            traces.append(str(trace))
            for event in json.loads(trace.read_text()):
                if event.get("cat") == "Session" and event.get("name") == "model_run":
                    graphs_us[graph] = graphs_us.get(graph, 0) + event.get("dur", 0)
                if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
                    continue
                op = f"{graph}/{event.get('args', {}).get('op_name', '?')}"
                by_op[op] = by_op.get(op, 0) + event["dur"]
                count[op] = count.get(op, 0) + 1
        total = sum(by_op.values()) or 1
        report[str(batch)] = {
            "calls": calls,
            "seconds_per_call": wall,
            "graphs_us": graphs_us,
            "python_us": max(wall * calls * 1e6 - sum(graphs_us.values()), 0),
            "node_us": total,
            "ops": [
                {"op": op, "us": us, "share": us / total, "nodes_run": count[op]}
                for op, us in sorted(by_op.items(), key=lambda item: -item[1])
            ],
            "traces": traces,
        }
    return report


def _end_id(directory):
    from export.runtime import read_config

    return int(read_config(directory)["end_id"])


def worker_main(system, directory, threads, max_extra_length):
    """Serves JSON requests on stdin, one per line; answers on the original stdout.

    Requests: `{"op": "run", "sources": [[ids]], "beam_size": K, "calls": n}`
    (answer: `seconds`, `cpu_seconds`, `tokens` of the last call),
    `{"op": "profile", ...}` (ONNX Runtime only), `{"op": "stop"}`.
    Everything else the process writes goes to stderr.
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(message):
        answers.write(json.dumps(message) + "\n")

    start = time.perf_counter()
    try:
        runner = SYSTEMS[system](directory, threads, max_extra_length)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which goes on without this system
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    answer({"ready": True, "load_seconds": time.perf_counter() - start})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "stop":
                break
            if request["op"] == "run":
                times, cpu, tokens = _time_calls(runner, request["sources"], request["beam_size"], request["calls"])
                answer({"seconds": times, "cpu_seconds": cpu, "tokens": tokens})
            elif request["op"] == "pass":
                answer(_translate_pass(runner, request["batches"], request["beam_size"], request["max_extra_length"],
                                       request.get("patience")))
            elif request["op"] == "profile":
                sources = {int(batch): rows for batch, rows in request["sources_by_batch"].items()}
                answer({"profile": profile_search(
                    directory, sources, request["beam_size"], max_extra_length, threads, request["prefix"]
                )})
            else:
                answer({"error": f"unknown op {request['op']!r}"})
        except Exception as error:  # noqa: BLE001 - reported to the parent
            logger.exception("request failed")
            answer({"error": f"{type(error).__name__}: {error}"})
    answer({"peak_rss_mb": peak_rss_mb()})
    return 0


# ---------------------------------------------------------------------- #
# The parent's side of a worker
# ---------------------------------------------------------------------- #
class Worker:
    """A system in its own process (`python -m benchmarks.serve --worker ...`)."""

    def __init__(self, name, engine, directory, threads, max_extra_length, log_path):
        self.name, self.system_name, self.threads = name, engine, threads
        system = engine.split("-")[0]
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.serve", "--worker", system, "--model", str(directory),
             "--threads", str(threads), "--max-extra-length", str(max_extra_length)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        self.peak_rss_mb = None
        self.ready = self._read()
        self.load_seconds = self.ready.get("load_seconds")

    def _read(self, timeout=WORKER_TIMEOUT_SECONDS):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"{self.name}: worker gave no answer ({'timeout' if not ready else 'exited'}); "
                               f"last lines of {self.log_path}:\n{self.log_tail()}")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.name}: {message['error']}")
        return message

    def request(self, **request):
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError as error:  # the worker has exited
            raise RuntimeError(f"{self.name}: worker is gone ({error}); last lines of {self.log_path}:\n"
                               f"{self.log_tail()}") from None
        return self._read()

    def log_tail(self, lines=15):
        try:
            return "\n".join(pathlib.Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self):
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.process.stdin.flush()
                line = self.process.stdout.readline()
                if line:
                    self.peak_rss_mb = json.loads(line).get("peak_rss_mb")
                self.process.wait(timeout=60)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()


# ---------------------------------------------------------------------- #
# Preparation: preset, exports, sources
# ---------------------------------------------------------------------- #
def _fingerprint(preset_dir):
    """Changes when the preset's config or weights change, or the code that exports them does.

    The exporters' code is part of it (`export/` and `keras_transformer/`,
    every Python file's bytes): an export cached before a change of the
    graphs or the search would otherwise be measured as if it were today's.
    """
    preset_dir = pathlib.Path(preset_dir)
    digest = hashlib.sha256((preset_dir / "config.json").read_bytes())
    weights = preset_dir / "model.weights.h5"
    stat = weights.stat()
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    root = pathlib.Path(__file__).resolve().parent.parent
    for package in ("export", "keras_transformer"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def prepare_preset(preset, work, seed):
    """A preset directory with a tokenizer: `preset` itself, or a built-in one saved under `work`."""
    if os.path.isdir(preset):
        return pathlib.Path(preset)
    from keras_transformer.presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is neither a directory nor a built-in preset ({', '.join(PRESETS)})")
    directory = pathlib.Path(work) / f"{preset}-random-seed{seed}" / "preset"
    if (directory / "model.weights.h5").is_file():
        return directory
    import keras

    from keras_transformer import datasets
    from keras_transformer.model import TransformerModel
    from keras_transformer.tokenizers.sentencepiece import train_tokenizer

    logger.info("Building %s with random weights (seed %d) and a tokenizer on the bundled corpus", preset, seed)
    keras.utils.set_random_seed(seed)
    model = TransformerModel.from_preset(preset, dropout=0.0)
    tokenizer = train_tokenizer(list(datasets.bundled_paths("train")), vocabulary_size=model.vocabulary_size)
    model.save_to_preset(directory, tokenizer=tokenizer, metadata={"weights": f"random, seed {seed}"})
    return directory


def ct2_unavailable():
    """Why CTranslate2 cannot be benchmarked here, or None."""
    if importlib.util.find_spec("ctranslate2") is None:
        return "ctranslate2 is not installed (pip install ctranslate2)"
    if importlib.util.find_spec("export.ctranslate2") is None:
        return "export/ctranslate2.py is not in this checkout (the CTranslate2 export is on another branch)"
    return None


def _export_is_current(engine, directory, stamp):
    if not directory.is_dir() or not stamp.is_file():
        return False
    try:
        if engine.startswith("ort"):
            from export.runtime import read_config

            read_config(directory)
        else:
            from export.ctranslate2 import read_metadata

            read_metadata(directory)
    except (FileNotFoundError, ValueError) as error:
        logger.info("Exporting %s again: %s", directory, error)
        return False
    return True


def prepare_exports(preset_dir, work, engines):
    """Exports (or reuses) the ONNX and CTranslate2 directories; returns `({engine: dir}, {engine: why not})`."""
    fingerprint = _fingerprint(preset_dir)
    root = pathlib.Path(work) / f"exports-{fingerprint}"
    root.mkdir(parents=True, exist_ok=True)
    directories, skipped, model = {KERAS: pathlib.Path(preset_dir)}, {}, None
    for engine in engines:
        if engine == KERAS:
            continue
        if engine.startswith("ct2") and ct2_unavailable():
            skipped[engine] = ct2_unavailable()
            continue
        directory, stamp = root / engine, root / f"{engine}.source"
        if not _export_is_current(engine, directory, stamp):
            if model is None:
                os.environ.setdefault("KERAS_BACKEND", "tensorflow")
                from keras_transformer.model import TransformerModel

                model = TransformerModel.from_preset(preset_dir, dropout=0.0)
            quantization = None if engine.endswith("float32") else "int8"
            logger.info("Exporting %s to %s (cached for later runs)", engine, directory)
            start = time.perf_counter()
            try:
                if engine.startswith("ort"):
                    from export.onnx import export_onnx

                    # int8 from the float32 export when it is here (one tf2onnx conversion, not two).
                    float32 = directories.get("ort-float32") if quantization else None
                    export_onnx(model, directory, quantize=quantization, overwrite=True, float32_export=float32)
                else:
                    from export.ctranslate2 import export_ctranslate2

                    export_ctranslate2(model, directory, quantization=quantization, overwrite=True)
            except Exception as error:  # noqa: BLE001 - the other systems are still measured
                logger.exception("Export of %s failed", engine)
                skipped[engine] = f"export failed: {type(error).__name__}: {error}"
                continue
            stamp.write_text(f"{preset_dir}\n{fingerprint}\n")
            logger.info("Exported %s in %.0f s", engine, time.perf_counter() - start)
        directories[engine] = directory
    return directories, skipped


def benchmark_sources(preset_dir, vocabulary_size, count, length, seed):
    """`count` rows of exactly `length` piece ids (no end id), and what they are.

    Sentences of the bundled test split cut to `length` pieces when the
    preset has a tokenizer and enough of them are that long; else random ids.
    """
    from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME, Tokenizer

    if (pathlib.Path(preset_dir) / TOKENIZER_FILENAME).is_file():
        from keras_transformer.datasets import load_bundled

        tokenizer = Tokenizer.load(preset_dir)
        english, _ = load_bundled("test")
        rows = [ids[:length] for ids in tokenizer.encode(english, add_end=False) if len(ids) >= length]
        if len(rows) >= count:
            return rows[:count], f"bundled test sentences cut to {length} pieces"
    rng = np.random.default_rng(seed)
    return rng.integers(4, vocabulary_size, size=(count, length)).tolist(), f"random ids, {length} per row"


# ---------------------------------------------------------------------- #
# Measurement
# ---------------------------------------------------------------------- #
def _settings(batch_sizes):
    return [(batch, search) for batch in batch_sizes for search in SEARCHES]


def measure_throughput(workers, sources, batch_sizes, rounds):
    """Rounds over settings and systems; returns rows with medians and the tokens of each system."""
    measured = {}  # (name, batch, search) -> {"seconds": [...], "cpu": [...], "tokens": ...}
    calls = {}
    settings = _settings(batch_sizes)
    names = list(workers)
    logger.info("Warming up (compiles Keras' searches) and sizing the measurements")
    for batch, search in settings:
        for name in list(names):
            worker = workers[name]
            try:
                worker.request(op="run", sources=sources[:batch], beam_size=SEARCHES[search], calls=1)
                second = worker.request(op="run", sources=sources[:batch], beam_size=SEARCHES[search], calls=1)
            except RuntimeError as error:
                logger.error("%s", error)
                names.remove(name)
                continue
            calls[name, batch, search] = max(1, int(np.ceil(MIN_MEASUREMENT_SECONDS / second["seconds"][0])))
            measured[name, batch, search] = {"seconds": [], "cpu": [], "cpu_seconds": [], "tokens": second["tokens"]}
    for round_index in range(rounds):
        logger.info("Round %d of %d", round_index + 1, rounds)
        for batch, search in settings:
            shift = round_index % max(len(names), 1)
            for name in names[shift:] + names[:shift]:
                if (name, batch, search) not in measured:
                    continue
                worker = workers[name]
                try:
                    answer = worker.request(
                        op="run", sources=sources[:batch], beam_size=SEARCHES[search], calls=calls[name, batch, search]
                    )
                except RuntimeError as error:
                    logger.error("%s", error)
                    continue
                entry = measured[name, batch, search]
                entry["seconds"].append(statistics.mean(answer["seconds"]))
                entry["cpu"].append(answer["cpu_seconds"] / sum(answer["seconds"]))
                entry["cpu_seconds"].append(answer["cpu_seconds"] / len(answer["seconds"]))
                if answer["tokens"] != entry["tokens"]:
                    entry["nondeterministic"] = True
    return measured, calls


def summarize(measured, calls, workers):
    """Table rows: per (threads, batch, search, system) medians, rates and ratios from the same run."""
    rows = []
    for (name, batch, search), entry in measured.items():
        if not entry["seconds"]:
            continue
        worker = workers[name]
        seconds = statistics.median(entry["seconds"])
        lengths = [len(row) for row in entry["tokens"]]
        rows.append({
            "system": worker.system_name, "threads": worker.threads, "batch": batch, "search": search,
            "beam_size": SEARCHES[search],
            "seconds": seconds, "seconds_per_round": entry["seconds"], "calls_per_round": calls[name, batch, search],
            "tokens_per_row": sorted(set(lengths)), "tokens": sum(lengths), "token_counts": lengths,
            "ms_per_token": 1e3 * seconds / max(sum(lengths), 1), "sentences_per_second": batch / seconds,
            "cpu_per_wall": statistics.median(entry["cpu"]),
            "cpu_ms_per_token": 1e3 * statistics.median(entry["cpu_seconds"]) / max(sum(lengths), 1),
            "deterministic": not entry.get("nondeterministic", False),
        })
    index = {(r["threads"], r["batch"], r["search"], r["system"]): r for r in rows}
    for row in rows:
        key = (row["threads"], row["batch"], row["search"])
        keras = index.get(key + (KERAS,))
        row["speedup_vs_keras"] = keras["seconds"] / row["seconds"] if keras else None
        if row["system"].startswith("ort"):
            ct2 = index.get(key + ("ct2" + row["system"][3:],))
            row["time_over_ct2"] = row["seconds"] / ct2["seconds"] if ct2 else None
    order = {name: i for i, name in enumerate(ENGINES)}
    rows.sort(key=lambda r: (r["threads"], r["batch"], r["search"] != "greedy", order[r["system"]]))
    return rows


def agreement(measured, workers):
    """Per setting: rows of each system identical to Keras' (and tokens per row of each)."""
    result = []
    for (name, batch, search), entry in sorted(measured.items(), key=lambda item: item[0][1:]):
        worker = workers[name]
        keras_name = next((n for n, w in workers.items() if w.system_name == KERAS and w.threads == worker.threads),
                          None)
        reference = measured.get((keras_name, batch, search))
        if reference is None or worker.system_name == KERAS:
            continue
        same = sum(a == b for a, b in zip(entry["tokens"], reference["tokens"]))
        result.append({
            "system": worker.system_name, "threads": worker.threads, "batch": batch, "search": search,
            "rows_identical_to_keras": same, "rows": len(reference["tokens"]),
            "equal_lengths": [len(r) for r in entry["tokens"]] == [len(r) for r in reference["tokens"]],
        })
    return result


def natural_sources(preset_dir, count):
    """The first `count` sentences of the bundled test split as piece ids (no end id), at their own lengths."""
    from keras_transformer.datasets import load_bundled
    from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME, Tokenizer

    if not (pathlib.Path(preset_dir) / TOKENIZER_FILENAME).is_file():
        raise ValueError(f"{preset_dir} has no {TOKENIZER_FILENAME}: the natural-length table translates text")
    english, _ = load_bundled("test")
    return [list(ids) for ids in Tokenizer.load(preset_dir).encode(english[:count], add_end=False)]


def measure_natural(workers, sources, batch_sizes, beam_size, rounds, max_extra_length):
    """Every system translates all of `sources`, in consecutive batches of each size, `rounds` times.

    Each system runs once per `NATURAL_PATIENCE` entry (ours: the exact
    search and CTranslate2's stop rule). One untimed pass per batch size
    first (Keras compiles a search per length bucket). Then in each round
    each system translates the whole list once per batch size, the order of
    the systems rotating. Returns `{(worker name, patience, batch):
    {"seconds": [per round], "cpu_seconds": [...], "tokens": rows}}`.
    """
    names, measured = [(name, patience) for name, worker in workers.items()
                       for patience in NATURAL_PATIENCE.get(worker.system_name, (None,))], {}

    def translate(variant, batch):
        name, patience = variant
        batches = [sources[i: i + batch] for i in range(0, len(sources), batch)]
        return workers[name].request(op="pass", batches=batches, beam_size=beam_size,
                                     max_extra_length=max_extra_length, patience=patience)

    logger.info("Natural lengths: one untimed pass per system and batch size (Keras compiles its searches)")
    for batch in batch_sizes:
        for name in list(names):
            try:
                answer = translate(name, batch)
            except RuntimeError as error:
                logger.error("%s", error)
                names.remove(name)
                continue
            measured[(*name, batch)] = {"seconds": [], "cpu_seconds": [], "tokens": answer["tokens"],
                                        "warmup_seconds": answer["seconds"]}
    for round_index in range(rounds):
        logger.info("Natural lengths: round %d of %d", round_index + 1, rounds)
        for batch in batch_sizes:
            shift = round_index % max(len(names), 1)
            for name in names[shift:] + names[:shift]:
                if (*name, batch) not in measured:
                    continue
                try:
                    answer = translate(name, batch)
                except RuntimeError as error:
                    logger.error("%s", error)
                    continue
                entry = measured[(*name, batch)]
                entry["seconds"].append(answer["seconds"])
                entry["cpu_seconds"].append(answer["cpu_seconds"])
                if answer["tokens"] != entry["tokens"]:
                    entry["nondeterministic"] = True
    return measured


def lockstep_over_own_steps(token_counts, batch):
    """Decoder steps of a search that runs each batch until its longest row ends, over the rows' own steps.

    A row of n tokens needs n + 1 steps (the end id last); a batched search
    that keeps every row of the batch until the last one ends runs
    `rows x (longest + 1)` (Keras' search does; CTranslate2 and ONNX Runtime's
    step driver drop finished rows). 1.0 at batch 1.
    """
    own = sum(n + 1 for n in token_counts)
    lockstep = sum(
        len(token_counts[i: i + batch]) * (max(token_counts[i: i + batch]) + 1)
        for i in range(0, len(token_counts), batch)
    )
    return lockstep / max(own, 1)


def summarize_natural(measured, workers, beam_size):
    """Rows of the natural-length table, and each system's largest-batch / batch-1 throughput ratio.

    Returns `(rows, scaling)`: per (system, batch) the median seconds for
    all the sentences, sentences/s, tokens, CPU / wall and the rows with
    tokens identical to Keras' at the same batch size and patience (and,
    with a patience, to the same system's exact search); `scaling[system]`
    is sentences/s at the largest batch over sentences/s at the smallest.
    A system run with a patience is named `<system> patience=<p>`.
    """
    rows = []
    for (name, patience, batch), entry in measured.items():
        if not entry["seconds"]:
            continue
        seconds = statistics.median(entry["seconds"])
        lengths = [len(tokens) for tokens in entry["tokens"]]
        system = workers[name].system_name + (f" patience={patience:g}" if patience is not None else "")
        rows.append({
            "system": system, "engine": workers[name].system_name, "patience": patience,
            "threads": workers[name].threads, "batch": batch,
            "beam_size": beam_size, "seconds": seconds, "seconds_per_round": entry["seconds"],
            "sentences": len(lengths), "sentences_per_second": len(lengths) / seconds, "tokens": sum(lengths),
            "token_counts": lengths, "mean_tokens": sum(lengths) / max(len(lengths), 1),
            "ms_per_token": 1e3 * seconds / max(sum(lengths), 1),
            "lockstep_over_own_steps": lockstep_over_own_steps(lengths, batch),
            "cpu_per_wall": statistics.median(c / s for c, s in zip(entry["cpu_seconds"], entry["seconds"])),
            "deterministic": not entry.get("nondeterministic", False),
            "_tokens": entry["tokens"],
        })
    keras = {(r["batch"], r["patience"]): r["_tokens"] for r in rows if r["engine"] == KERAS}
    exact = {(r["engine"], r["batch"]): r["_tokens"] for r in rows if r["patience"] is None}
    for row in rows:
        # CTranslate2 runs its own rule: compared with Keras' exact search.
        reference = keras.get((row["batch"], row["patience"]))
        row["rows_identical_to_keras"] = (
            sum(a == b for a, b in zip(row["_tokens"], reference)) if reference is not None else None
        )
        if row["patience"] is not None and (row["engine"], row["batch"]) in exact:
            row["rows_identical_to_exact_search"] = sum(
                a == b for a, b in zip(row["_tokens"], exact[row["engine"], row["batch"]])
            )
    for row in rows:
        del row["_tokens"]
    scaling = {}
    for system in {r["system"] for r in rows}:
        own = sorted((r for r in rows if r["system"] == system), key=lambda r: r["batch"])
        if len(own) > 1:
            scaling[system] = {"batches": [own[0]["batch"], own[-1]["batch"]],
                               "ratio": own[-1]["sentences_per_second"] / own[0]["sentences_per_second"]}
    order = {name: i for i, name in enumerate(NATURAL_ENGINES)}
    rows.sort(key=lambda r: (r["batch"], r["patience"] is not None, order.get(r["engine"], len(order))))
    return rows, scaling


def add_scaling_ceilings(natural):
    """Adds to each system's `scaling` its `ceiling`: the ratio if the largest batch ran at the roofline.

    The smallest batch's measured seconds over the largest batch's
    `roofline_seconds` (its decoder products alone at the GEMM rate of
    that many rows, `add_roofline`): the largest batch cannot beat its
    roofline, so its ratio over the smallest batch stays below this unless
    the engine outruns NumPy's products. Left out where a row has no roofline.
    """
    for system, scaling in natural["scaling"].items():
        small, large = (next((r for r in natural["rows"] if r["system"] == system and r["batch"] == batch), None)
                        for batch in scaling["batches"])
        if small and large and large.get("roofline_seconds"):
            scaling["ceiling"] = small["seconds"] / large["roofline_seconds"]


def cold_start(command, env, text, log, timeout=COLD_START_TIMEOUT_SECONDS):
    """Seconds from process start to its first line on stdout, that line, and the process's peak RSS (MB).

    Measured by `COLD_START_SCRIPT` in a process of its own (see there);
    the command's stderr goes to `log`.
    """
    arguments = json.dumps([command, str(REPO), text, timeout, str(log)])
    launcher = subprocess.run(
        [sys.executable, "-I", "-S", "-c", COLD_START_SCRIPT, arguments],
        env=env, capture_output=True, text=True, timeout=timeout + 60,
    )
    try:
        result = json.loads(launcher.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"the cold-start launcher failed: {launcher.stderr[-2000:]}") from None
    if result["seconds"] is None or result["exit"] != 0:
        tail = pathlib.Path(log).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{command[:4]} failed (exit {result['exit']}); its stderr ends:\n{tail}")
    return {"seconds": result["seconds"], "peak_rss_mb": result["peak_rss_kb"] / 1024, "output": result["output"]}


def cold_starts(directories, text, repeats, warm_page_cache, work):
    """The serving commands, interleaved; medians of `repeats` runs each (keyed as `PATHS`)."""
    python = sys.executable
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", OMP_WAIT_POLICY="PASSIVE")
    # export.runtime's optimised-graph cache (filled by the first, untimed run), here rather than in ~/.cache.
    env["KERAS_TRANSFORMER_CACHE"] = str(work / "cache")
    # Bytecode as an installed package has it (pip compiles at install; the first, untimed run writes it
    # here): otherwise every start compiles the repository's modules again, which the installed
    # CTranslate2 never does.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    commands = {}
    if "ort-float32" in directories:
        commands["ort"] = [
            python, "-m", "export.runtime", "--model", str(directories["ort-float32"]), "--threads", "1"]
    commands["keras"] = [
        python, "-m", "keras_transformer.translate", "--preset", str(directories[KERAS]), "--no-progress"]
    if "ct2-float32" in directories:
        commands["ct2"] = [python, "-c", CT2_SCRIPT, str(directories["ct2-float32"])]
    runs = {name: [] for name in commands}
    failed = {}
    for repeat in range(repeats + int(warm_page_cache)):
        for name, command in commands.items():
            if name in failed:
                continue
            logger.info("Cold start %d: %s", repeat + 1, PATHS[name])
            try:
                result = cold_start(command, env, text, work / f"cold-start-{name}.log")
            except RuntimeError as error:
                logger.error("%s", error)
                failed[name] = str(error)
                continue
            if repeat >= int(warm_page_cache):
                runs[name].append(result)
    results = []
    for name, command in commands.items():
        if not runs[name]:
            results.append({"path": name, "command": PATHS[name], "error": failed.get(name, "no run")})
            continue
        results.append({
            "path": name,
            "command": PATHS[name],
            "argv": [os.path.relpath(part, REPO) if os.path.isabs(part) and part != python else part
                     for part in command if part != CT2_SCRIPT],
            "seconds": statistics.median(r["seconds"] for r in runs[name]),
            "seconds_all": [r["seconds"] for r in runs[name]],
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs[name]),
            "output": runs[name][-1]["output"],
        })
    return results


def installed_size(requirements):
    """MB on disk of the named distributions and their dependencies (from their RECORD files)."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo, total, missing = {}, list(requirements), 0, []
    while todo:
        name = canonicalize_name(Requirement(todo.pop()).name)
        if name in seen or name in missing:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        size = 0
        for file in distribution.files or ():
            try:
                size += file.locate().stat().st_size
            except OSError:
                pass
        seen[name] = size
        total += size
        for requirement in distribution.requires or ():
            parsed = Requirement(requirement)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(requirement)
    return {"mb": total / 2**20, "distributions": sorted(seen), "not_installed": sorted(missing)}


def installed_sizes():
    """Installed size of each serving path (the distributions its command imports, with dependencies)."""
    import importlib.metadata as metadata

    try:
        metadata.distribution("onnxruntime")
        ort = "onnxruntime"
    except metadata.PackageNotFoundError:
        ort = "onnxruntime-gpu"
    try:
        keras_path = [r for r in metadata.distribution("keras-aiayn").requires or () if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        keras_path = ["tensorflow", "keras", "keras-hub", "tensorflow-text", "sentencepiece", "h5py", "tqdm"]
    return {
        "ort": dict(installed_size([ort, "numpy", "sentencepiece", "tqdm"]), onnxruntime=ort),
        "keras": installed_size(keras_path),
        "ct2": installed_size(["ctranslate2", "sentencepiece"]),
    }


# ---------------------------------------------------------------------- #
# The decoder step's matrix products: the roofline column
# ---------------------------------------------------------------------- #
def model_sizes(config):
    """The sizes the decoder step's products depend on, from a preset's `config`.

    Returns a dict: `layers` (decoder layers L), `hidden` (D), `intermediate`
    (F), `heads` (N), `key` and `value` (per-head d_k, d_v), `vocabulary` (V).
    """
    heads, hidden = int(config["num_heads"]), int(config["hidden_dim"])
    return {
        "layers": int(config.get("num_decoder_layers") or config["num_layers"]),
        "hidden": hidden,
        "intermediate": int(config["intermediate_dim"]),
        "heads": heads,
        "key": int(config.get("key_dim") or hidden // heads),
        "value": int(config.get("value_dim") or hidden // heads),
        "vocabulary": int(config["vocabulary_size"]),
    }


def step_products(sizes):
    """The weight products of one decoder step for one hypothesis: `(k, n)` per `[1, k] x [k, n]`.

    Per decoder layer: the self-attention query, key, value and output
    projections, the cross-attention query and output projections (its keys
    and values are computed once per source, by `init_cache`, not by the
    step), the feed-forward network's two layers; then the output layer
    (the shared embedding, `[D, V]`).
    """
    d, f, hk, hv = sizes["hidden"], sizes["intermediate"], sizes["heads"] * sizes["key"], sizes["heads"] * sizes["value"]
    layer = [(d, hk), (d, hk), (d, hv), (hv, d), (d, hk), (hv, d), (d, f), (f, d)]
    return layer * sizes["layers"] + [(d, sizes["vocabulary"])]


def step_flops(sizes, position, source_length):
    """Floating-point operations (2 per multiply-add) of one decoder step for one hypothesis.

    The products of `step_products`, and per layer the attention products
    `q K^T` and `weights V` over the `position` target positions decoded so
    far (this one included) and over the `source_length` source positions.
    """
    weights = sum(2 * k * n for k, n in step_products(sizes))
    per_position = 2 * sizes["heads"] * (sizes["key"] + sizes["value"])
    return weights + sizes["layers"] * per_position * (position + source_length)


def decoded_flops(sizes, rows, beam_size):
    """FLOPs of the decoder steps that produced `rows`: `(source ids, tokens)` per sentence.

    A sentence of n tokens took n + 1 steps (the last one emits the end id),
    each run for `beam_size` hypotheses; step t (1-based) attends to t
    target positions. Only the work of each sentence's own steps is
    counted: none for rows a batched search keeps running after they
    finished, nor for padding.
    """
    weights = step_flops(sizes, 0, 0)
    per_position = sizes["layers"] * 2 * sizes["heads"] * (sizes["key"] + sizes["value"])
    total = 0
    for source_length, tokens in rows:
        steps = tokens + 1
        total += beam_size * (steps * weights + per_position * (steps * (steps + 1) // 2 + steps * source_length))
    return total


def gemm_rates(sizes, row_counts, min_seconds=0.2):
    """This process's float32 rate (FLOP/s) on one decoder step's weight products, per row count.

    For m rows (batch x beam), NumPy multiplies `[m, k] x [k, n]` for each
    `(k, n)` of `step_products`, over and over for at least `min_seconds`;
    the rate is their FLOPs over the time. Run it with one BLAS thread
    (`measure_gemm_rates`) to compare with one-thread engines.
    """
    rng = np.random.default_rng(0)
    products = step_products(sizes)
    weights = {shape: rng.standard_normal(shape, dtype=np.float32) for shape in set(products)}
    rates = {}
    for m in sorted(set(row_counts)):
        inputs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in {k for k, _ in products}}
        flops = sum(2 * m * k * n for k, n in products)
        for k, n in products:  # warm-up: first touches, BLAS's buffers
            inputs[k] @ weights[k, n]
        repeats, start = 0, time.perf_counter()
        while True:
            for k, n in products:
                inputs[k] @ weights[k, n]
            repeats += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        rates[m] = flops * repeats / elapsed
    return rates


SINGLE_THREAD_ENV = {name: "1" for name in (
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
)}


def measure_gemm_rates(sizes, row_counts, min_seconds=0.5):
    """`gemm_rates` in a fresh process with one BLAS thread: `{rows: FLOP/s}`."""
    request = json.dumps({"sizes": sizes, "row_counts": sorted(set(row_counts)), "min_seconds": min_seconds})
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve", "--gemm-rates", request], cwd=REPO,
        env=dict(os.environ, **SINGLE_THREAD_ENV), capture_output=True, text=True, timeout=WORKER_TIMEOUT_SECONDS,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the GEMM rate measurement failed: {result.stderr[-2000:]}")
    return {int(m): rate for m, rate in json.loads(result.stdout).items()}


def add_roofline(row, decoded, sizes, rates):
    """Adds the roofline fields to a table row (in place) and returns it.

    Args:
        row: a table row with `seconds` (the time measured for `decoded`),
            `batch` and `beam_size`.
        decoded: `(source ids, tokens)` of each sentence translated in that time.
        sizes: `model_sizes`.
        rates: `{rows: FLOP/s}` from `measure_gemm_rates`, for `batch x beam_size` rows.

    Adds `decoder_gflop` (`decoded_flops`), `gemm_gflops` (the rate used),
    `roofline_seconds` (the time the decoder steps' products alone would
    take at that rate) and `x_roofline` (the row's time over it).
    """
    rate = rates.get(row["batch"] * row["beam_size"])
    if not rate:
        return row
    flops = decoded_flops(sizes, decoded, row["beam_size"])
    row.update(decoder_gflop=flops / 1e9, gemm_gflops=rate / 1e9, roofline_seconds=flops / rate)
    row["x_roofline"] = row["seconds"] / row["roofline_seconds"]
    return row


# ---------------------------------------------------------------------- #
# Report
# ---------------------------------------------------------------------- #
def goals(rows, cold, natural=None):
    """The issue's goals (issue 25), checked on the 1-thread rows of this run; each names its worst setting."""
    index = {(r["batch"], r["search"], r["system"]): r for r in rows if r["threads"] == 1}
    checks = []

    def add(name, value, target, met, where):
        checks.append({"goal": name, "value": value, "target": target, "met": met, "where": where})

    def worst(values, at_least):
        return (min if at_least else max)(values) if values else None

    for system in ("ort-float32", "ort-int8"):
        speedups = [(r["speedup_vs_keras"], f"B={r['batch']} {r['search']}") for r in index.values()
                    if r["system"] == system and r.get("speedup_vs_keras")]
        value = worst(speedups, at_least=True)
        if value:
            add(f"{system} vs Keras/XLA (worst setting)", value[0], f">= {GOAL_ORT_SPEEDUP}x",
                value[0] >= GOAL_ORT_SPEEDUP, value[1])
    for system, limit in (("ort-float32", GOAL_ORT_CT2_FLOAT32), ("ort-int8", GOAL_ORT_CT2_INT8)):
        ratios = [(r["time_over_ct2"], f"B={r['batch']} {r['search']}") for r in index.values()
                  if r["system"] == system and r.get("time_over_ct2")]
        value = worst(ratios, at_least=False)
        if value:
            add(f"{system} time / ct2-{system[4:]} time (worst setting)", value[0], f"<= {limit}x",
                value[0] <= limit, value[1])
    for entry in cold:
        if entry["path"] == "ort" and "seconds" in entry:
            add("export.runtime cold start, one sentence", entry["seconds"], f"<= {GOAL_COLD_START_SECONDS} s",
                entry["seconds"] <= GOAL_COLD_START_SECONDS, "process start to first line")
            add("export.runtime peak resident memory", entry["peak_rss_mb"], f"<= {GOAL_RSS_MB} MB",
                entry["peak_rss_mb"] <= GOAL_RSS_MB, "one sentence")
    if natural:
        by = {(r["system"], r["batch"]): r for r in natural["rows"]}
        # Ours with their exact search, and with CTranslate2's stop rule (patience 1, as CTranslate2 runs).
        for system in ("ort-float32", KERAS, "ort-float32 patience=1", f"{KERAS} patience=1"):
            ratios = [(by[system, batch]["sentences_per_second"] / by["ct2-float32", batch]["sentences_per_second"],
                       f"natural B={batch}") for (name, batch) in by if name == system and ("ct2-float32", batch) in by]
            value = worst(ratios, at_least=True)
            if value:
                add(f"{system} sentences/s over ct2-float32's, natural lengths (worst batch)", value[0],
                    f">= {GOAL_NATURAL_OVER_CT2}x", value[0] >= GOAL_NATURAL_OVER_CT2, value[1])
            scaling = natural["scaling"].get(system)
            if scaling:
                ceiling = (f"; at most {scaling['ceiling']:.2f}x at the roofline (batch {scaling['batches'][0]}'s "
                           f"time / batch {scaling['batches'][1]}'s products at the GEMM rate)"
                           if scaling.get("ceiling") else "")
                add(f"{system} batch {scaling['batches'][1]} over batch {scaling['batches'][0]} sentences/s, natural",
                    scaling["ratio"], f">= {GOAL_NATURAL_SCALING}x", scaling["ratio"] >= GOAL_NATURAL_SCALING,
                    "natural lengths" + ceiling)
    return checks


def _roofline_cell(row):
    return f"{row['x_roofline']:.1f}x" if row.get("x_roofline") else "-"


def markdown(results):
    lines = []
    if results["throughput"]:
        lines += [
            "| threads | batch | search | system | tokens/row | ms/token | sentences/s | vs Keras | ORT / CT2 time "
            "| CPU ms/token | x roofline |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for r in results["throughput"]:
        tokens = "/".join(str(t) for t in r["tokens_per_row"])
        speedup = f"{r['speedup_vs_keras']:.2f}x" if r["speedup_vs_keras"] else "-"
        ratio = f"{r['time_over_ct2']:.2f}x" if r.get("time_over_ct2") else ""
        lines.append(
            f"| {r['threads']} | {r['batch']} | {r['search']} | {r['system']} | {tokens} | {r['ms_per_token']:.3f} "
            f"| {r['sentences_per_second']:.1f} | {speedup} | {ratio} | {r['cpu_ms_per_token']:.3f} "
            f"| {_roofline_cell(r)} |"
        )
    natural = results.get("natural")
    if natural:
        settings = natural["settings"]
        lines += [""] * bool(lines) + [
            f"Natural lengths: {settings['sentences']} test sentences, beam {settings['beam_size']}, 1 thread, "
            f"weights: {natural['weights']}",
            "",
            "| batch | system | sentences/s | tokens/sentence | ms/token | CPU/wall | same as Keras | lockstep / own steps "
            "| x roofline | largest / batch-1 sentences/s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        largest = max(settings["batch_sizes"])
        for r in natural["rows"]:
            same = f"{r['rows_identical_to_keras']}/{r['sentences']}" if r["rows_identical_to_keras"] is not None else "-"
            scaling = natural["scaling"].get(r["system"])
            ratio = f"{scaling['ratio']:.2f}x" if scaling and r["batch"] == largest else ""
            if ratio and scaling.get("ceiling"):
                ratio += f" (roofline: {scaling['ceiling']:.2f}x)"
            lines.append(
                f"| {r['batch']} | {r['system']} | {r['sentences_per_second']:.2f} | {r['mean_tokens']:.1f} "
                f"| {r['ms_per_token']:.3f} | {r['cpu_per_wall']:.2f} | {same} | {r['lockstep_over_own_steps']:.2f} "
                f"| {_roofline_cell(r)} | {ratio} |"
            )
    if results["cold_start"]:
        lines += ["", "| serving path | cold start (s) | peak RSS (MB) | installed (MB) |", "|---|---:|---:|---:|"]
        for entry in results["cold_start"]:
            size = results["installed"].get(entry["path"], {}).get("mb")
            size = f"{size:,.0f}" if size is not None else "-"
            if "seconds" in entry:
                lines.append(f"| `{entry['command']}` | {entry['seconds']:.2f} | {entry['peak_rss_mb']:.0f} | {size} |")
            else:
                lines.append(f"| `{entry['command']}` | failed | | {size} |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["throughput"]
    threads = sorted({r["threads"] for r in rows})
    systems = [s for s in ENGINES if any(r["system"] == s for r in rows)]
    figure, axes = plt.subplots(1, len(threads), figsize=(7 * len(threads), 4.2), squeeze=False)
    for axis, count in zip(axes[0], threads):
        settings = sorted({(r["batch"], r["search"]) for r in rows if r["threads"] == count},
                          key=lambda s: (s[0], s[1] != "greedy"))
        x = np.arange(len(settings))
        width = 0.8 / max(len(systems), 1)
        for i, system in enumerate(systems):
            values = [next((r["ms_per_token"] for r in rows if (r["threads"], r["batch"], r["search"], r["system"])
                            == (count, b, s, system)), np.nan) for b, s in settings]
            axis.bar(x + (i - (len(systems) - 1) / 2) * width, values, width, label=system)
        axis.set_xticks(x, [f"B={b}\n{s}" for b, s in settings])
        axis.set_yscale("log")
        axis.set_ylabel("ms per generated token (lower is better)")
        axis.set_title(f"{results['preset_name']}, {count} thread{'s' if count > 1 else ''}"
                       f"{' (busy machine)' if results['environment']['busy'] else ''}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _versions():
    import importlib.metadata as metadata

    versions = {"python": platform.python_version()}
    for name in ("keras", "tensorflow", "onnxruntime", "onnxruntime-gpu", "ctranslate2", "sentencepiece", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def profile_in_worker(directories, sources, batch_sizes, max_extra_length, work):
    """`profile_search` in a fresh ONNX Runtime worker (the profiler's events would inflate a measured one's memory)."""
    if "ort-float32" not in directories:
        logger.warning("--profile needs the ort-float32 export")
        return None
    logger.info("Profiling the step driver")
    worker = Worker("ort-float32-profile", "ort-float32", directories["ort-float32"], 1, max_extra_length,
                    work / "worker-ort-float32-profile.log")
    try:
        return worker.request(
            op="profile", beam_size=4, prefix=str(work / "ort_profile"),
            sources_by_batch={str(b): sources[:b] for b in batch_sizes},
        )["profile"]
    except RuntimeError as error:
        logger.error("%s", error)
        return None
    finally:
        worker.close()


def start_workers(args, engines, directories, skipped, work):
    """`{"engine@threads": Worker}` of the run; an engine that fails to start goes into `skipped`."""
    workers = {}
    for threads in [1] if args.natural_only else args.threads:
        for engine in engines:
            if engine not in directories or (args.natural_only and engine not in NATURAL_ENGINES):
                continue
            name = f"{engine}@{threads}"
            logger.info("Starting %s", name)
            try:
                workers[name] = Worker(
                    name, engine, directories[engine], threads, args.max_extra_length, work / f"worker-{name}.log"
                )
            except RuntimeError as error:
                logger.error("%s", error)
                skipped[name] = str(error)
    return workers


def natural_section(args, preset_dir, natural_measured, natural_rows, workers):
    """The results' `natural` entry: the natural-length table, its scaling and settings."""
    natural_table, scaling = summarize_natural(natural_measured, workers, NATURAL_BEAM_SIZE)
    return {
        "weights": _weights_label(args.preset, preset_dir),
        "settings": {
            "sentences": len(natural_rows), "source": "bundled test split, first sentences, in order",
            "source_ids_per_sentence": [len(row) + 1 for row in natural_rows],
            "beam_size": NATURAL_BEAM_SIZE, "length_penalty": LENGTH_PENALTY,
            "max_extra_length": NATURAL_MAX_EXTRA_LENGTH, "batch_sizes": list(args.natural_batch_sizes),
            "rounds": args.natural_rounds, "threads": 1,
        },
        "rows": natural_table, "scaling": scaling,
    }


def add_rooflines(rows, natural, source_length, sizes):
    """Adds each row's roofline (one BLAS thread's rate on the decoder step's products, same run); returns the rates."""
    row_counts = [r["batch"] * r["beam_size"] for r in rows + (natural["rows"] if natural else [])]
    rates = {}
    if row_counts:
        logger.info("Measuring NumPy's one-thread float32 rate on the decoder step's products")
        try:
            rates = measure_gemm_rates(sizes, row_counts)
        except RuntimeError as error:
            logger.error("%s", error)
    for row in rows:
        add_roofline(row, [(source_length + 1, n) for n in row["token_counts"]], sizes, rates)
    if natural:
        lengths = natural["settings"]["source_ids_per_sentence"]
        for row in natural["rows"]:
            add_roofline(row, list(zip(lengths, row["token_counts"])), sizes, rates)
        add_scaling_ceilings(natural)
    return rates


def run_benchmark(args):
    """Prepares the model and exports, measures everything; returns the results dict."""
    started = time.time()
    load_before = os.getloadavg()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    preset_dir = prepare_preset(args.preset, work, args.seed)
    engines = NATURAL_ENGINES if args.natural_only else ENGINES
    directories, skipped = prepare_exports(preset_dir, work, engines)
    for engine, reason in skipped.items():
        logger.warning("Skipping %s: %s", engine, reason)
    config = json.loads((preset_dir / "config.json").read_text())["config"]
    sources, source_kind = benchmark_sources(
        preset_dir, config["vocabulary_size"], max(args.batch_sizes), args.source_length, args.seed
    )

    workers = start_workers(args, engines, directories, skipped, work)
    measured, calls, natural_measured, natural = {}, {}, {}, None
    try:
        if not args.natural_only:
            measured, calls = measure_throughput(workers, sources, args.batch_sizes, args.rounds)
        if args.natural or args.natural_only:
            natural_workers = {name: worker for name, worker in workers.items()
                               if worker.threads == 1 and worker.system_name in NATURAL_ENGINES}
            natural_rows = natural_sources(preset_dir, args.natural_sentences)
            natural_measured = measure_natural(
                natural_workers, natural_rows, args.natural_batch_sizes, NATURAL_BEAM_SIZE, args.natural_rounds,
                NATURAL_MAX_EXTRA_LENGTH,
            )
    finally:
        for worker in workers.values():
            worker.close()
    profile = None
    if args.profile:
        profile = profile_in_worker(directories, sources, args.batch_sizes, args.max_extra_length, work)
    rows = summarize(measured, calls, workers)
    same = agreement(measured, workers)
    if natural_measured:
        natural = natural_section(args, preset_dir, natural_measured, natural_rows, workers)
    sizes = model_sizes(config)
    rates = add_rooflines(rows, natural, args.source_length, sizes)
    cold = []
    if args.cold_repeats > 0 and not args.natural_only:
        from keras_transformer.datasets import load_bundled

        sentence = load_bundled("test")[0][0]
        cold = cold_starts(directories, sentence, args.cold_repeats, warm_page_cache=not args.quick, work=work)
    load_after = os.getloadavg()
    busy = max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1)
    return {
        "preset": str(args.preset),
        "preset_name": os.path.basename(os.path.normpath(str(args.preset))),
        "preset_directory": str(preset_dir),
        "weights": _weights_label(args.preset, preset_dir),
        "settings": {
            "source_pieces": args.source_length, "source_ids": args.source_length + 1, "sources": source_kind,
            "max_extra_length": args.max_extra_length, "length_penalty": LENGTH_PENALTY,
            "batch_sizes": list(args.batch_sizes), "threads": list(args.threads), "rounds": args.rounds,
            "min_measurement_seconds": MIN_MEASUREMENT_SECONDS, "cold_repeats": args.cold_repeats,
            "quick": args.quick,
        },
        "environment": {
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "versions": _versions(),
            "load_average_before": load_before, "load_average_after": load_after, "busy": busy,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_seconds": time.time() - started, "gpu": "not measured (no GPU on this machine)",
        },
        "skipped": skipped,
        "workers": {
            name: {"load_seconds": w.load_seconds, "peak_rss_mb": w.peak_rss_mb, "directory": str(directories[
                w.system_name])} for name, w in workers.items()
        },
        "throughput": rows,
        "agreement": same,
        "natural": natural,
        "model_sizes": sizes,
        "gemm_gflops_one_thread": {str(m): rate / 1e9 for m, rate in sorted(rates.items())},
        "cold_start": cold,
        "installed": installed_sizes(),
        "profile": profile,
        "goals": goals(rows, cold, natural),
    }


def _weights_label(preset, preset_dir):
    """"random" for a built-in preset (or a directory saved with random weights), else where they come from."""
    if not os.path.isdir(preset):
        return "random"
    try:
        metadata = json.loads((pathlib.Path(preset_dir) / "metadata.json").read_text())
    except (OSError, json.JSONDecodeError):
        metadata = {}
    if str(metadata.get("weights", "")).startswith("random"):
        return "random"
    if "steps" in metadata and "valid_bleu" in metadata:  # written by run_training
        return f"trained ({metadata['steps']} updates, validation BLEU {metadata['valid_bleu']})"
    return "from the preset directory"


def print_report(results):
    if results["environment"]["busy"]:
        print(f"NOTE: busy machine (load average {results['environment']['load_average_before'][0]:.1f} before, "
              f"{results['environment']['load_average_after'][0]:.1f} after, {results['environment']['cpu_count']} "
              "CPUs): the figures are noisy.\n")
    for engine, reason in results["skipped"].items():
        print(f"skipped {engine}: {reason}")
    print(markdown(results))
    natural = results.get("natural")
    if natural and natural["weights"] == "random":
        print("\nNOTE: the natural-length table ran an untrained model (random weights), which practically never "
              "emits the end id, so every sentence runs to its maximum length: the figures need a trained model "
              "(--preset runs/small).")
    if results["gemm_gflops_one_thread"]:
        rates = ", ".join(f"{m} rows {rate:.1f}" for m, rate in results["gemm_gflops_one_thread"].items())
        print(f"\nRoofline: NumPy float32, one thread, on the decoder step's weight products (GFLOP/s): {rates}. "
              "`x roofline` = the row's time / the time those products alone would take for the tokens it "
              "decoded (projections, attention products, output layer; no encoder, no search).")
    print("\nAgreement with Keras (rows with identical tokens):")
    for a in results["agreement"]:
        print(f"  {a['threads']} thr B={a['batch']:<2d} {a['search']:6s} {a['system']:12s} "
              f"{a['rows_identical_to_keras']}/{a['rows']}  equal lengths: {a['equal_lengths']}")
    print("\nPeak resident memory of each worker over the whole benchmark (largest batch and beam included):")
    for name, worker in results["workers"].items():
        if worker["peak_rss_mb"] is not None:
            print(f"  {name}: {worker['peak_rss_mb']:.0f} MB")
    print("\nInstalled size (distributions with their dependencies):")
    for name, size in results["installed"].items():
        print(f"  {PATHS[name]}: {size['mb']:,.0f} MB ({len(size['distributions'])} distributions)")
    if results["profile"]:
        print("\nONNX Runtime profile of the step driver (float32, beam 4, 1 thread): time per graph, the driver's"
              " own time, top graph/op types by summed node time (profiling slows every node: read the shares):")
        for batch, report in results["profile"].items():
            calls = report["calls"]
            graphs = ", ".join(f"{graph} {us / 1e3 / calls:.1f}" for graph, us in report["graphs_us"].items())
            print(f"  batch {batch}: {report['seconds_per_call'] * 1e3:.1f} ms per call; graphs (ms/call): {graphs};"
                  f" driver {report['python_us'] / 1e3 / calls:.1f} ms/call")
            for op in report["ops"][:12]:
                print(f"    {op['op']:48s} {op['share']:6.1%}  {op['us'] / 1e3 / calls:8.2f} ms/call"
                      f"  {op['nodes_run'] // calls:6d} node runs/call")
    print("\nGoals (issue 25, 1 thread, this run):")
    for goal in results["goals"]:
        print(f"  [{'met' if goal['met'] else 'NOT met'}] {goal['goal']}: {goal['value']:.2f} "
              f"(goal {goal['target']}; {goal['where']})")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=None, help="built-in preset name (random weights) or preset directory "
                        "(default small; tiny with --quick)")
    parser.add_argument(
        "--work", default=str(DEFAULT_WORK), help=f"cache of presets and exports (default {DEFAULT_WORK})"
    )
    parser.add_argument("--results", default=str(RESULTS), help="directory for serve.json and serve.png")
    parser.add_argument("--quick", action="store_true", help="tiny preset, short sources, 2 rounds, 1 cold start")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts (default 1; e.g. 1 2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--source-length", type=int, default=None, help="pieces per source (default 20; 8 quick)")
    parser.add_argument("--max-extra-length", type=int, default=None,
                        help="output tokens beyond the source (default 30; 8 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="measurement rounds (default 5; 2 quick)")
    parser.add_argument("--cold-repeats", type=int, default=None, help="cold starts per command (default 3; 1 quick)")
    parser.add_argument("--profile", action="store_true", help="ONNX Runtime profile of the step driver (float32, beam 4)")
    parser.add_argument("--natural", action="store_true",
                        help="add the natural-length table: the first test sentences, beam 4, 1 thread, each "
                             "system's own output lengths, batch 1, 16, 64 (use a trained --preset)")
    parser.add_argument("--natural-only", action="store_true",
                        help="only the natural-length table (no fixed-length table, no cold starts)")
    parser.add_argument("--natural-sentences", type=int, default=None,
                        help=f"sentences of the natural-length table (default {NATURAL_SENTENCES}; 8 quick)")
    parser.add_argument("--natural-batch-sizes", type=int, nargs="+", default=None,
                        help=f"default {' '.join(map(str, NATURAL_BATCH_SIZES))} (1 4 quick)")
    parser.add_argument("--natural-rounds", type=int, default=None, help="default 2 (1 quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--gemm-rates", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    if args.worker:
        return worker_main(args.worker, args.model, args.threads[0], args.max_extra_length)
    if args.gemm_rates:
        request = json.loads(args.gemm_rates)
        rates = gemm_rates(request["sizes"], request["row_counts"], request["min_seconds"])
        print(json.dumps({str(m): rate for m, rate in rates.items()}))
        return 0

    quick = args.quick
    defaults = {"preset": "tiny" if quick else "small", "source_length": 8 if quick else 20,
                "max_extra_length": 8 if quick else 30, "rounds": 2 if quick else 5, "cold_repeats": 1 if quick else 3,
                "natural_sentences": 8 if quick else NATURAL_SENTENCES,
                "natural_batch_sizes": [1, 4] if quick else list(NATURAL_BATCH_SIZES),
                "natural_rounds": 1 if quick else 2}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("source_length", "rounds", "natural_sentences", "natural_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, received {getattr(args, name)}")
    if args.max_extra_length < 0 or args.cold_repeats < 0 or min(args.threads) < 1 or min(
        args.batch_sizes + args.natural_batch_sizes
    ) < 1:
        parser.error("--max-extra-length and --cold-repeats must be >= 0, --threads and --batch-sizes >= 1")
    backend = os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        parser.error(f"KERAS_BACKEND={backend!r}: the benchmark's Keras system and the ONNX export need tensorflow")

    results = run_benchmark(args)
    output = pathlib.Path(args.results)
    output.mkdir(parents=True, exist_ok=True)
    stem = ("serve_quick" if quick else "serve") + ("_natural" if args.natural_only else "")
    (output / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plotted = False
    if results["throughput"]:
        try:
            plot(results, output / f"{stem}.png")
            plotted = True
        except ModuleNotFoundError as error:  # the figure is optional; the JSON and the report are the results
            logger.warning("No %s.png: %s (pip install matplotlib)", stem, error)
    print_report(results)
    print(f"\nWrote {output / (stem + '.json')}{f' and {stem}.png' if plotted else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
