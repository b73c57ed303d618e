"""The ASGI application: the service (worker, batcher, warm-up, drain), its handlers, the request log, `create_app`.

A request's parsing and limits are in `requests.py`, a streamed answer in
`streaming.py`; their names are also importable from here.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time

from export.serve.batching import Batcher, QueueFull
from export.serve.metrics import Metrics
from export.serve.requests import (  # noqa: F401 - the names importable from here before requests.py
    CLIENT_CLOSED, FIELDS, MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER, SAMPLING_DEFAULTS, Request, RequestError,
    answer_document, bound_engine, engine_error, hypotheses_json, languages_option, parse_payload, parse_request,
    read_request, request_from_payload, request_id, split_sentences_option, stream_option, timeout_option,
)
from export.serve.requests import html_pages
from export.serve.settings import SearchOptions, ServerSettings
from export.serve.streaming import (  # noqa: F401 - as above, before streaming.py
    STREAM_DONE, STREAM_ERROR_GRACE_SECONDS, STREAM_HEADERS, EventStream, first_result, wait_for_disconnect,
)

# One logger for the whole server, so that `python -m export.serve` logs under one name.
logger = logging.getLogger("export.serve")

RETRY_AFTER_SECONDS = 1
WARM_UP_TEXT = "Hello."
_INFO = "export.serve"  # the ASGI scope key of a request's log record


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


def html_answer(pages, results, split=None):
    """The HTML of `pages` from their units' aligned hypotheses (`results`; with `split`, the units' sentences')."""
    from keras_transformer.documents import markup

    best = [found[0] if found else None for found in results]
    return markup.render_pages(pages, best if split is None else markup.joined(split, best))


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

    @staticmethod
    def _source_tokens(engine, texts, target_prefix):
        """Each text's source tokens (0 for a blank one), or `RequestError` (400) for a text or prefix refused."""
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
        return [count if text.strip() else 0 for text, count in zip(texts, counts)]

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
            payload = parse_payload(await self.read_body(request, deadline))
            asked = read_request(
                payload, self.settings, getattr(self.engine, "name", None), getattr(self.engine, "features", ())
            )
            engine = bound_engine(self.engine, asked.languages)  # the pair's tokenizer counts, splits, checks prefixes
            pages = html_pages(asked.texts) if asked.format == "html" else None  # the blocks' text is translated
            if pages is not None:  # the units' best hypotheses with their word alignments, aligned in the search
                asked = dataclasses.replace(asked, texts=[unit for page in pages for unit in page.units],
                                            return_alignment=True)
            split = self._split(asked.texts, asked.split_sentences, engine)
            texts = asked.texts if split is None else split.units  # the sentences are what the batcher and engine see
            info["sentences"] = len(texts)
            tokens = self._source_tokens(engine, texts, asked.target_prefix)
            if asked.return_alignment:
                try:  # an export without the fused step, or a server without the onnx package
                    engine.check_alignment()
                except ValueError as error:
                    prefix = 'format "html": ' if pages is not None else ""
                    raise RequestError(400, f"{prefix}{error}", "not_supported") from None
            try:
                job = self.batcher.submit(texts, tokens, asked.options, asked.target_prefix, info.get("request_id"),
                                          asked.stream, asked.languages if engine is not self.engine else None,
                                          asked.return_alignment)
            except QueueFull as error:
                raise RequestError(503, str(error), "queue_full", {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
            expired = None
            if asked.timeout_ms is not None:  # the request's own deadline, within the server's
                deadline = min(deadline, start + asked.timeout_ms / 1000)
                expired = RequestError(504, f"no translation within {asked.timeout_ms} ms (timeout_ms)", "timeout")
            if asked.stream:  # the answer starts with the first result: until then, errors are answers of their own
                await self._answer(job, request, deadline, expired, first=True)
                stream = EventStream(self, job, split, asked.options, start, deadline, expired, info)
                return stream
            results = await self._answer(job, request, deadline, expired)
            self.metrics.sentences.inc(len(texts))
            if pages is not None:
                return JSONResponse({"translations": html_answer(pages, results, split)})
            return JSONResponse(answer_document(results if split is None else split.join(results), asked.options,
                                                asked.return_alignment))
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

    async def _answer(self, job, request, deadline, expired=None, first=False):
        """The job's translations; `RequestError` when the client leaves, the time runs out or the search fails.

        `expired`: the error when `deadline` passes (default: `request_timeout`'s 504). `first`: return None once
        the job has its first result (a streamed job) instead of waiting for all of them.
        """
        disconnected = asyncio.ensure_future(wait_for_disconnect(request.receive))
        waited = asyncio.ensure_future(first_result(job)) if first else job.future
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
                raise engine_error(job.future.exception())
            return None if first else job.future.result()
        if disconnected in done:
            raise RequestError(CLIENT_CLOSED, "the client disconnected", "disconnected")
        raise expired or self.timed_out()

    def timed_out(self):
        """The 504 of a request past the server's `request_timeout`."""
        return RequestError(504, f"no translation within {self.settings.request_timeout:g} s (--request-timeout)",
                            "timeout")

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
