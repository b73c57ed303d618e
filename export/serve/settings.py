"""The server's settings (`ServerSettings`) and a request's search options (`SearchOptions`).

`SearchOptions` is the search's own (`keras_transformer.search.options`),
re-exported here: a request's options are made and checked once, by
`app.parse_request`, and reach the engine's `Translator` as that one value.
"""

import dataclasses
import math

from keras_transformer.decoding import check_search_args
from keras_transformer.search.options import DEFAULTS, SearchOptions
from keras_transformer.utils import is_integer, is_real

__all__ = ["SearchOptions", "ServerSettings"]


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Batching, limits and search settings of the server (the command's options).

    Args:
        max_batch_tokens: int >= 1, padded source tokens (rows x longest
            row, end token included) per search; one sentence longer than
            this is searched alone.
        max_padding: float >= 0, how much longer than its rows' own a
            batch may run: every row of a search takes as many steps as the
            longest (source + `max_extra_length`), so a batch keeps rows x
            that within `1 + max_padding` times the sum of each row's own
            steps (0: only equal lengths share a search).
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
        max_extra_length: int >= 0, output tokens beyond the source length:
            the default and the largest a request may ask.
        patience: None (the exact beam search) or a number > 0: beam search
            stops a row once `round(beam_size * patience)` hypotheses ended
            (CTranslate2's option, 1 there by default).
        The last four default to `SearchOptions`' and are checked by its rule
        (`decoding.check_search_args`).
        request_timeout: float > 0, seconds from the start of a request to
            its answer (408 while the body is still arriving, 504 after);
            a request's `timeout_ms` may be shorter.
        drain_seconds: float > 0, how long a SIGTERM waits for accepted
            requests before cancelling them.
        max_connections: int >= 1, open connections and requests (uvicorn's
            `limit_concurrency`; beyond it uvicorn answers 503 in plain text).
    """

    max_batch_tokens: int = 2048
    max_padding: float = 0.25
    max_delay_ms: float = 5.0
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    max_texts: int = 64
    max_text_chars: int = 2000
    max_beam_size: int = 8
    beam_size: int = DEFAULTS["beam_size"]
    length_penalty: float = DEFAULTS["length_penalty"]
    max_extra_length: int = DEFAULTS["max_extra_length"]
    patience: float = DEFAULTS["patience"]
    request_timeout: float = 30.0
    drain_seconds: float = 30.0
    max_connections: int = 1024

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_queue", "max_body_bytes", "max_texts", "max_text_chars",
                     "max_beam_size", "max_connections"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        numbers = (("max_padding", False), ("max_delay_ms", False), ("request_timeout", True),
                   ("drain_seconds", True))  # (name, must be > 0)
        for name, positive in numbers:
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or (value <= 0 if positive else value < 0):
                raise ValueError(f"{name}={value!r} must be a finite number {'> 0' if positive else '>= 0'}")
        check_search_args(self.beam_size, self.length_penalty, self.max_extra_length, self.patience)
        if self.beam_size > self.max_beam_size:
            raise ValueError(f"beam_size={self.beam_size!r} must be an integer in [1, max_beam_size={self.max_beam_size}]")
        if self.max_texts > self.max_queue:
            raise ValueError(
                f"max_texts={self.max_texts} must be at most max_queue={self.max_queue}: a request with more "
                "texts than the queue holds could never be accepted"
            )
