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
  `text`. The optional fields of `Translator.translate` /
  `translate_hypotheses`, as there: `target_prefix` (one string or null per
  text: the translation starts with it), `num_hypotheses` (the answer adds
  `"hypotheses"`: per text a list of `{"text", "score", "log_prob"}`, best
  first, the first being the translation), and sampling (`sampling_topk`
  != 1, `sampling_topp`, `sampling_temperature`, `seed`; beam_size then
  defaults to 1, and a text gets the same samples for the same seed in any
  batch). `max_extra_length` (at most the server's, which is the default)
  caps the request's output length (requests are batched by it as by their
  other options); `timeout_ms` (at most `request_timeout`) is the request's
  own deadline (504 past it). `return_alignment: true` adds `"alignments"`:
  per text the word links of its translation, `{"source": [start, end],
  "target": [start, end]}` character spans (`requests.alignment_json`). The
  CTranslate2 engine serves `target_prefix` and `return_alignment` but not
  `num_hypotheses` or sampling (400 naming the engine); any other field is
  refused as unknown. `"stream": true` answers with server-sent
  events instead, one per sentence as soon as it leaves the search
  (`{"index", "sentence", "sentences", "translation"}`, then `data:
  [DONE]`; the format and how it rebuilds the answer: `streaming.EventStream`,
  docs/serve.md). Every answer has an `X-Request-Id` header:
  the client's (1-128 visible ASCII characters; another is a 400 on
  `/v1/translate`) or a made-up one, also in the request's log lines.
- `GET /health`: 200 while the process runs (liveness).
- `GET /ready`: 200 once the model is loaded and has translated a warm-up
  sentence; 503 while loading and while draining (readiness).
- `GET /metrics`: Prometheus text format: requests by path and status,
  errors by reason, sentences, sentences dropped from a running search,
  request latency, queue wait, batch sizes (sentences and padded source
  tokens), search time, queue depth, requests in flight, sentences and
  requests in the running search.

Dynamic batching (`Batcher`): the sentences of all waiting requests with
equal search options (`SearchOptions`, the batching key) are translated in
one search of at most `max_batch_tokens` padded source tokens (rows x
longest row; a longer sentence goes alone), waiting at most `max_delay_ms`
after the oldest sentence arrived for a batch to fill. Requests with other
options wait for a batch of their own, so each gets the answer of its own
options. The search runs in one worker thread, off the event loop, which
keeps accepting and answering while it translates.

Limits (`ServerSettings`): request bodies over `max_body_bytes` get 413;
more than `max_texts` texts, a text or prefix over `max_text_chars`
characters, a `beam_size` outside `[1, max_beam_size]` (and as many samples
at most), a prefix the model cannot hold, malformed JSON, wrong types or
missing fields get 400; a request whose sentences do not fit in the queue
(`max_queue` sentences waiting) gets 503 with `Retry-After`, as it does
while the model loads; a body that has not arrived within `request_timeout`
gets 408 and an answer not ready by then 504. Every error is JSON
`{"error": "..."}` naming the field and the limit (and its option). A client
that disconnects is logged with status 499; its waiting sentences leave
the queue and, as those of a request past its deadline, its sentences in the
running search leave it after the current step (the ONNX Runtime engine's
step driver drops their rows; CTranslate2 runs a started batch to its end).

Shutdown: on SIGTERM (or SIGINT) the server stops accepting connections,
answers every request it has accepted (the queue is flushed at once), and
exits 0; requests still unanswered after `drain_seconds` are cancelled and
the exit status is 1. One log line per request (`logging`, logger
`export.serve`): `method=POST path=/v1/translate status=200 sentences=3
ms=41.2 client=127.0.0.1:50412 request_id=0f3c...`.

Example:

```
python -m export.serve --model exported/onnx --port 8000
curl -s localhost:8000/v1/translate -d '{"text": ["A sentence."], "beam_size": 4}'
# {"translations":["Ein Satz."]}
```

The parts: `settings.py` (`ServerSettings`, `SearchOptions`), `engines.py`
(ONNX Runtime and CTranslate2 behind `count_tokens` / `translate`),
`batching.py` (`Batcher`), `metrics.py` (Prometheus text), `requests.py`
(a request's fields, limits and errors; the answer's JSON), `streaming.py`
(server-sent events), `app.py` (the Starlette app: the service, its handlers,
the request log) and `server.py` (`serve`: uvicorn, signals, the drain; `main`).

```python
from export.serve import ServerSettings, create_app, load_engine, serve

serve("exported/onnx", port=8000, settings=ServerSettings(max_batch_tokens=4096))  # blocks; exit status
app = create_app(load_engine("exported/onnx"))   # an ASGI app for a server of your own
```
"""

from export.serve.app import RequestError, Service, create_app, parse_request
from export.serve.batching import Batcher, QueueFull
from export.serve.engines import ENGINES, CTranslate2Engine, OnnxRuntimeEngine, load_engine
from export.serve.metrics import Counter, Gauge, Histogram, Metrics
from export.serve.server import bind, main, serve
from export.serve.settings import SearchOptions, ServerSettings

__all__ = [
    "ENGINES", "Batcher", "CTranslate2Engine", "Counter", "Gauge", "Histogram", "Metrics", "OnnxRuntimeEngine",
    "QueueFull", "RequestError", "SearchOptions", "ServerSettings", "Service", "bind", "create_app", "load_engine",
    "main", "parse_request", "serve",
]
