"""The ASGI application: request parsing and limits, the translate handler, health, readiness, metrics, logging."""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid

from export.serve.batching import Batcher, QueueFull
from export.serve.engines import FEATURES
from export.serve.metrics import Metrics
from export.serve.settings import SearchOptions, ServerSettings
from keras_transformer.utils import is_integer

# One logger for the whole server, so that `python -m export.serve` logs under one name.
logger = logging.getLogger("export.serve")

# Request fields, and the engine feature (engines.FEATURES) each needs.
FIELDS = {
    "text": None, "beam_size": None, "num_hypotheses": "num_hypotheses", "target_prefix": "target_prefix",
    "sampling_topk": "sampling", "sampling_topp": "sampling", "sampling_temperature": "sampling", "seed": "sampling",
    "split_sentences": None, "max_extra_length": None, "timeout_ms": None, "stream": None,
    "source_language": None, "target_language": None, "format": "format",
}
SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SearchOptions) if FIELDS.get(f.name) == "sampling"}
RETRY_AFTER_SECONDS = 1
# The status logged for a request whose client went away before its answer (nginx's).
CLIENT_CLOSED = 499
WARM_UP_TEXT = "Hello."
_INFO = "export.serve"  # the ASGI scope key of a request's log record
# A client's X-Request-Id is kept when it is 1-128 visible ASCII characters (it goes into log lines as it is).
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
# A streamed answer (server-sent events, as OpenAI's and TGI's): its headers, its last event, and how long the error
# event of a request past its deadline may take to send (a client that reads nothing is not waited for longer).
STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
]
STREAM_DONE = b"data: [DONE]\n\n"
STREAM_ERROR_GRACE_SECONDS = 1.0


class RequestError(Exception):
    """An answer other than 200: status, message (the JSON `error`), reason (the metric's label)."""

    def __init__(self, status, message, reason, headers=None):
        super().__init__(message)
        self.status, self.message, self.reason, self.headers = status, message, reason, headers


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def warm_up_text(engine):
    """`WARM_UP_TEXT`, led by a target-language code where the engine's tokenizer requires one (multilingual Marian)."""
    tokenizer = getattr(engine, "tokenizer", None)
    codes = getattr(tokenizer, "language_codes", None)
    return f"{codes[0]} {WARM_UP_TEXT}" if codes and not hasattr(tokenizer, "with_languages") else WARM_UP_TEXT


def warm_up_engine(engine):
    """The engine the warm-up translates with: a multilingual (NLLB-200) model's bound to its first two codes."""
    tokenizer = getattr(engine, "tokenizer", None)
    if not hasattr(tokenizer, "with_languages"):
        return engine
    codes = tokenizer.language_codes
    return engine.with_languages(codes[0], codes[min(1, len(codes) - 1)])


def languages_option(payload):
    """The request's `(source_language, target_language)`, or None when it names neither; each a string (400)."""
    languages = tuple(payload.get(name) for name in ("source_language", "target_language"))
    for name, value in zip(("source_language", "target_language"), languages):
        if value is not None and not isinstance(value, str):
            raise RequestError(400, f"{name} must be a language code (a string), received {_json_type(value)}",
                               "bad_request")
    return None if languages == (None, None) else languages


def bound_engine(engine, languages):
    """`engine` for a request's language pair (`with_languages`), or `RequestError` (400) in one line naming the codes.

    A multilingual model's engine needs both languages; any other takes
    neither (an engine without `with_languages` has no language codes).
    """
    bind = getattr(engine, "with_languages", None)
    try:
        if bind is None:
            if languages is not None:
                raise ValueError("source_language / target_language: this model translates one language pair and has "
                                 "no language codes; leave them out")
            return engine
        return bind(*(languages or (None, None)))
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None


def _json_type(value):
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_request(body, settings, engine_name=None, features=FEATURES):
    """`(texts, SearchOptions, target_prefix)` from a request body (bytes), or `RequestError` (400) naming the field.

    `target_prefix` is None or one str or None per text (its tokens are the
    engine's to check). `features`: the engine's (`engines.FEATURES`); a
    field that needs another is refused with 400 naming the engine.

    Example:
    >>> parse_request(b'{"text": ["A sentence."], "beam_size": 2}', ServerSettings())[0]
    ['A sentence.']
    """
    return request_from_payload(parse_payload(body), settings, engine_name, features)


def parse_payload(body):
    """The request body (bytes) as a JSON object (a dict), or `RequestError` (400)."""
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
    return payload


def request_from_payload(payload, settings, engine_name=None, features=FEATURES):
    """`parse_request` of a body already read as a JSON object."""
    for field in payload:
        if field not in FIELDS:
            raise RequestError(400, f"unknown field {field!r}; this server takes {', '.join(FIELDS)}", "bad_request")
        if FIELDS[field] is not None and FIELDS[field] not in features:
            raise RequestError(
                400, f"{field} is not served by the {engine_name or 'this'} engine; the onnxruntime engine serves it",
                "not_supported",
            )
    if "text" not in payload:
        raise RequestError(400, "missing field 'text' (a string or an array of strings)", "bad_request")
    texts = payload["text"]
    single = isinstance(texts, str)
    if single:
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
        _check_text(text, f"text[{i}]", settings)
    target_prefix = _target_prefix(payload, texts, single, settings)
    sampling = {name: payload.get(name, default) for name, default in SAMPLING_DEFAULTS.items()}
    sampled = sampling["sampling_topk"] != 1
    # Sampling draws one token at a time: a request that samples searches with beam_size 1 unless it says otherwise.
    beam_size = payload.get("beam_size", 1 if sampled else settings.beam_size)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= settings.max_beam_size:
        number = isinstance(beam_size, (int, float)) and not isinstance(beam_size, bool)
        raise RequestError(
            400, f"beam_size must be an integer in [1, {settings.max_beam_size}] (--max-beam-size; 1 is greedy), "
            f"received {beam_size if number else _json_type(beam_size)}", "bad_request",
        )
    max_extra_length = payload.get("max_extra_length", settings.max_extra_length)
    if not is_integer(max_extra_length) or not 0 <= max_extra_length <= settings.max_extra_length:
        raise RequestError(
            400, f"max_extra_length must be an integer in [0, {settings.max_extra_length}] (--max-extra-length), "
            f"received {_number_or_type(max_extra_length)}", "bad_request",
        )
    num_hypotheses = payload.get("num_hypotheses")
    try:  # checked once, when made: SearchOptions' own one-line messages (they name the field)
        options = SearchOptions(
            beam_size, float(settings.length_penalty), int(max_extra_length), settings.patience,
            num_hypotheses, **sampling,
        )
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None
    if num_hypotheses is not None and num_hypotheses > settings.max_beam_size:  # samples: rows per text
        raise RequestError(
            400, f"num_hypotheses must be at most {settings.max_beam_size} (--max-beam-size), received {num_hypotheses}",
            "bad_request",
        )
    if not sampled:
        # Without sampling the other sampling fields change nothing: left at their defaults, the request batches
        # with the others of its options.
        options = dataclasses.replace(options, **SAMPLING_DEFAULTS)
    return texts, options, target_prefix


def _number_or_type(value):
    """A received value as a message quotes it: a number itself, anything else its JSON type."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _json_type(value)


def timeout_option(payload, settings):
    """The request's `timeout_ms` (None when not given), checked to be at most `request_timeout` (400)."""
    value = payload.get("timeout_ms")
    if value is None:
        return None
    cap = int(settings.request_timeout * 1000)
    if not is_integer(value) or not 1 <= value <= cap:
        raise RequestError(
            400, f"timeout_ms must be an integer in [1, {cap}] (--request-timeout), received {_number_or_type(value)}",
            "bad_request",
        )
    return value


def stream_option(payload):
    """The request's `stream` (False when not given): true or false, else 400."""
    value = payload.get("stream", False)
    if not isinstance(value, bool):
        raise RequestError(
            400, f"stream must be true or false, received {_json_type(value) if not isinstance(value, str) else repr(value)}",
            "bad_request",
        )
    return value


def split_sentences_option(payload, options, target_prefix):
    """The request's `split_sentences` (False, True or a language code), checked against the other fields (400)."""
    value = payload.get("split_sentences", False)
    if value is False:
        return False
    if not (value is True or (isinstance(value, str) and value.strip())):
        raise RequestError(
            400, f"split_sentences must be true, false or a language code such as \"de\", received "
            f"{_json_type(value) if not isinstance(value, str) else repr(value)}", "bad_request",
        )
    for field, given in (("target_prefix", target_prefix is not None), ("num_hypotheses", options.num_hypotheses)):
        if given:
            raise RequestError(400, f"split_sentences cannot be used with {field}", "bad_request")
    return value


def format_option(payload, options, target_prefix, streamed):
    """The request's `format` ("text" or "html"; "text" when not given), checked against the other fields (400)."""
    from keras_transformer.markup import FORMATS

    value = payload.get("format", "text")
    if value not in FORMATS:
        raise RequestError(400, f'format must be "text" or "html", received '
                           f"{_json_type(value) if not isinstance(value, str) else repr(value)}", "bad_request")
    if value == "html":  # an HTML text is several inputs (one per block), translated once each
        for field, given in (("target_prefix", target_prefix is not None), ("num_hypotheses", options.num_hypotheses),
                             ("stream", streamed)):
            if given:
                raise RequestError(400, f'format "html" cannot be used with {field}', "bad_request")
    return value


def html_pages(texts):
    """`markup.Page` of each HTML text (its units to translate), or `RequestError` (400) in the parser's one line."""
    from keras_transformer import markup

    try:
        return [markup.Page(text, f"text[{i}]") for i, text in enumerate(texts)]
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None


def _check_text(text, name, settings):
    if not isinstance(text, str):
        raise RequestError(400, f"{name} must be a string, received {_json_type(text)}", "bad_request")
    if len(text) > settings.max_text_chars:
        raise RequestError(
            400, f"{name} has {len(text)} characters; the limit is {settings.max_text_chars} (--max-text-chars)",
            "text_too_long",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a \ud800 escape
        raise RequestError(400, f"{name} is not valid Unicode (a lone surrogate)", "bad_request") from None


def _target_prefix(payload, texts, single, settings):
    """The request's `target_prefix` as one str or None per text, or None; its form checked (400)."""
    target_prefix = payload.get("target_prefix")
    if target_prefix is None:
        return None
    if single and isinstance(target_prefix, str):
        target_prefix = [target_prefix]
    if not isinstance(target_prefix, list) or len(target_prefix) != len(texts):
        raise RequestError(
            400, f"target_prefix must be an array of one string or null per text ({len(texts)}), received "
            f"{_json_type(target_prefix) if not isinstance(target_prefix, list) else f'{len(target_prefix)} items'}",
            "bad_request",
        )
    for i, prefix in enumerate(target_prefix):
        if prefix is not None:
            _check_text(prefix, f"target_prefix[{i}]", settings)
    return target_prefix if any(target_prefix) else None


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
            searching_sentences=lambda: self.batcher.searching_sentences() if self.batcher else 0,
            searching_requests=lambda: self.batcher.searching_requests() if self.batcher else 0,
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
                options = SearchOptions(
                    beam_size, float(self.settings.length_penalty), self.settings.max_extra_length,
                    self.settings.patience,
                )
                await self._loop.run_in_executor(
                    self._executor, warm_up_engine(self.engine).translate, [warm_up_text(self.engine)], options
                )
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

    def _split(self, texts, split_sentences, engine):
        """`documents.split_texts` of a request's texts (None when not asked), parts cut to `engine`'s limit."""
        if split_sentences is False:
            return None
        from keras_transformer import documents

        limit = getattr(engine, "max_sequence_length", None)
        tokenizer = getattr(engine, "tokenizer", None)

        def fits(part):  # source tokens + end id within the model's positions (count_tokens caps at the limit)
            return len(tokenizer.encode([part], add_start=False, add_end=True)[0]) <= limit

        language = documents.GENERIC_LANGUAGE if split_sentences is True else split_sentences
        try:
            return documents.split_texts(texts, language, fits=fits if None not in (limit, tokenizer) else None)
        except ValueError as error:  # the tokenizer refuses a text (a multilingual model's without its code)
            raise RequestError(400, str(error), "bad_request") from None

    async def translate(self, request):
        """The `POST /v1/translate` handler."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse

        info = request.scope.get(_INFO, {})
        start = self._loop.time()
        deadline = start + self.settings.request_timeout
        job = stream = None
        try:
            if info.get("refused_request_id"):
                raise RequestError(400, info["refused_request_id"], "bad_request")
            # While draining, requests already received are answered (only /ready turns 503).
            if not self.ready:
                why = self.failure or "the model is loading"
                raise RequestError(503, f"{why}; retry", "not_ready", {"Retry-After": str(RETRY_AFTER_SECONDS)})
            body = await self.read_body(request, deadline)
            payload = parse_payload(body)
            texts, options, target_prefix = request_from_payload(
                payload, self.settings, getattr(self.engine, "name", None), getattr(self.engine, "features", ())
            )
            timeout_ms = timeout_option(payload, self.settings)
            streamed = stream_option(payload)
            languages = languages_option(payload)
            engine = bound_engine(self.engine, languages)  # the pair's tokenizer counts, splits and checks prefixes
            pages = None
            if format_option(payload, options, target_prefix, streamed) == "html":  # the blocks' text is translated
                pages = html_pages(texts)
                texts = [unit for page in pages for unit in page.units]
            split = self._split(texts, split_sentences_option(payload, options, target_prefix), engine)
            if pages is not None:
                options = dataclasses.replace(options, num_hypotheses=1)  # hypotheses, to align
            if split is not None:
                texts = split.units  # the sentences are what the batcher and the engine see
            info["sentences"] = len(texts)
            if target_prefix is not None:
                try:  # a prefix too long for the model, or one for an empty text: this request's error only
                    # (engines.py: `encode_target_prefix`, the translator's own check)
                    engine.check_target_prefix(texts, target_prefix)
                except (ValueError, TypeError) as error:
                    raise RequestError(400, str(error), "bad_request") from None
            try:  # the tokenizer refuses a text (a multilingual model's text without its >>xx<< code)
                counts = engine.count_tokens(texts)
            except ValueError as error:
                raise RequestError(400, str(error), "bad_request") from None
            tokens = [count if text.strip() else 0 for text, count in zip(texts, counts)]
            try:
                job = self.batcher.submit(texts, tokens, options, target_prefix, info.get("request_id"), streamed,
                                          languages if engine is not self.engine else None)
            except QueueFull as error:
                raise RequestError(503, str(error), "queue_full", {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
            expired = None
            if timeout_ms is not None:  # the request's own deadline, within the server's
                deadline = min(deadline, start + timeout_ms / 1000)
                expired = RequestError(504, f"no translation within {timeout_ms} ms (timeout_ms)", "timeout")
            if streamed:  # the answer starts with the first result: until then, errors are answers of their own
                await self._answer(job, request, deadline, expired, first=True)
                stream = _EventStream(self, job, split, options, start, deadline, expired, info)
                return stream
            results = await self._answer(job, request, deadline, expired)
            self.metrics.sentences.inc(len(texts))
            if pages is not None:
                return JSONResponse({"translations": await self._html(pages, texts, results, split, engine)})
            return JSONResponse(_answer_document(results if split is None else split.join(results), options))
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
            if stream is None:  # (a stream ends, and is measured, once its events are sent)
                if job is not None and not job.future.done():
                    self.batcher.cancel(job)
                self.metrics.latency.observe(self._loop.time() - start)

    async def _html(self, pages, texts, results, split, engine):
        """The HTML of `pages` from the hypotheses of `texts` (their units, or with `split` the units' sentences)."""
        from keras_transformer import markup

        try:  # the alignment decodes each hypothesis once more: in the searches' thread, between two searches
            aligned = await self._loop.run_in_executor(self._executor, engine.align, texts, [
                found[0] if found else None for found in results])
        except ValueError as error:  # an export without the fused decoder step gives no alignments
            raise RequestError(400, f'format "html": {error}', "bad_request") from None
        return markup.render_pages(pages, aligned if split is None else markup.joined(split, aligned))

    async def _answer(self, job, request, deadline, expired=None, first=False):
        """The job's translations; `RequestError` when the client leaves, the time runs out or the search fails.

        `expired`: the error when `deadline` passes (default: `request_timeout`'s 504). `first`: return None once
        the job has its first result (a streamed job) instead of waiting for all of them.
        """
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        waited = asyncio.ensure_future(_first_result(job)) if first else job.future
        try:
            done, _ = await asyncio.wait(
                {waited, disconnected}, timeout=max(deadline - self._loop.time(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            disconnected.cancel()
            if first:
                waited.cancel()
        if waited in done:
            if job.future.done() and job.future.exception() is not None:
                raise _engine_error(job.future.exception())
            return None if first else job.future.result()
        if disconnected in done:
            raise RequestError(CLIENT_CLOSED, "the client disconnected", "disconnected")
        raise expired or RequestError(
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


def _answer_document(results, options):
    """The JSON answer: `translations`, and with `num_hypotheses` each text's `hypotheses` (text, score, log_prob)."""
    if options.num_hypotheses is None:
        return {"translations": results}
    return {"translations": [found[0].text if found else "" for found in results],
            "hypotheses": [_hypotheses_json(found) for found in results]}


def _hypotheses_json(found):
    return [{"text": h.text, "score": float(h.score), "log_prob": float(h.log_prob)} for h in found]


def _engine_error(error):
    return RequestError(500, f"the translation failed: {type(error).__name__}: {error}", "engine")


async def _first_result(job):
    """Returns once a streamed job has a result to send, or has ended (failed)."""
    while not job.answered and not job.future.done():
        job.changed.clear()
        await job.changed.wait()


class _StreamEnded(Exception):
    """A streamed answer ends early: its client left, or did not take its events before the deadline."""


class _EventStream:
    """The ASGI answer of a `"stream": true` request: server-sent events, one per sentence as its result comes.

    Each event is `data: {json}` and a blank line: `{"index": i, "sentence":
    k, "sentences": n, "translation": piece}` (with `num_hypotheses`, also
    `"hypotheses"`), where text `i`'s translation is its `n` pieces joined in
    `sentence` order: one piece without `split_sentences`; with it, one per
    sentence, holding the whitespace of the text before it (and after it, for
    the last), or the whole text (its whitespace) for a text without one. The
    events of a text come in the order its sentences leave the search. The
    last event is `data: [DONE]`; a request past its deadline or whose search
    failed ends with `data: {"error": "..."}` instead. The handler waits for
    the first result before it returns this (so errors before it are JSON
    answers of their own).

    The search never waits for the client: results wait in the job (as many
    as the request's sentences), each event is sent by the event loop
    within the request's deadline; a client that leaves, or takes no events
    until the deadline, ends the stream and its unsearched sentences leave the
    queue and the running search (`Batcher.cancel`).
    """

    def __init__(self, service, job, split, options, start, deadline, expired, info):
        self.service, self.job, self.options, self.info = service, job, options, info
        self.start, self.deadline, self.expired = start, deadline, expired
        if split is None:
            self.pieces = None
            self.literal = []
        else:
            self.pieces, self.literal = _stream_pieces(split)

    def _events(self, indices):
        """The SSE bytes of the results of the job's `indices` (units with `split_sentences`)."""
        events = []
        for index in indices:
            result = self.job.results[index]
            if self.pieces is None:
                event = {"index": index, "sentence": 0, "sentences": 1}
                if self.options.num_hypotheses is None:
                    event["translation"] = result
                else:
                    event.update(translation=result[0].text if result else "", hypotheses=_hypotheses_json(result))
            else:
                text, sentence, sentences, before, after = self.pieces[index]
                event = {"index": text, "sentence": sentence, "sentences": sentences,
                         "translation": before + result + after}
            events.append(_sse(event))
        return b"".join(events)

    async def __call__(self, scope, receive, send):
        service, job, loop = self.service, self.job, self.service._loop
        disconnected = asyncio.ensure_future(_wait_for_disconnect(receive))
        position = 0
        try:
            await self._send(send, {"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS},
                             disconnected)
            first = b"".join(_sse(event) for event in self.literal)  # texts without a sentence: complete now
            while True:
                job.changed.clear()
                answered, position = job.answered[position:], len(job.answered)
                chunk, first = first + self._events(answered), b""
                if job.future.done():  # (the results are all in once it is, unless it failed)
                    error = job.future.exception()
                    if error is not None:
                        raise _engine_error(error)
                    service.metrics.sentences.inc(len(job.texts))
                    await self._send(send, {"type": "http.response.body", "body": chunk + STREAM_DONE}, disconnected)
                    return
                if chunk:
                    await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True},
                                     disconnected)
                changed = asyncio.ensure_future(job.changed.wait())
                try:
                    done, _ = await asyncio.wait({changed, disconnected}, timeout=max(self.deadline - loop.time(), 0),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if disconnected in done:
                    raise _StreamEnded("disconnected")
                if not done:
                    raise self.expired or RequestError(
                        504, f"no translation within {service.settings.request_timeout:g} s (--request-timeout)",
                        "timeout",
                    )
        except RequestError as error:  # after the stream started: an error event, then the end
            service.metrics.errors.inc(reason=error.reason)
            with contextlib.suppress(_StreamEnded):
                await self._send(send, {"type": "http.response.body", "body": _sse({"error": error.message})},
                                 disconnected, loop.time() + STREAM_ERROR_GRACE_SECONDS)
        except _StreamEnded as ended:
            reason = str(ended)
            service.metrics.errors.inc(reason=reason)
            if reason == "disconnected":
                self.info["status"] = CLIENT_CLOSED
            logger.info("request_id=%s: the stream ended: %s", job.request_id,
                        "the client left" if reason == "disconnected" else "the client took no events in time")
        except asyncio.CancelledError:
            service.lost += 1
            raise
        finally:
            disconnected.cancel()
            if not job.future.done():
                service.batcher.cancel(job)
            service.metrics.latency.observe(loop.time() - self.start)

    async def _send(self, send, message, disconnected, deadline=None):
        """`send(message)` unless the client leaves or it does not go before `deadline` (`_StreamEnded`)."""
        loop = self.service._loop
        sending = asyncio.ensure_future(send(message))
        done, _ = await asyncio.wait({sending, disconnected}, return_when=asyncio.FIRST_COMPLETED,
                                     timeout=max((deadline or self.deadline) - loop.time(), 0))
        if sending in done:
            sending.result()
            return
        sending.cancel()
        raise _StreamEnded("disconnected" if disconnected in done else "timeout")


def _stream_pieces(split):
    """`(pieces, literal)` of a `documents.Split` for `_EventStream`.

    pieces: per unit `(text index, sentence, sentences, before, after)`;
    literal: the events of the texts without a sentence (their text as it is).
    """
    pieces, literal = {}, []
    for text, parts in enumerate(split.pieces):
        units = [part for part in parts if isinstance(part, int)]
        if not units:
            literal.append({"index": text, "sentence": 0, "sentences": 1, "translation": "".join(parts)})
            continue
        before, sentence = "", 0
        for part in parts:
            if isinstance(part, int):
                pieces[part] = [text, sentence, len(units), before, ""]
                before, sentence = "", sentence + 1
            else:
                before += part
        pieces[units[-1]][4] = before  # the text after the last sentence
    return {unit: tuple(piece) for unit, piece in pieces.items()}, literal


def _sse(event):
    """One server-sent event: `data: {json}` and a blank line (JSON escapes newlines: one line)."""
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _wait_for_disconnect(receive):
    """Returns when the ASGI server says the client disconnected (the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def request_id(scope):
    """`(id, refusal)`: the client's `X-Request-Id`, or a made-up one; refusal: None, or why the client's was refused.

    A client's id goes into log lines as it is: one header of 1 to
    `MAX_REQUEST_ID_CHARS` visible ASCII characters. Another is replaced by
    a made-up one (32 hex digits), and the refusal says why in one line.
    """
    header = REQUEST_ID_HEADER.encode()
    given = [value.decode("latin-1") for name, value in scope.get("headers", ()) if name.lower() == header]
    if len(given) == 1 and _REQUEST_ID.fullmatch(given[0]):
        return given[0], None
    made_up = uuid.uuid4().hex
    if not given:
        return made_up, None
    if len(given) > 1:
        why = f"{len(given)} X-Request-Id headers"
    elif len(given[0]) > MAX_REQUEST_ID_CHARS:
        why = f"{len(given[0])} characters"
    else:
        why = "a space or a character outside ASCII" if given[0] else "an empty value"
    limit = f"one header of 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters"
    return made_up, f"X-Request-Id must be {limit}, received {why}"


class _RequestLog:
    """ASGI middleware: one log line and the request metrics per HTTP request; its `X-Request-Id` in the answer.

    A request's id is its client's `X-Request-Id` or, without one, a made-up
    one (a client's that is not 1-128 visible ASCII characters is replaced,
    and `/v1/translate` answers 400 naming the header).
    """

    PATHS = ("/v1/translate", "/health", "/ready", "/metrics")

    def __init__(self, app, service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        identifier, refused = request_id(scope)
        info = scope[_INFO] = {"status": None, "sentences": 0, "request_id": identifier, "refused_request_id": refused}
        start = time.perf_counter()

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                if info["status"] is None:
                    info["status"] = message["status"]
                header = REQUEST_ID_HEADER.encode()
                headers = [(name, value) for name, value in message.get("headers", ()) if name.lower() != header]
                message = {**message, "headers": [*headers, (header, identifier.encode())]}
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
                "method=%s path=%s status=%s sentences=%d ms=%.1f client=%s request_id=%s",
                scope["method"], scope["path"][:200], status, info["sentences"], (time.perf_counter() - start) * 1000,
                f"{client[0]}:{client[1]}" if client else "-", identifier,
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
