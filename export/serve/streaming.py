"""A streamed answer (`"stream": true`): server-sent events, one per sentence as soon as it leaves the search."""

import asyncio
import contextlib
import json
import logging

from export.serve.requests import CLIENT_CLOSED, RequestError, engine_error, hypotheses_json

logger = logging.getLogger("export.serve")

# event of a request past its deadline may take to send (a client that reads nothing is not waited for longer).
STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
]
STREAM_DONE = b"data: [DONE]\n\n"
STREAM_ERROR_GRACE_SECONDS = 1.0

async def first_result(job):
    """Returns once a streamed job has a result to send, or has ended (failed)."""
    while not job.answered and not job.future.done():
        job.changed.clear()
        await job.changed.wait()


class _StreamEnded(Exception):
    """A streamed answer ends early: its client left, or did not take its events before the deadline."""


class EventStream:
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
                    event.update(translation=result[0].text if result else "", hypotheses=hypotheses_json(result))
            else:
                text, sentence, sentences, before, after = self.pieces[index]
                event = {"index": text, "sentence": sentence, "sentences": sentences,
                         "translation": before + result + after}
            events.append(_sse(event))
        return b"".join(events)

    async def __call__(self, scope, receive, send):
        service, job, loop = self.service, self.job, self.service._loop
        disconnected = asyncio.ensure_future(wait_for_disconnect(receive))
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
                        raise engine_error(error)
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
    """`(pieces, literal)` of a `documents.Split` for `EventStream`.

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


async def wait_for_disconnect(receive):
    """Returns when the ASGI server says the client disconnected (the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
