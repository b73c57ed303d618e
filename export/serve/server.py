"""Running the app: `serve` (uvicorn, signals, drain, exit status) and the command's `main`."""

import argparse
import logging
import os
import signal
import socket
import threading

from export.serve.app import create_app
from export.serve.engines import ENGINES, load_engine
from export.serve.settings import ServerSettings

# One logger for the whole server, so that `python -m export.serve` logs under one name.
logger = logging.getLogger("export.serve")


def bind(host="127.0.0.1", port=8000):
    """A listening TCP socket (port 0: any free port; `sock.getsockname()[1]` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OverflowError:  # socket's own message names no argument
        sock.close()
        raise ValueError(f"port must be 0-65535 (0: any free port), got {port}") from None
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
    from export.runtime import add_optimized_cache_arguments, optimized_cache
    from keras_transformer.utils import non_negative_int, port_number, positive_float, positive_int

    defaults = ServerSettings()
    parser = argparse.ArgumentParser(
        prog="python -m export.serve",
        description="Serve an exported model over HTTP: POST /v1/translate, GET /health, /ready, /metrics.",
    )
    parser.add_argument("--model", required=True, help="directory written by python -m export.onnx (or export.ctranslate2)")
    parser.add_argument("--engine", choices=ENGINES, default="onnxruntime", help="default onnxruntime")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="default 8000; 0 picks a free port")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="engine intra-op threads (default: ONNX Runtime one per core, CTranslate2 1)")
    add_optimized_cache_arguments(parser)
    group = parser.add_argument_group("batching")
    group.add_argument("--max-batch-tokens", type=positive_int, default=defaults.max_batch_tokens,
                       help=f"padded source tokens per search (default {defaults.max_batch_tokens})")
    group.add_argument("--max-padding", type=float, default=defaults.max_padding,
                       help=f"padded search steps over the rows' own, at most (default {defaults.max_padding:g})")
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
                       help="seconds to an answer, the largest timeout_ms; 408 / 504 after "
                            f"(default {defaults.request_timeout:g})")
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
                       help="output tokens beyond the source length, the largest a request may ask "
                            f"(default {defaults.max_extra_length})")
    group.add_argument("--patience", type=positive_float, default=defaults.patience,
                       help="beam search: stop a sentence once round(beam size x PATIENCE) hypotheses ended, as "
                            "CTranslate2 (default: the exact search, stop when no live beam can win; CTranslate2 "
                            "always stops so, with its patience, 1 unless given)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    try:
        settings = ServerSettings(
            max_batch_tokens=args.max_batch_tokens, max_padding=args.max_padding, max_delay_ms=args.max_delay_ms,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes, max_texts=args.max_texts, max_text_chars=args.max_text_chars,
            max_beam_size=args.max_beam_size, beam_size=args.beam_size, length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length, patience=args.patience, request_timeout=args.request_timeout,
            drain_seconds=args.drain_seconds, max_connections=args.max_connections,
        )
    except ValueError as error:
        parser.error(str(error).replace("_", "-"))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cache = optimized_cache(args) if args.engine == "onnxruntime" else None
        engine = load_engine(args.model, args.engine, threads=args.threads, optimized_cache=cache)
        sock = bind(args.host, args.port)
    except (FileNotFoundError, ValueError, ImportError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    return serve(engine, settings=settings, sock=sock)
