"""HTTP serving under load: `python -m export.serve` with and without dynamic batching.

Closed-loop clients (each sends one sentence of the bundled test split,
waits for its translation, sends the next; client i starts at a different
sentence) run for `--duration` seconds after `--warmup` seconds, against

- the server with dynamic batching (its defaults: `--max-batch-tokens
  2048 --max-delay-ms 5`), at 1, 8, 32 and 64 clients (`--clients`);
- the same server with batching off (`--max-batch-tokens 1 --max-delay-ms
  0`: one sentence per search, one search at a time), at 1 client (the
  baseline of the issue's goal) and at 32 (`--baseline-clients`: what
  one-at-a-time serving does under the same load).

Per level: sentences per second (answers completed inside the measured
window), latency p50 / p95 / p99 of those answers, errors by status, the
batch-size histogram (the server's `kt_serve_batch_sentences` buckets,
scraped from `/metrics` before and after), the server's and the clients'
CPU time per wall second (1.0 = one busy core), and the machine's load
average before and after. The clients share the machine with the server
(loopback only): on a 2-core CPU they take a share of it, reported.

The model: `--model DIR` (an `export.onnx` directory), or `--preset` (a
preset directory, or a built-in preset name with random weights and a
tokenizer trained on the bundled corpus), exported once and cached under
`--work` as `benchmarks/serve.py` does. A model with random weights never
emits the end id, so every sentence generates its source length +
`--max-extra-length` tokens: a fixed, pessimistic amount of work.

The goal (issue 23): at 32 clients, >= 3x the sentences/s of one client
with batching off, at p99 <= 2x its latency (both baselines reported), and
no errors below the queue limit.

`--paragraphs` (issue 48) measures documents instead, against one server
with batching on: paragraphs of `--paragraph-sentences` consecutive test
sentences joined by spaces, sent one per request with `"split_sentences":
true`, plain and streamed (`"stream": true`), against the same sentences
(the server's split of those paragraphs) sent one per request; closed-loop
clients at each `--clients` level (default 1 and 8). Per mode: sentences/s,
request latency, and for the streamed paragraphs the time to the first
event (the first sentence done).

```
python -m benchmarks.serve_http                      # small preset, 20 s per level (~4 minutes once exported)
python -m benchmarks.serve_http --duration 8 --warmup 2
python -m benchmarks.serve_http --quick              # tiny preset, 3 s per level: a smoke run
python -m benchmarks.serve_http --paragraphs         # documents: split, streamed, against one per request
```

Writes `serve_http.json` and `serve_http.png` (`serve_http_quick.*` with
`--quick`, `serve_http_beam1.*` with `--beam-size 1`;
`serve_http_paragraphs*.json` with `--paragraphs`, no plot) into `--results`
(default `benchmarks/results`) and prints a markdown table.
"""

if not __package__:
    raise SystemExit("Run as a module from the repository root: python -m benchmarks.serve_http")

import argparse
import asyncio
import json
import logging
import math
import os
import pathlib
import platform
import re
import resource
import subprocess
import sys
import time

logger = logging.getLogger("benchmarks.serve_http")

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT_WORK = REPO / "runs" / "serve"
BATCHING_OFF = ["--max-batch-tokens", "1", "--max-delay-ms", "0"]
GOAL_SPEEDUP = 3.0
GOAL_P99_RATIO = 2.0
GOAL_CLIENTS = 32
START_TIMEOUT_SECONDS = 120
BATCH_METRIC = "kt_serve_batch_sentences"


# ---------------------------------------------------------------------- #
# Arithmetic
# ---------------------------------------------------------------------- #
def percentile(values, q):
    """The q-th percentile (0-100) of `values`, linearly interpolated (NumPy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def histogram_buckets(metrics_text, name):
    """`{upper bound: cumulative count}` of a Prometheus histogram (`+Inf` as math.inf)."""
    buckets = {}
    pattern = re.compile(rf'^{re.escape(name)}_bucket\{{le="([^"]+)"\}} ([0-9.e+-]+)$')
    for line in metrics_text.splitlines():
        found = pattern.match(line)
        if found:
            bound = math.inf if found.group(1) == "+Inf" else float(found.group(1))
            buckets[bound] = float(found.group(2))
    return buckets


def batch_sizes(before, after):
    """Searches per batch-size range between two scrapes: `[{"sentences": "3-4", "batches": n}, ...]`.

    The buckets are cumulative (`le`), so each range's count is the
    difference of neighbouring bounds, after minus before.
    """
    start, end = histogram_buckets(before, BATCH_METRIC), histogram_buckets(after, BATCH_METRIC)
    rows, previous_bound, previous_count = [], 0, 0.0
    for bound in sorted(end):
        count = end[bound] - start.get(bound, 0.0)
        low = int(previous_bound) + 1
        label = f"{low}+" if bound == math.inf else (str(int(bound)) if low == int(bound) else f"{low}-{int(bound)}")
        if count - previous_count:
            rows.append({"sentences": label, "batches": int(round(count - previous_count))})
        previous_bound, previous_count = bound, count
    return rows


def mean_batch(before, after):
    """Sentences per search between two scrapes (from the histogram's `_sum` and `_count`)."""
    def value(text, suffix):
        found = re.search(rf"^{BATCH_METRIC}_{suffix} ([0-9.e+-]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    searches = value(after, "count") - value(before, "count")
    return (value(after, "sum") - value(before, "sum")) / searches if searches else None


# ---------------------------------------------------------------------- #
# The server and the clients
# ---------------------------------------------------------------------- #
class Server:
    """`python -m export.serve` in a subprocess on a free port; its log in `log_path`."""

    def __init__(self, model, options, log_path):
        self.log_path = pathlib.Path(log_path)
        self._log = open(self.log_path, "w")
        # Its default logging (one line per request) into the log file: part of the serving cost.
        command = [sys.executable, "-m", "export.serve", "--model", str(model), "--port", "0", *options]
        self.command = " ".join(command[1:])
        self.process = subprocess.Popen(command, cwd=str(REPO), stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.process.kill()
            self.process.wait(30)
            self._log.close()
            raise

    def _wait_ready(self):
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        url = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            if url is None:
                found = re.search(r"on (http://[0-9.]+:\d+) ", self.log_path.read_text())
                url = found.group(1) if found else None
            if url is not None:
                try:
                    if httpx.get(url + "/ready", timeout=5).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {START_TIMEOUT_SECONDS} s:\n{self.log_path.read_text()}")

    def metrics(self):
        import httpx

        return httpx.get(self.url + "/metrics", timeout=30).text

    def cpu_seconds(self):
        """The server process's user + system CPU seconds (Linux /proc)."""
        fields = pathlib.Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        """SIGTERM; returns the exit status (the server drains, then exits 0)."""
        self.process.terminate()
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(30)
        finally:
            self._log.close()


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _clients(url, count, texts, beam_size, warmup, duration):
    """Runs `count` closed-loop clients; returns `(latencies of answers inside the window, errors)`."""
    import httpx

    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    latencies, errors = [], {}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)

    async def client(i, session):
        k = i * max(len(texts) // max(count, 1), 1)
        while time.perf_counter() < window[1]:
            text = texts[k % len(texts)]
            k += 1
            sent = time.perf_counter()
            try:
                response = await session.post(url + "/v1/translate", json={"text": [text], "beam_size": beam_size})
                outcome = response.status_code
                if outcome == 200 and len(response.json()["translations"]) != 1:
                    outcome = "wrong answer"
            except httpx.HTTPError as error:
                outcome = type(error).__name__
            done = time.perf_counter()
            if window[0] <= done <= window[1]:
                if outcome == 200:
                    latencies.append(done - sent)
                else:
                    errors[str(outcome)] = errors.get(str(outcome), 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=limits) as session:
        await asyncio.gather(*(client(i, session) for i in range(count)))
    return latencies, errors


def measure(server, clients, texts, beam_size, warmup, duration):
    """One load level against a running server."""
    load_before = os.getloadavg()
    metrics_before = server.metrics()
    server_cpu, client_cpu, wall = server.cpu_seconds(), _cpu_seconds(), time.perf_counter()
    latencies, errors = asyncio.run(_clients(server.url, clients, texts, beam_size, warmup, duration))
    wall = time.perf_counter() - wall
    server_cpu, client_cpu = server.cpu_seconds() - server_cpu, _cpu_seconds() - client_cpu
    metrics_after = server.metrics()
    return {
        "clients": clients,
        "sentences": len(latencies),
        "sentences_per_second": len(latencies) / duration,
        "latency_ms": {f"p{q}": (percentile(latencies, q) or math.nan) * 1000 for q in (50, 95, 99)},
        "errors": errors,
        "batch_sizes": batch_sizes(metrics_before, metrics_after),
        "mean_batch_sentences": mean_batch(metrics_before, metrics_after),
        "server_cpu_per_second": server_cpu / wall,
        "client_cpu_per_second": client_cpu / wall,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


async def _document_clients(url, count, payloads, sentences, warmup, duration, stream=False):
    """Closed-loop clients that send `payloads` in turn (`sentences[k]`: payload k's sentences).

    Returns `(answers, errors)`: per request answered inside the window,
    `(sentences, seconds to the answer's end, seconds to its first event or
    None)`; streamed requests must end with `[DONE]` after one event per
    sentence, plain ones hold a translation per text.
    """
    import httpx

    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    answers, errors = [], {}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)

    async def send(session, payload, count_wanted, sent):
        if not stream:
            response = await session.post(url + "/v1/translate", json=payload)
            good = response.status_code == 200 and len(response.json()["translations"]) == len(payload["text"])
            return response.status_code if response.status_code != 200 or good else "wrong answer", None
        first, events, ended = None, 0, False
        async with session.stream("POST", url + "/v1/translate", json={**payload, "stream": True}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                first = first if first is not None else time.perf_counter() - sent
                ended = line == "data: [DONE]"
                events += not ended
        if response.status_code != 200:
            return response.status_code, first
        return (200 if ended and events == count_wanted else "wrong stream"), first

    async def client(i, session):
        k = i * max(len(payloads) // max(count, 1), 1)
        while time.perf_counter() < window[1]:
            payload, wanted = payloads[k % len(payloads)], sentences[k % len(payloads)]
            k += 1
            sent = time.perf_counter()
            try:
                outcome, first = await send(session, payload, wanted, sent)
            except httpx.HTTPError as error:
                outcome, first = type(error).__name__, None
            done = time.perf_counter()
            if window[0] <= done <= window[1]:
                if outcome == 200:
                    answers.append((wanted, done - sent, first))
                else:
                    errors[str(outcome)] = errors.get(str(outcome), 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=limits) as session:
        await asyncio.gather(*(client(i, session) for i in range(count)))
    return answers, errors


def measure_documents(server, clients, payloads, sentences, warmup, duration, stream=False):
    """One level of `--paragraphs` (one kind of request) against a running server."""
    load_before = os.getloadavg()
    metrics_before = server.metrics()
    answers, errors = asyncio.run(_document_clients(server.url, clients, payloads, sentences, warmup, duration, stream))
    metrics_after = server.metrics()
    latencies = [answer[1] for answer in answers]
    firsts = [answer[2] for answer in answers if answer[2] is not None]
    return {
        "clients": clients,
        "requests": len(answers),
        "sentences": sum(answer[0] for answer in answers),
        "sentences_per_second": sum(answer[0] for answer in answers) / duration,
        "latency_ms": {f"p{q}": (percentile(latencies, q) or math.nan) * 1000 for q in (50, 95, 99)},
        "first_event_ms": {f"p{q}": (percentile(firsts, q) or math.nan) * 1000 for q in (50, 95, 99)} if stream else None,
        "errors": errors,
        "mean_batch_sentences": mean_batch(metrics_before, metrics_after),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def paragraphs_of(texts, size):
    """Paragraphs of `size` consecutive `texts` joined by spaces, and per paragraph its sentences as the server
    splits them (`documents.split_texts` with `"split_sentences": true`'s generic rules)."""
    from keras_transformer import documents

    paragraphs = [" ".join(text.strip() for text in texts[i: i + size]) for i in range(0, len(texts) - size + 1, size)]
    split = documents.split_texts(paragraphs)
    return paragraphs, [[split.units[piece] for piece in pieces if isinstance(piece, int)] for pieces in split.pieces]


def run_paragraphs(args):
    """`--paragraphs`: the server's sentences/s on split paragraphs (plain, streamed) against one sentence per
    request, and the time to the first streamed sentence."""
    started = time.time()
    model = prepare_model(args)
    paragraphs, units = paragraphs_of(benchmark_texts(args.max_text_chars), args.paragraph_sentences)
    search = {"beam_size": args.beam_size}
    modes = {
        "sentences": ([{"text": [unit], **search} for found in units for unit in found], None, False),
        "paragraphs": ([{"text": [p], "split_sentences": True, **search} for p in paragraphs], units, False),
        "paragraphs_streamed": ([{"text": [p], "split_sentences": True, **search} for p in paragraphs], units, True),
    }
    common = server_options(args, 4 * args.paragraph_sentences * max(args.clients)) + args.batching
    results = run_record(args, model, common, paragraphs=len(paragraphs), paragraph_sentences=args.paragraph_sentences,
                         sentences=sum(map(len, units)))
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    uptime_before = _uptime()
    server = Server(model, common + args.batching, work / "serve_http_paragraphs.log")
    results["command"] = server.command
    try:
        for clients in args.clients:
            for mode, (payloads, split, stream) in modes.items():
                logger.info("%s: %d clients for %g s", mode, clients, args.warmup + args.duration)
                sentences = [len(found) for found in split] if split else [1] * len(payloads)
                row = measure_documents(server, clients, payloads, sentences, args.warmup, args.duration, stream)
                results.setdefault(mode, []).append(row)
                print(_paragraph_row(mode, row), flush=True)
    finally:
        results["exit_status"] = server.stop()
    results["environment"] = environment(started, uptime_before)
    return results


PARAGRAPH_HEADER = (
    "| requests | clients | sentences/s | request p50 ms | p95 ms | first sentence p50 ms | p95 ms "
    "| sentences/search | errors | load |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"
)


def _paragraph_row(mode, r):
    first = [f"{r['first_event_ms'][q]:.0f}" if r["first_event_ms"] else "-" for q in ("p50", "p95")]
    mean = f"{r['mean_batch_sentences']:.1f}" if r["mean_batch_sentences"] else "-"
    errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
    return (f"| {mode.replace('_', ', ')} | {r['clients']} | {r['sentences_per_second']:.2f} "
            f"| {r['latency_ms']['p50']:.0f} | {r['latency_ms']['p95']:.0f} | {first[0]} | {first[1]} "
            f"| {mean} | {errors} | {r['load_average_before'][0]:.1f} |")


def benchmark_texts(limit):
    """The bundled test split's English sentences (non-empty), at most `limit` characters."""
    from keras_transformer.datasets import load_bundled

    english, _ = load_bundled("test")
    return [text for text in english if text.strip() and len(text) <= limit]


# ---------------------------------------------------------------------- #
# The run
# ---------------------------------------------------------------------- #
def prepare_model(args):
    if args.model:
        return pathlib.Path(args.model)
    from benchmarks.serve import prepare_exports, prepare_preset

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    preset_dir = prepare_preset(args.preset, args.work, args.seed)
    directories, skipped = prepare_exports(preset_dir, args.work, ["ort-float32"])
    if "ort-float32" not in directories:
        raise SystemExit(f"The ONNX export failed: {skipped.get('ort-float32')}")
    return directories["ort-float32"]


def goals(levels, baselines):
    """The issue's goal at 32 clients, against both baselines; None where a level is missing."""
    on = next((r for r in levels if r["clients"] == GOAL_CLIENTS), None)
    checks = []
    for baseline in baselines:
        if on is None or not baseline["sentences"] or not on["sentences"]:
            continue
        speedup = on["sentences_per_second"] / baseline["sentences_per_second"]
        p99_ratio = on["latency_ms"]["p99"] / baseline["latency_ms"]["p99"]
        checks.append({
            "against": f"batching off, {baseline['clients']} client{'s' if baseline['clients'] > 1 else ''}",
            "speedup": speedup, "speedup_met": speedup >= GOAL_SPEEDUP,
            "p99_ratio": p99_ratio, "p99_met": p99_ratio <= GOAL_P99_RATIO,
        })
    errors = sum(sum(r["errors"].values()) for r in levels + baselines)
    return {"target": f">= {GOAL_SPEEDUP:g}x sentences/s at {GOAL_CLIENTS} clients, p99 <= {GOAL_P99_RATIO:g}x, "
                      "no errors", "checks": checks, "errors": errors}


def run_benchmark(args):
    started = time.time()
    model = prepare_model(args)
    texts = benchmark_texts(args.max_text_chars)
    common = server_options(args, 4 * max(args.clients + args.baseline_clients))
    results = run_record(args, model, common, sentences=len(texts), batching=args.batching)
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    uptime_before = _uptime()
    for name, options, counts in (("batching", args.batching, args.clients),
                                  ("batching_off", BATCHING_OFF, args.baseline_clients)):
        server = Server(model, common + options, work / f"serve_http_{name}.log")
        results.setdefault("commands", {})[name] = server.command
        try:
            rows = []
            for clients in counts:
                logger.info("%s: %d clients for %g s", name, clients, args.warmup + args.duration)
                rows.append(measure(server, clients, texts, args.beam_size, args.warmup, args.duration))
                print(_row(name, rows[-1]), flush=True)
            results[name] = rows
        finally:
            results.setdefault("exit_status", {})[name] = server.stop()
    results["goals"] = goals(results["batching"], results["batching_off"])
    results["environment"] = environment(started, uptime_before)
    return results


def server_options(args, queue):
    """The options of every server of a run: the search's, `--max-queue` (at least `queue`), `--threads`."""
    common = ["--beam-size", str(args.beam_size), "--max-extra-length", str(args.max_extra_length),
              "--max-queue", str(max(256, queue))]
    return common + (["--threads", str(args.threads)] if args.threads else [])


def run_record(args, model, common, **settings):
    """The start of a run's JSON: the model, its label and the settings (`settings` added to the shared ones)."""
    label = pathlib.Path(args.model).name if args.model else f"{args.preset} (random weights)"
    return {"model": str(model), "label": label, "settings": {
        "duration_seconds": args.duration, "warmup_seconds": args.warmup, "beam_size": args.beam_size,
        "max_extra_length": args.max_extra_length, "threads": args.threads, **settings, "server_options": common,
    }}


def environment(started, uptime_before):
    """The machine and its load around a run (`busy`: a load average above half the CPUs, before or after)."""
    uptime_after = _uptime()
    return {
        "machine": platform.machine(), "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "uptime_before": uptime_before, "uptime_after": uptime_after,
        "busy": max(_load(uptime_before), _load(uptime_after)) > 0.5 * (os.cpu_count() or 1),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "wall_seconds": time.time() - started,
        "clients_on_the_same_machine": True,
    }


def _uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def _load(uptime):
    found = re.search(r"load average: ([0-9.]+)", uptime)
    return float(found.group(1)) if found else 0.0


# ---------------------------------------------------------------------- #
# Report
# ---------------------------------------------------------------------- #
def _row(name, r):
    latency = r["latency_ms"]
    batches = " ".join(f"{b['sentences']}:{b['batches']}" for b in r["batch_sizes"])
    errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
    mean = f"{r['mean_batch_sentences']:.1f}" if r["mean_batch_sentences"] else "-"
    return (f"| {'on' if name == 'batching' else 'off'} | {r['clients']} | {r['sentences_per_second']:.2f} "
            f"| {latency['p50']:.0f} | {latency['p95']:.0f} | {latency['p99']:.0f} | {mean} | {batches} | {errors} "
            f"| {r['server_cpu_per_second']:.2f} / {r['client_cpu_per_second']:.2f} "
            f"| {r['load_average_before'][0]:.1f} |")


TABLE_HEADER = (
    "| batching | clients | sentences/s | p50 ms | p95 ms | p99 ms | sentences/search | searches by size "
    "| errors | CPU server / clients | load |\n"
    "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"
)


def markdown(results):
    lines = [TABLE_HEADER]
    lines += [_row("batching_off", r) for r in results["batching_off"]]
    lines += [_row("batching", r) for r in results["batching"]]
    goal = results["goals"]
    lines.append("")
    lines.append(f"Goal: {goal['target']}; errors in the run: {goal['errors']}.")
    for check in goal["checks"]:
        lines.append(
            f"- 32 clients vs {check['against']}: {check['speedup']:.2f}x sentences/s "
            f"({'met' if check['speedup_met'] else 'not met'}), p99 {check['p99_ratio']:.2f}x "
            f"({'met' if check['p99_met'] else 'not met'})"
        )
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on, off = results["batching"], results["batching_off"]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    axis = axes[0]
    axis.plot([r["clients"] for r in on], [r["sentences_per_second"] for r in on], "o-", label="batching on")
    axis.plot([r["clients"] for r in off], [r["sentences_per_second"] for r in off], "s--", label="batching off")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("sentences / s")
    axis.set_title("Throughput")
    axis.legend()
    axis = axes[1]
    for rows, style, name in ((on, "-", "on"), (off, "--", "off")):
        for q, marker in (("p50", "o"), ("p99", "^")):
            axis.plot([r["clients"] for r in rows], [r["latency_ms"][q] for r in rows], marker + style,
                      label=f"{q}, batching {name}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("latency (ms)")
    axis.set_title("Latency per request (one sentence)")
    axis.legend(fontsize=8)
    axis = axes[2]
    labels = []
    for r in on:
        labels += [b["sentences"] for b in r["batch_sizes"] if b["sentences"] not in labels]
    order = sorted(labels, key=lambda label: int(label.split("-")[0].rstrip("+")))
    width = 0.8 / max(len(on), 1)
    for i, r in enumerate(on):
        counts = {b["sentences"]: b["batches"] for b in r["batch_sizes"]}
        total = sum(counts.values()) or 1
        axis.bar([j + (i - (len(on) - 1) / 2) * width for j in range(len(order))],
                 [counts.get(label, 0) / total for label in order], width, label=f"{r['clients']} clients")
    axis.set_xticks(range(len(order)), order)
    axis.set_xlabel("sentences per search")
    axis.set_ylabel("share of searches")
    axis.set_title("Batch sizes (batching on)")
    axis.legend(fontsize=8)
    busy = " (busy machine)" if results["environment"]["busy"] else ""
    for axis in axes[:2]:
        counts = sorted({r["clients"] for r in on + off})
        axis.set_xticks(counts, [str(c) for c in counts])
        axis.minorticks_off()
    figure.suptitle(f"python -m export.serve, {results['label']}, beam "
                    f"{results['settings']['beam_size']}, {results['environment']['cpu_count']} CPUs{busy}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_http", description="Load test of python -m export.serve (loopback)."
    )
    parser.add_argument("--model", help="an export.onnx directory (default: export --preset, cached in --work)")
    parser.add_argument("--preset", default=None, help="preset directory or built-in name (default small; tiny quick)")
    parser.add_argument("--work", default=str(DEFAULT_WORK), help="cache of presets, exports and server logs")
    parser.add_argument("--results", default=str(RESULTS), help="directory for serve_http.json and .png")
    parser.add_argument("--clients", type=int, nargs="+", default=None,
                        help="batching on (default 1 8 32 64; 1 8 with --paragraphs)")
    parser.add_argument("--baseline-clients", type=int, nargs="+", default=[1, 32],
                        help="batching off (default 1 32)")
    parser.add_argument("--duration", type=float, default=None, help="measured seconds per level (default 20; 3 quick)")
    parser.add_argument("--warmup", type=float, default=None, help="unmeasured seconds first (default 3; 1 quick)")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--max-extra-length", type=int, default=None, help="default 50 (10 quick)")
    parser.add_argument("--threads", type=int, default=None, help="server's engine threads (default: one per core)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="batching on (default: the server's)")
    parser.add_argument("--max-delay-ms", type=float, default=None, help="batching on (default: the server's)")
    parser.add_argument("--max-text-chars", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="tiny preset, 3 s per level")
    parser.add_argument("--paragraphs", action="store_true",
                        help="split paragraphs (plain, streamed) against one sentence per request (default clients 1 8)")
    parser.add_argument("--paragraph-sentences", type=int, default=8, help="test sentences per paragraph (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.quick else "small")
    args.clients = args.clients or ([1, 8] if args.paragraphs else [1, 8, 32, 64])
    args.duration = args.duration or (3.0 if args.quick else 20.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 3.0)
    args.max_extra_length = args.max_extra_length if args.max_extra_length is not None else (10 if args.quick else 50)
    if min(args.clients + args.baseline_clients) < 1 or 1 not in args.baseline_clients:
        parser.error("client counts must be >= 1, and --baseline-clients must include 1 (the goal's baseline)")
    args.batching = []
    if args.max_batch_tokens is not None:
        args.batching += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.max_delay_ms is not None:
        args.batching += ["--max-delay-ms", f"{args.max_delay_ms:g}"]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    output = pathlib.Path(args.results)
    if args.paragraphs:
        print(PARAGRAPH_HEADER, flush=True)
        results = run_paragraphs(args)
        output.mkdir(parents=True, exist_ok=True)
        stem = "serve_http_paragraphs" + ("_quick" if args.quick else "") + (
            f"_beam{args.beam_size}" if args.beam_size != 4 else "")
        (output / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"{results['environment']['uptime_before']}  (before)\n{results['environment']['uptime_after']}  (after)")
        print(f"Wrote {output / (stem + '.json')}")
        return 0
    print(TABLE_HEADER, flush=True)
    results = run_benchmark(args)
    output.mkdir(parents=True, exist_ok=True)
    stem = "serve_http" + ("_quick" if args.quick else "") + (f"_beam{args.beam_size}" if args.beam_size != 4 else "")
    (output / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, output / f"{stem}.png")
    print()
    print(f"{results['environment']['uptime_before']}  (before)\n{results['environment']['uptime_after']}  (after)")
    if results["environment"]["busy"]:
        print("NOTE: busy machine (load average above half the CPUs): the figures are noisy.")
    print(markdown(results))
    print(f"\nWrote {output / (stem + '.json')} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
