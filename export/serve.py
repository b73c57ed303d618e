"""The HTTP translation server: `python -m export.serve --model DIR`.

An exported model (`python -m export.onnx`, served by ONNX Runtime through
`export.runtime`, or `python -m export.ctranslate2`) behind an ASGI app
(Starlette, run by uvicorn). No training framework is imported: the lean
install is `pip install "keras-aiayn[serve]"` (onnxruntime, Starlette,
uvicorn; add `ctranslate2` for that engine), and a test serves where
importing TensorFlow, Keras, JAX or PyTorch fails.

Endpoints:

- `POST /v1/translate` with a JSON object `{"text": ["...", ...],
  "beam_size": 4}` (`text` may also be one string; `beam_size` is optional,
  1 is greedy search) -> `{"translations": ["...", ...]}` in the order of
  `text`. Other fields are refused with 400: `num_hypotheses` and
  `target_prefix` are named as not supported yet (they come with the
  translation API); anything else as unknown.
- `GET /health`: 200 while the process runs (liveness).
- `GET /ready`: 200 once the model is loaded and has translated a warm-up
  sentence; 503 while loading and while draining (readiness).
- `GET /metrics`: Prometheus text format: requests by path and status,
  errors by reason, sentences, request latency, batch sizes (sentences and
  padded source tokens), search time, queue depth, requests in flight.

Dynamic batching (`Batcher`): the sentences of all waiting requests with
equal search options (`SearchOptions`, the batching key) are translated in
one search of at most `max_batch_tokens` padded source tokens (rows x
longest row; a longer sentence goes alone), waiting at most `max_delay_ms`
after the oldest sentence arrived for a batch to fill. Requests with other
options wait for a batch of their own, so each gets the answer of its own
options. The search runs in one worker thread, off the event loop, which
keeps accepting and answering while it translates.

Limits (`ServerSettings`): request bodies over `max_body_bytes` get 413;
more than `max_texts` texts, a text over `max_text_chars` characters, a
`beam_size` outside `[1, max_beam_size]`, malformed JSON, wrong types or
missing fields get 400; a request whose sentences do not fit in the queue
(`max_queue` sentences waiting) gets 503 with `Retry-After`, as it does
while the model loads; a body that has not arrived within `request_timeout`
gets 408 and an answer not ready by then 504. Every error is JSON
`{"error": "..."}` naming the field and the limit (and its option). A client
that disconnects is logged with status 499 and its waiting sentences leave
the queue.

Shutdown: on SIGTERM (or SIGINT) the server stops accepting connections,
answers every request it has accepted (the queue is flushed at once), and
exits 0; requests still unanswered after `drain_seconds` are cancelled and
the exit status is 1. One log line per request (`logging`, logger
`export.serve`): `method=POST path=/v1/translate status=200 sentences=3
ms=41.2 client=127.0.0.1:50412`.

Example:

```
python -m export.serve --model exported/onnx --port 8000
curl -s localhost:8000/v1/translate -d '{"text": ["A sentence."], "beam_size": 4}'
# {"translations":["Ein Satz."]}
```

```python
from export.serve import ServerSettings, create_app, load_engine, serve

serve("exported/onnx", port=8000, settings=ServerSettings(max_batch_tokens=4096))  # blocks; exit status
app = create_app(load_engine("exported/onnx"))   # an ASGI app for a server of your own
```
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import signal
import socket
import sys
import threading
import time

# Named, not __name__, so that `python -m export.serve` logs under the same name.
logger = logging.getLogger("export.serve")

ENGINES = ("onnxruntime", "ctranslate2")
# Request fields: those that work, and those of the translation API that do not yet.
FIELDS = ("text", "beam_size")
NOT_YET = ("num_hypotheses", "target_prefix")
RETRY_AFTER_SECONDS = 1
# The status logged for a request whose client went away before its answer (nginx's).
CLIENT_CLOSED = 499
WARM_UP_TEXT = "Hello."
_INFO = "export.serve"  # the ASGI scope key of a request's log record


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Batching, limits and search settings of the server (the command's options).

    Args:
        max_batch_tokens: int >= 1, padded source tokens (rows x longest
            row, end token included) per search; one sentence longer than
            this is searched alone.
        max_delay_ms: float >= 0, how long the oldest waiting sentence waits
            for a batch to fill. 0 with `max_batch_tokens=1` translates one
            sentence at a time (batching off).
        max_queue: int >= 1, sentences waiting for a search; a request that
            does not fit gets 503 with `Retry-After`.
        max_body_bytes: int >= 1, request body size (413 beyond).
        max_texts: int >= 1, texts per request (400 beyond); at most
            `max_queue`.
        max_text_chars: int >= 1, characters per text (400 beyond).
        max_beam_size: int >= 1, the largest `beam_size` a request may ask.
        beam_size: int in [1, max_beam_size], for requests without one.
        length_penalty: float >= 0, GNMT's alpha for every request.
        max_extra_length: int >= 0, output tokens beyond the source length.
        request_timeout: float > 0, seconds from the start of a request to
            its answer (408 while the body is still arriving, 504 after).
        drain_seconds: float > 0, how long a SIGTERM waits for accepted
            requests before cancelling them.
        max_connections: int >= 1, open connections and requests (uvicorn's
            `limit_concurrency`; beyond it uvicorn answers 503 in plain text).
    """

    max_batch_tokens: int = 2048
    max_delay_ms: float = 5.0
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    max_texts: int = 64
    max_text_chars: int = 2000
    max_beam_size: int = 8
    beam_size: int = 4
    length_penalty: float = 0.6
    max_extra_length: int = 50
    request_timeout: float = 30.0
    drain_seconds: float = 30.0
    max_connections: int = 1024

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_queue", "max_body_bytes", "max_texts", "max_text_chars",
                     "max_beam_size", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name, positive in (("max_delay_ms", False), ("length_penalty", False), ("request_timeout", True),
                               ("drain_seconds", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if positive else value < 0
            ):
                raise ValueError(f"{name}={value!r} must be a finite number {'> 0' if positive else '>= 0'}")
        if isinstance(self.max_extra_length, bool) or not isinstance(self.max_extra_length, int) or (
            self.max_extra_length < 0
        ):
            raise ValueError(f"max_extra_length={self.max_extra_length!r} must be an integer >= 0")
        if isinstance(self.beam_size, bool) or not isinstance(self.beam_size, int) or not (
            1 <= self.beam_size <= self.max_beam_size
        ):
            raise ValueError(f"beam_size={self.beam_size!r} must be an integer in [1, max_beam_size={self.max_beam_size}]")
        if self.max_texts > self.max_queue:
            raise ValueError(
                f"max_texts={self.max_texts} must be at most max_queue={self.max_queue}: a request with more "
                "texts than the queue holds could never be accepted"
            )


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """The search options of one request; only requests with equal options share a batch."""

    beam_size: int
    length_penalty: float
    max_extra_length: int


# ---------------------------------------------------------------------- #
# Engines: count tokens (for batching) and translate a batch of texts
# ---------------------------------------------------------------------- #
class OnnxRuntimeEngine:
    """`export.runtime.OnnxTranslator`: each batch is one `translate` call, so one ONNX Runtime search.

    Args:
        directory: written by `python -m export.onnx` from a preset with a tokenizer.
        threads: ONNX Runtime intra-op threads, or None (one per core).
        providers: as `OnnxSeq2Seq` (None: CUDA when it works, else CPU).
    """

    name = "onnxruntime"

    def __init__(self, directory, threads=None, providers=None):
        from export.runtime import OnnxTranslator

        self.directory = pathlib.Path(directory)
        self.translator = OnnxTranslator(directory, providers=providers, intra_op_threads=threads)
        self.max_sequence_length = self.translator.model.max_sequence_length

    def count_tokens(self, texts):
        """Source tokens of each text, end token included, at most `max_sequence_length` (longer are cut)."""
        ids = self.translator.tokenizer.encode(texts, add_start=False, add_end=True)
        return [min(len(row), self.max_sequence_length) for row in ids]

    def translate(self, texts, options):
        return self.translator.translate(
            texts, beam_size=options.beam_size, batch_size=max(len(texts), 1),
            length_penalty=options.length_penalty, max_extra_length=options.max_extra_length,
        )


class CTranslate2Engine:
    """A CTranslate2 `Translator` on the directory written by `python -m export.ctranslate2`.

    Our tokenizer's ids as CTranslate2's tokens (`shared_vocabulary.json`),
    `export.ctranslate2.translation_options` and `max_decoding_length`. One
    maximum output length per call (CTranslate2 takes one number): the
    longest source's, so a short sentence batched with a long one may
    generate beyond its own limit when it does not end earlier. The length
    penalty is CTranslate2's (see `export.ctranslate2`): greedy search gives
    the ONNX engine's tokens, beams may differ.

    Args:
        directory: written by `python -m export.ctranslate2` from a preset with a tokenizer.
        threads: CTranslate2 intra-op threads (default 1: OpenMP threads
            spin, see `export.ctranslate2`).
    """

    name = "ctranslate2"

    def __init__(self, directory, threads=None):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before ctranslate2 loads OpenMP
        import ctranslate2

        from export.ctranslate2 import VOCABULARY_FILE, max_decoding_length, read_metadata, translation_options
        from keras_transformer.tokenizer import TOKENIZER_FILENAME, Tokenizer

        self.directory = pathlib.Path(directory)
        metadata = read_metadata(self.directory)
        if not (self.directory / TOKENIZER_FILENAME).is_file():
            raise FileNotFoundError(
                f"{directory} has no {TOKENIZER_FILENAME}; export a preset directory that holds its tokenizer"
            )
        self.tokenizer = Tokenizer.load(self.directory)
        self.tokens = json.loads((self.directory / VOCABULARY_FILE).read_text(encoding="utf-8"))
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.max_sequence_length = int(metadata["max_sequence_length"])
        self._max_decoding_length = max_decoding_length
        self._translation_options = translation_options
        self.translator = ctranslate2.Translator(
            str(self.directory), device="cpu", intra_threads=threads or 1, inter_threads=1
        )

    def count_tokens(self, texts):
        ids = self.tokenizer.encode(texts, add_start=False, add_end=True)
        return [min(len(row), self.max_sequence_length) for row in ids]

    def translate(self, texts, options):
        rows = self.tokenizer.encode(texts, add_start=False, add_end=False)
        results = [""] * len(texts)
        # Empty texts translate to empty strings without a search, as Translator.translate.
        todo = [i for i, row in enumerate(rows) if row and texts[i].strip()]
        if not todo:
            return results
        limit = self.max_sequence_length - 1  # room for the end piece CTranslate2 appends
        pieces = [[self.tokens[t] for t in rows[i][:limit]] for i in todo]
        outputs = self.translator.translate_batch(
            pieces,
            max_decoding_length=self._max_decoding_length(
                max(len(row) for row in pieces), self.max_sequence_length, options.max_extra_length
            ),
            **self._translation_options(options.beam_size, options.length_penalty, self.max_sequence_length),
        )
        decoded = self.tokenizer.decode([[self.index[token] for token in output.hypotheses[0]] for output in outputs])
        for i, text in zip(todo, decoded):
            results[i] = text
        return results


def load_engine(directory, engine="onnxruntime", threads=None):
    """The translation engine for an exported directory.

    Args:
        directory: `python -m export.onnx` output (engine "onnxruntime") or
            `python -m export.ctranslate2` output (engine "ctranslate2").
        engine: one of `ENGINES`.
        threads: intra-op threads of the engine, or None (its default).

    Raises:
        FileNotFoundError, ValueError: the directory is not such an export.
    """
    if engine == "onnxruntime":
        return OnnxRuntimeEngine(directory, threads=threads)
    if engine == "ctranslate2":
        return CTranslate2Engine(directory, threads=threads)
    raise ValueError(f"engine={engine!r} must be one of {ENGINES}")


# ---------------------------------------------------------------------- #
# Metrics in the Prometheus text format
# ---------------------------------------------------------------------- #
def _label_text(labels):
    if not labels:
        return ""
    escaped = (
        (name, str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for name, value in labels
    )
    return "{" + ",".join(f'{name}="{value}"' for name, value in escaped) + "}"


class _Metric:
    def __init__(self, name, kind, help_text):
        self.name, self.kind, self.help = name, kind, help_text

    def header(self):
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A counter with labels, rendered as `name{labels} value`."""

    def __init__(self, name, help_text):
        super().__init__(name, "counter", help_text)
        self.values = {}

    def inc(self, amount=1, **labels):
        key = tuple(sorted((name, str(value)) for name, value in labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def render(self):
        return self.header() + [f"{self.name}{_label_text(key)} {value}" for key, value in sorted(self.values.items())]


class Gauge(_Metric):
    """A gauge read when rendered (`read()` gives its value)."""

    def __init__(self, name, help_text, read):
        super().__init__(name, "gauge", help_text)
        self.read = read

    def render(self):
        return self.header() + [f"{self.name} {self.read()}"]


class Histogram(_Metric):
    """A histogram with fixed upper bounds: cumulative `_bucket{le=...}`, `_sum` and `_count`."""

    def __init__(self, name, help_text, buckets):
        super().__init__(name, "histogram", help_text)
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    def render(self):
        lines, total = self.header(), 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum:.6g}", f"{self.name}_count {total}"]


class Metrics:
    """The server's counters, gauges and histograms (updated on the event loop)."""

    def __init__(self, queue_depth, in_flight, ready):
        powers = [2**i for i in range(11)]
        self.requests = Counter("kt_serve_requests_total", "HTTP requests by path and status code.")
        self.errors = Counter("kt_serve_errors_total", "Requests answered with an error, by reason.")
        self.sentences = Counter("kt_serve_sentences_total", "Sentences translated and answered.")
        self.latency = Histogram(
            "kt_serve_request_duration_seconds", "Time from the start of a translate request to its answer.",
            [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
        )
        self.batch_sentences = Histogram("kt_serve_batch_sentences", "Sentences per search.", powers[:10])
        self.batch_tokens = Histogram(
            "kt_serve_batch_tokens", "Padded source tokens (rows x longest row) per search.", [16 * p for p in powers]
        )
        self.search_seconds = Histogram(
            "kt_serve_search_duration_seconds", "Time of one search (a batch) in the worker thread.",
            [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.gauges = [
            Gauge("kt_serve_queue_sentences", "Sentences waiting for a search.", queue_depth),
            Gauge("kt_serve_requests_in_flight", "Requests being received, waiting or searched.", in_flight),
            Gauge("kt_serve_ready", "1 when the model is loaded and warm and the server is not draining.", ready),
        ]

    def render(self):
        metrics = [self.requests, self.errors, self.sentences, self.latency, self.batch_sentences,
                   self.batch_tokens, self.search_seconds, *self.gauges]
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"


# ---------------------------------------------------------------------- #
# Dynamic batching
# ---------------------------------------------------------------------- #
class QueueFull(Exception):
    """The queue has no room for a request's sentences."""


class _Job:
    """One request's sentences: its options, a future for its translations."""

    def __init__(self, texts, options, future, arrival):
        self.texts, self.options, self.future, self.arrival = texts, options, future, arrival
        self.results = [""] * len(texts)
        self.remaining = 0

    def set(self, index, text):
        self.results[index] = text
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.results)

    def fail(self, error):
        if not self.future.done():
            self.future.set_exception(error)


@dataclasses.dataclass
class _Item:
    job: _Job
    index: int
    tokens: int


class Batcher:
    """Groups the waiting sentences of all requests into searches; runs them in one worker thread.

    The oldest waiting sentence picks the options of the next batch; the
    batch takes, in arrival order, the waiting sentences with those options
    while rows x longest row stays within `max_batch_tokens` (the oldest
    always goes), once that many tokens are waiting or `max_delay_ms` after
    the oldest arrived (at once while draining). Requests with other
    options keep their place for a later batch.

    Args:
        engine: has `translate(texts, options) -> list of str`.
        settings: `ServerSettings`.
        metrics: `Metrics` (batch sizes and search times).
        executor: the worker thread (`concurrent.futures.Executor`).
    """

    def __init__(self, engine, settings, metrics, executor):
        self.engine, self.settings, self.metrics, self.executor = engine, settings, metrics, executor
        self.pending = []  # _Item, in arrival order
        self.queued = 0  # sentences in `pending`
        self.draining = False
        self._arrived = asyncio.Event()

    def submit(self, texts, tokens, options):
        """Queues the texts with `tokens > 0`; returns a job whose future gives every text's translation.

        Texts with 0 tokens (nothing to translate) get "" without a search.

        Raises:
            QueueFull: the sentences do not fit in the queue (nothing queued).
        """
        loop = asyncio.get_running_loop()
        job = _Job(texts, options, loop.create_future(), loop.time())
        items = [_Item(job, i, count) for i, count in enumerate(tokens) if count > 0]
        if self.queued + len(items) > self.settings.max_queue:
            raise QueueFull(
                f"the queue holds {self.queued} of at most {self.settings.max_queue} sentences (--max-queue); "
                f"this request has {len(items)}"
            )
        job.remaining = len(items)
        if not items:
            job.future.set_result(job.results)
            return job
        self.pending.extend(items)
        self.queued += len(items)
        self._arrived.set()
        return job

    def cancel(self, job):
        """Takes a job's waiting sentences out of the queue (its client left or its time ran out)."""
        before = len(self.pending)
        self.pending = [item for item in self.pending if item.job is not job]
        self.queued -= before - len(self.pending)
        if not job.future.done():
            job.future.cancel()

    def drain(self):
        """From now on, batches start without waiting for more sentences."""
        self.draining = True
        self._arrived.set()

    def _waiting_tokens(self, options):
        return sum(item.tokens for item in self.pending if item.job.options == options)

    def _take(self, options):
        """The next batch: waiting items with `options`, in order, within `max_batch_tokens` padded."""
        batch, longest = [], 0
        for item in self.pending:
            if item.job.options != options:
                continue
            longest_with = max(longest, item.tokens)
            if batch and (len(batch) + 1) * longest_with > self.settings.max_batch_tokens:
                break
            batch.append(item)
            longest = longest_with
        taken = {id(item) for item in batch}
        self.pending = [item for item in self.pending if id(item) not in taken]
        self.queued -= len(batch)
        return batch, len(batch) * longest

    async def run(self):
        """Forms and runs batches until cancelled."""
        loop = asyncio.get_running_loop()
        delay = self.settings.max_delay_ms / 1000
        while True:
            if not self.pending:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            first = self.pending[0]
            options = first.job.options
            remaining = first.job.arrival + delay - loop.time()
            if (
                remaining > 0
                and not self.draining
                and self._waiting_tokens(options) < self.settings.max_batch_tokens
            ):
                self._arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                continue  # the queue may have changed: look again
            batch, padded = self._take(options)
            # Jobs cancelled while their batch runs are answered by nobody; their results are dropped.
            texts = [item.job.texts[item.index] for item in batch]
            start = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.translate, texts, options)
                if len(outputs) != len(texts):
                    raise RuntimeError(f"the engine returned {len(outputs)} translations for {len(texts)} texts")
            except Exception as error:  # noqa: BLE001 - every request of the batch gets the error
                logger.exception("A search of %d sentences failed", len(batch))
                for item in batch:
                    item.job.fail(error)
                continue
            finally:
                self.metrics.search_seconds.observe(time.perf_counter() - start)
                self.metrics.batch_sentences.observe(len(batch))
                self.metrics.batch_tokens.observe(padded)
            for item, text in zip(batch, outputs):
                item.job.set(item.index, text)


# ---------------------------------------------------------------------- #
# The application
# ---------------------------------------------------------------------- #
class RequestError(Exception):
    """An answer other than 200: status, message (the JSON `error`), reason (the metric's label)."""

    def __init__(self, status, message, reason, headers=None):
        super().__init__(message)
        self.status, self.message, self.reason, self.headers = status, message, reason, headers


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _json_type(value):
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_request(body, settings):
    """`(texts, SearchOptions)` from a request body (bytes), or `RequestError` (400) naming the field.

    Example:
    >>> parse_request(b'{"text": ["A sentence."], "beam_size": 2}', ServerSettings())[0]
    ['A sentence.']
    """
    try:
        document = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(400, f"the body is not UTF-8: {error}", "bad_request") from None
    try:
        payload = json.loads(document, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError; so are huge integers
        raise RequestError(400, f"the body is not valid JSON: {error}", "bad_request") from None
    if not isinstance(payload, dict):
        raise RequestError(
            400, f'the body must be a JSON object such as {{"text": ["A sentence."]}}, received {_json_type(payload)}',
            "bad_request",
        )
    for field in payload:
        if field in NOT_YET:
            raise RequestError(
                400, f"{field} is not supported yet; this server takes {', '.join(FIELDS)}", "not_supported"
            )
        if field not in FIELDS:
            raise RequestError(400, f"unknown field {field!r}; this server takes {', '.join(FIELDS)}", "bad_request")
    if "text" not in payload:
        raise RequestError(400, "missing field 'text' (a string or an array of strings)", "bad_request")
    texts = payload["text"]
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        raise RequestError(
            400, f"text must be a string or an array of strings, received {_json_type(texts)}", "bad_request"
        )
    if len(texts) > settings.max_texts:
        raise RequestError(
            400, f"text has {len(texts)} items; the limit is {settings.max_texts} (--max-texts)", "too_many_texts"
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(400, f"text[{i}] must be a string, received {_json_type(text)}", "bad_request")
        if len(text) > settings.max_text_chars:
            raise RequestError(
                400, f"text[{i}] has {len(text)} characters; the limit is {settings.max_text_chars} (--max-text-chars)",
                "text_too_long",
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate written as a \ud800 escape
            raise RequestError(400, f"text[{i}] is not valid Unicode (a lone surrogate)", "bad_request") from None
    beam_size = payload.get("beam_size", settings.beam_size)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= settings.max_beam_size:
        number = isinstance(beam_size, (int, float)) and not isinstance(beam_size, bool)
        raise RequestError(
            400, f"beam_size must be an integer in [1, {settings.max_beam_size}] (--max-beam-size; 1 is greedy), "
            f"received {beam_size if number else _json_type(beam_size)}", "bad_request",
        )
    options = SearchOptions(beam_size, float(settings.length_penalty), int(settings.max_extra_length))
    return texts, options


class Service:
    """What the app serves: the engine, its worker thread, the batcher, the metrics, and the server's state.

    Args:
        engine: see `load_engine` (or any object with `count_tokens(texts)`
            and `translate(texts, options)`).
        settings: `ServerSettings`.
        on_fatal: called (on the event loop) when the warm-up fails; `serve`
            stops the server.
    """

    def __init__(self, engine, settings=None, on_fatal=None):
        self.engine = engine
        self.settings = settings or ServerSettings()
        self.on_fatal = on_fatal
        self.ready = False
        self.draining = False
        self.failure = None
        self.in_flight = 0
        self.lost = 0  # requests cancelled unanswered (the drain ran out of time)
        self.metrics = Metrics(
            queue_depth=lambda: self.batcher.queued if self.batcher else 0,
            in_flight=lambda: self.in_flight,
            ready=lambda: int(self.ready and not self.draining),
        )
        self.batcher = None
        self._executor = None
        self._tasks = []
        self._loop = None

    async def start(self):
        """Starts the worker thread, the batcher and the warm-up (readiness comes after it)."""
        self._loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="translate")
        self.batcher = Batcher(self.engine, self.settings, self.metrics, self._executor)
        self._tasks = [asyncio.ensure_future(self.batcher.run()), asyncio.ensure_future(self._warm_up())]

    async def _warm_up(self):
        """Translates one sentence greedily and with beams (each builds its sessions), then is ready."""
        start = time.perf_counter()
        try:
            for beam_size in sorted({1, max(2, self.settings.beam_size)}):
                beam_size = min(beam_size, self.settings.max_beam_size)
                options = SearchOptions(beam_size, float(self.settings.length_penalty), self.settings.max_extra_length)
                await self._loop.run_in_executor(self._executor, self.engine.translate, [WARM_UP_TEXT], options)
        except Exception as error:  # noqa: BLE001 - reported, and the server stops
            self.failure = f"the model failed to translate a warm-up sentence: {type(error).__name__}: {error}"
            logger.exception("The model failed to translate a warm-up sentence")
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.ready = True
        logger.info("Ready: %s engine warm in %.1f s", getattr(self.engine, "name", "the"), time.perf_counter() - start)

    def begin_drain(self):
        """Stop being ready; flush the queue. Safe to call from a signal handler."""
        self.draining = True
        if self._loop is not None and self.batcher is not None:
            self._loop.call_soon_threadsafe(self.batcher.drain)
            self._loop.call_soon_threadsafe(
                logger.info, "Draining: answering %d accepted requests, then exiting", self.in_flight
            )

    async def stop(self):
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.lost:
            logger.error("%d accepted requests were not answered within --drain-seconds", self.lost)

    # -------------------------------------------------------------- #
    async def read_body(self, request, deadline):
        """The body, within `max_body_bytes` (413) and before `deadline` (408)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError(400, f"Content-Length {declared!r} is not a number of bytes", "bad_request")
            if int(declared) > limit:
                raise RequestError(
                    413, f"the body has {int(declared)} bytes; the limit is {limit} (--max-body-bytes)", "body_too_large"
                )

        async def read():
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise RequestError(
                        413, f"the body is longer than the limit of {limit} bytes (--max-body-bytes)", "body_too_large"
                    )
            return bytes(body)

        try:
            return await asyncio.wait_for(read(), max(deadline - self._loop.time(), 0))
        except asyncio.TimeoutError:
            raise RequestError(
                408, f"the body did not arrive within {self.settings.request_timeout:g} s (--request-timeout)",
                "body_timeout",
            ) from None

    async def translate(self, request):
        """The `POST /v1/translate` handler."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse

        info = request.scope.get(_INFO, {})
        start = self._loop.time()
        deadline = start + self.settings.request_timeout
        job = None
        try:
            # While draining, requests already received are answered (only /ready turns 503).
            if not self.ready:
                why = self.failure or "the model is loading"
                raise RequestError(503, f"{why}; retry", "not_ready", {"Retry-After": str(RETRY_AFTER_SECONDS)})
            body = await self.read_body(request, deadline)
            texts, options = parse_request(body, self.settings)
            info["sentences"] = len(texts)
            tokens = [
                count if text.strip() else 0 for text, count in zip(texts, self.engine.count_tokens(texts))
            ]
            try:
                job = self.batcher.submit(texts, tokens, options)
            except QueueFull as error:
                raise RequestError(503, str(error), "queue_full", {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
            translations = await self._answer(job, request, deadline)
            self.metrics.sentences.inc(len(texts))
            return JSONResponse({"translations": translations})
        except RequestError as error:
            self.metrics.errors.inc(reason=error.reason)
            if error.reason == "disconnected":
                info["status"] = CLIENT_CLOSED
            return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)
        except ClientDisconnect:
            self.metrics.errors.inc(reason="disconnected")
            info["status"] = CLIENT_CLOSED
            return JSONResponse({"error": "the client disconnected"}, status_code=CLIENT_CLOSED)
        except asyncio.CancelledError:
            self.lost += 1
            raise
        finally:
            if job is not None and not job.future.done():
                self.batcher.cancel(job)
            self.metrics.latency.observe(self._loop.time() - start)

    async def _answer(self, job, request, deadline):
        """The job's translations; `RequestError` when the client leaves, the time runs out or the search fails."""
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait(
                {job.future, disconnected}, timeout=max(deadline - self._loop.time(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            disconnected.cancel()
        if job.future in done:
            if job.future.exception() is not None:
                error = job.future.exception()
                raise RequestError(500, f"the translation failed: {type(error).__name__}: {error}", "engine")
            return job.future.result()
        if disconnected in done:
            raise RequestError(CLIENT_CLOSED, "the client disconnected", "disconnected")
        raise RequestError(
            504, f"no translation within {self.settings.request_timeout:g} s (--request-timeout)", "timeout"
        )

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "alive"})

    async def ready_endpoint(self, request):
        from starlette.responses import JSONResponse

        if self.ready and not self.draining:
            return JSONResponse({"ready": True, "engine": getattr(self.engine, "name", None)})
        why = self.failure or ("draining" if self.draining else "loading the model")
        return JSONResponse({"error": why}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    async def metrics_endpoint(self, request):
        from starlette.responses import Response

        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _wait_for_disconnect(receive):
    """Returns when the ASGI server says the client disconnected (the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _RequestLog:
    """ASGI middleware: one log line and the request metrics per HTTP request."""

    PATHS = ("/v1/translate", "/health", "/ready", "/metrics")

    def __init__(self, app, service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info = scope[_INFO] = {"status": None, "sentences": 0}
        start = time.perf_counter()

        async def send_and_note(message):
            if message["type"] == "http.response.start" and info["status"] is None:
                info["status"] = message["status"]
            await send(message)

        self.service.in_flight += 1
        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:  # the drain ran out of time
            info["status"] = info["status"] or "cancelled"
            raise
        except Exception:  # Starlette's outermost middleware answers 500
            info["status"] = info["status"] or 500
            raise
        finally:
            self.service.in_flight -= 1
            status = info["status"] or CLIENT_CLOSED
            path = scope["path"] if scope["path"] in self.PATHS else "other"
            self.service.metrics.requests.inc(path=path, code=status)
            client = scope.get("client")
            logger.info(
                "method=%s path=%s status=%s sentences=%d ms=%.1f client=%s",
                scope["method"], scope["path"][:200], status, info["sentences"], (time.perf_counter() - start) * 1000,
                f"{client[0]}:{client[1]}" if client else "-",
            )


def create_app(engine, settings=None, on_fatal=None):
    """The ASGI application (Starlette) that serves `engine`.

    The engine is warmed up at startup (the lifespan); `/ready` answers 200
    after that. Run it with uvicorn (what `serve` does) or any ASGI server.

    Args:
        engine: from `load_engine`, or any object with `count_tokens(texts)`
            and `translate(texts, options)`.
        settings: `ServerSettings` (defaults if None).
        on_fatal: called when the warm-up fails.

    Returns:
        A Starlette app; `app.state.service` is its `Service`.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    service = Service(engine, settings, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    async def http_error(request, error):
        return JSONResponse({"error": f"{error.detail}: {request.method} {request.url.path[:200]}"},
                            status_code=error.status_code, headers=error.headers)

    async def server_error(request, error):
        return JSONResponse({"error": f"internal error: {type(error).__name__}"}, status_code=500)

    app = Starlette(
        routes=[
            Route("/v1/translate", service.translate, methods=["POST"]),
            Route("/health", service.health, methods=["GET"]),
            Route("/ready", service.ready_endpoint, methods=["GET"]),
            Route("/metrics", service.metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.service = service
    app.add_middleware(_RequestLog, service=service)
    return app


# ---------------------------------------------------------------------- #
# Running it
# ---------------------------------------------------------------------- #
def bind(host="127.0.0.1", port=8000):
    """A listening TCP socket (port 0: any free port; `sock.getsockname()[1]` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(model, engine="onnxruntime", host="127.0.0.1", port=8000, settings=None, threads=None, sock=None):
    """Serves an exported model over HTTP until SIGTERM or SIGINT; returns the exit status.

    Loads the engine (errors raise here, before binding), binds, and runs
    uvicorn with the app of `create_app`; `/ready` turns 200 after the
    warm-up. A signal drains: no new connections, every accepted request
    answered, then 0 (1 when `drain_seconds` ran out first or the warm-up
    failed).

    Args:
        model: an exported directory (see `load_engine`) or an engine object.
        engine: "onnxruntime" or "ctranslate2" (for a directory).
        host, port: where to listen (port 0: any free port, logged).
        settings: `ServerSettings`.
        threads: the engine's intra-op threads.
        sock: a bound socket to serve on instead of `host` and `port`.
    """
    import uvicorn

    settings = settings or ServerSettings()
    if isinstance(model, (str, os.PathLike)):
        model = load_engine(model, engine, threads=threads)
    status = {"code": 0}

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.begin_drain()
            super().handle_exit(sig, frame)

    def fatal():
        status["code"] = 1
        server.should_exit = True

    app = create_app(model, settings, on_fatal=fatal)
    service = app.state.service
    config = uvicorn.Config(
        app, lifespan="on", log_config=None, access_log=False, server_header=False,
        timeout_graceful_shutdown=settings.drain_seconds, limit_concurrency=settings.max_connections,
    )
    server = Server(config)
    sock = sock or bind(host, port)
    address = sock.getsockname()
    logger.info(
        "Serving %s with %s on http://%s:%d (POST /v1/translate, GET /health /ready /metrics)",
        getattr(model, "directory", model), getattr(model, "name", "an engine"), *address[:2],
    )
    # uvicorn re-raises the signal it handled once it has shut down; the
    # handlers it restores are these, so the drained server exits normally.
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if service.lost:
        status["code"] = 1
    logger.info("Stopped (exit status %d)", status["code"])
    return status["code"]


def main(argv=None):
    from keras_transformer.utils import non_negative_int, positive_float, positive_int

    defaults = ServerSettings()
    parser = argparse.ArgumentParser(
        prog="python -m export.serve",
        description="Serve an exported model over HTTP: POST /v1/translate, GET /health, /ready, /metrics.",
    )
    parser.add_argument("--model", required=True, help="directory written by python -m export.onnx (or export.ctranslate2)")
    parser.add_argument("--engine", choices=ENGINES, default="onnxruntime", help="default onnxruntime")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="default 8000; 0 picks a free port")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="engine intra-op threads (default: ONNX Runtime one per core, CTranslate2 1)")
    group = parser.add_argument_group("batching")
    group.add_argument("--max-batch-tokens", type=positive_int, default=defaults.max_batch_tokens,
                       help=f"padded source tokens per search (default {defaults.max_batch_tokens})")
    group.add_argument("--max-delay-ms", type=float, default=defaults.max_delay_ms,
                       help=f"longest wait for a batch to fill (default {defaults.max_delay_ms:g})")
    group = parser.add_argument_group("limits")
    group.add_argument("--max-queue", type=positive_int, default=defaults.max_queue,
                       help=f"sentences waiting; beyond: 503 (default {defaults.max_queue})")
    group.add_argument("--max-body-bytes", type=positive_int, default=defaults.max_body_bytes,
                       help=f"beyond: 413 (default {defaults.max_body_bytes})")
    group.add_argument("--max-texts", type=positive_int, default=defaults.max_texts,
                       help=f"texts per request; beyond: 400 (default {defaults.max_texts})")
    group.add_argument("--max-text-chars", type=positive_int, default=defaults.max_text_chars,
                       help=f"characters per text; beyond: 400 (default {defaults.max_text_chars})")
    group.add_argument("--max-beam-size", type=positive_int, default=defaults.max_beam_size,
                       help=f"largest beam_size a request may ask (default {defaults.max_beam_size})")
    group.add_argument("--request-timeout", type=positive_float, default=defaults.request_timeout,
                       help=f"seconds to an answer; 408 / 504 after (default {defaults.request_timeout:g})")
    group.add_argument("--max-connections", type=positive_int, default=defaults.max_connections,
                       help=f"open connections (default {defaults.max_connections})")
    group.add_argument("--drain-seconds", type=positive_float, default=defaults.drain_seconds,
                       help=f"on SIGTERM, time to answer accepted requests (default {defaults.drain_seconds:g})")
    group = parser.add_argument_group("search")
    group.add_argument("--beam-size", type=positive_int, default=defaults.beam_size,
                       help=f"for requests without beam_size (default {defaults.beam_size})")
    group.add_argument("--length-penalty", type=float, default=defaults.length_penalty,
                       help=f"GNMT alpha (default {defaults.length_penalty:g})")
    group.add_argument("--max-extra-length", type=non_negative_int, default=defaults.max_extra_length,
                       help=f"output tokens beyond the source length (default {defaults.max_extra_length})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    try:
        settings = ServerSettings(
            max_batch_tokens=args.max_batch_tokens, max_delay_ms=args.max_delay_ms, max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes, max_texts=args.max_texts, max_text_chars=args.max_text_chars,
            max_beam_size=args.max_beam_size, beam_size=args.beam_size, length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length, request_timeout=args.request_timeout,
            drain_seconds=args.drain_seconds, max_connections=args.max_connections,
        )
    except ValueError as error:
        parser.error(str(error).replace("_", "-"))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = load_engine(args.model, args.engine, threads=args.threads)
        sock = bind(args.host, args.port)
    except (FileNotFoundError, ValueError, ImportError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    return serve(engine, settings=settings, sock=sock)


if __name__ == "__main__":
    sys.exit(main())
