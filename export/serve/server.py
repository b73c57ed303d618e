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
from keras_transformer.utils import non_negative_int, port_number, positive_float, positive_int

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


# The command's flags for `ServerSettings`: (group, field, type, help); the flag is the field's name with dashes,
# its default the field's, and a help ending in "default" is followed by it.
_SETTING_FLAGS = (
    ("batching", "max_batch_tokens", positive_int, "padded source tokens per search (default"),
    ("batching", "max_padding", float, "padded search steps over the rows' own, at most (default"),
    ("batching", "max_delay_ms", float, "longest wait for a batch to fill (default"),
    ("limits", "max_queue", positive_int, "sentences waiting; beyond: 503 (default"),
    ("limits", "max_body_bytes", positive_int, "beyond: 413 (default"),
    ("limits", "max_texts", positive_int, "texts per request; beyond: 400 (default"),
    ("limits", "max_text_chars", positive_int, "characters per text; beyond: 400 (default"),
    ("limits", "max_beam_size", positive_int, "largest beam_size a request may ask (default"),
    ("limits", "request_timeout", positive_float, "seconds to an answer, the largest timeout_ms; 408 / 504 after "
     "(default"),
    ("limits", "max_connections", positive_int, "open connections (default"),
    ("limits", "drain_seconds", positive_float, "on SIGTERM, time to answer accepted requests (default"),
    ("search", "beam_size", positive_int, "for requests without beam_size (default"),
    ("search", "length_penalty", float, "GNMT alpha (default"),
    ("search", "max_extra_length", non_negative_int, "output tokens beyond the source length, the largest a "
     "request may ask (default"),
    ("search", "patience", positive_float, "beam search: stop a sentence once round(beam size x PATIENCE) "
     "hypotheses ended, as CTranslate2 (default: the exact search, stop when no live beam can win; CTranslate2 "
     "always stops so, with its patience, 1 unless given)"),
)


def _add_setting_arguments(parser, defaults):
    """The flags of `_SETTING_FLAGS`, in their groups, with `defaults`' (a `ServerSettings`) values."""
    groups = {}
    for group, name, kind, text in _SETTING_FLAGS:
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        default = getattr(defaults, name)
        if text.endswith("(default"):
            text = f"{text} {default:g})" if isinstance(default, float) else f"{text} {default})"
        groups[group].add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                                   help=text)


def main(argv=None):
    from export.runtime import add_optimized_cache_arguments, optimized_cache

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
    _add_setting_arguments(parser, defaults)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    try:
        settings = ServerSettings(**{name: getattr(args, name) for _, name, _, _ in _SETTING_FLAGS})
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
