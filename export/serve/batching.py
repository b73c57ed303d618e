"""Dynamic batching: the waiting sentences of all requests, grouped by search options and language pair into searches."""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time

# One logger for the whole server, so that `python -m export.serve` logs under one name.
logger = logging.getLogger("export.serve")


class QueueFull(Exception):
    """The queue has no room for a request's sentences."""


class _Job:
    """One request's sentences: its options, target prefixes and language pair (or None), a future for its translations.

    `abandoned` turns true (on the event loop) when nobody waits for the
    answer any more; the worker thread reads it while searching. A streamed
    job (`stream`) also lists the texts in the order their results came
    (`answered`: the ones without a search first) and sets `changed` at
    each result and at the end.
    """

    def __init__(self, texts, options, future, arrival, target_prefix=None, request_id=None, stream=False,
                 languages=None, align=False):
        self.texts, self.options, self.future, self.arrival = texts, options, future, arrival
        self.target_prefix, self.request_id, self.stream, self.languages = target_prefix, request_id, stream, languages
        # What a search shares: the options, the language pair (a multilingual model's sources and forced code) and
        # whether it aligns.
        self.group = (options, languages, align)
        self.abandoned = False
        # What a text without a search (nothing to translate) gets: no translation, or no hypotheses.
        self.results = [[] if options.num_hypotheses is not None or align else "" for _ in texts]
        self.remaining = 0
        self.answered = []  # text indices, in the order their results came
        self.changed = asyncio.Event()

    def set(self, index, text):
        self.results[index] = text
        self.answered.append(index)
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.results)
        self.changed.set()

    def fail(self, error):
        if not self.future.done():
            self.future.set_exception(error)
        self.changed.set()


@dataclasses.dataclass
class _Item:
    job: _Job
    index: int
    tokens: int
    answered: bool = False  # its result is in its job (it left the search)


class Batcher:
    """Groups the waiting sentences of all requests into searches; runs them in one worker thread.

    The oldest waiting sentence picks the options (and language pair) of the next batch and
    always goes; the batch adds the waiting sentences with those options
    nearest to it in length while rows x longest row stays within
    `max_batch_tokens` and padding within `max_padding` (`_take`). It starts once that many tokens are
    waiting or `max_delay_ms` after the oldest arrived (at once while
    draining). Requests with other options keep their place for a later
    batch.

    A request that ends unanswered (its client left, its deadline passed:
    `cancel`) leaves the queue, and its sentences in the running search
    leave that search at its next step where the engine can drop rows
    (`drops_rows`: its `translate` takes `cancelled=`, a callable that
    returns None or one bool per text, true for the abandoned ones).
    A search with a streamed request's sentences reports each sentence as
    its rows leave it where the engine can (`streams_rows`: its `translate`
    takes `finished=`); otherwise its sentences come when it ends.

    Args:
        engine: has `translate(texts, options) -> list of str`.
        settings: `ServerSettings`.
        metrics: `Metrics` (batch sizes, search times, queue waits, dropped sentences).
        executor: the worker thread (`concurrent.futures.Executor`).
    """

    def __init__(self, engine, settings, metrics, executor):
        self.engine, self.settings, self.metrics, self.executor = engine, settings, metrics, executor
        self.pending = []  # _Item, in arrival order
        self.queued = 0  # sentences in `pending`
        self.draining = False
        self.running = []  # _Item: the sentences of the search under way
        self.running_dropped = 0  # of them, those whose request was abandoned
        self._arrived = asyncio.Event()

    def submit(self, texts, tokens, options, target_prefix=None, request_id=None, stream=False, languages=None,
               align=False):
        """Queues the texts with `tokens > 0`; returns a job whose future gives every text's translation.

        Texts with 0 tokens (nothing to translate) get "" (no hypotheses:
        `[]`) without a search. `target_prefix`: None, or one str or None
        per text (checked by the engine before). `request_id` names the
        request in log lines. `stream`: the job's texts are told one by
        one, as they leave the search (`_Job.answered`, `_Job.changed`).
        `languages`: None, or a multilingual model's `(source_language,
        target_language)` (checked by the engine's `with_languages` before):
        only sentences of the same pair share a search. `align`: the engine's
        `translate` is asked for alignments (`return_alignment=True`), in
        searches of their own.

        Raises:
            QueueFull: the sentences do not fit in the queue (nothing queued).
        """
        loop = asyncio.get_running_loop()
        job = _Job(texts, options, loop.create_future(), loop.time(), target_prefix, request_id, stream, languages,
                   align)
        items = [_Item(job, i, count) for i, count in enumerate(tokens) if count > 0]
        job.answered = [i for i, count in enumerate(tokens) if count <= 0]
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
        """Takes a job's sentences out of the queue and the running search (its client left or its time ran out)."""
        before = len(self.pending)
        self.pending = [item for item in self.pending if item.job is not job]
        self.queued -= before - len(self.pending)
        searching = 0 if job.abandoned else sum(item.job is job and not item.answered for item in self.running)
        job.abandoned = True
        if searching and getattr(self.engine, "drops_rows", False):
            self.running_dropped += searching
            self.metrics.dropped_sentences.inc(searching)
            logger.info("request_id=%s: %d sentences leave the running search", job.request_id, searching)
        if not job.future.done():
            job.future.cancel()

    def drain(self):
        """From now on, batches start without waiting for more sentences."""
        self.draining = True
        self._arrived.set()

    def searching_sentences(self):
        """Sentences in the running search that someone waits for (not yet answered, not dropped)."""
        return sum(not (item.answered or item.job.abandoned) for item in self.running)

    def searching_requests(self):
        """Requests with a sentence in the running search that still wait for it."""
        return len({id(item.job) for item in self.running if not (item.answered or item.job.abandoned)})

    def _finished(self, batch, loop):
        """The `finished` callable of a search of `batch` (called by the worker thread as rows leave)."""

        def told(row, result):
            loop.call_soon_threadsafe(self._answer, batch[row], result)

        return told

    @staticmethod
    def _answer(item, result):
        """Gives an item's result to its job, once (the search's `finished` and its end may both tell it)."""
        if not item.answered:
            item.answered = True
            item.job.set(item.index, result)

    def _cancelled(self, batch):
        """The `cancelled` callable of a search of `batch` (read by the worker thread after each step)."""

        def flags():
            if not self.running_dropped:  # nothing abandoned: no list per step
                return None
            return [item.job.abandoned for item in batch]

        return flags

    def _waiting_tokens(self, group):
        return sum(item.tokens for item in self.pending if item.job.group == group)

    def _take(self, group):
        """The next batch: the oldest waiting item and those with its options nearest to it in length.

        A search runs every row for as many steps as the longest row needs
        (its source length + `max_extra_length`), so the batch grows from
        the oldest item towards the waiting items of the closest source
        lengths while rows x longest row stays within `max_batch_tokens`
        and the rows' padded steps stay within `1 + max_padding` times their
        own; items of other lengths wait for a batch of their own (each
        becomes the oldest in turn, so none waits for ever).

        Returns:
            `(items in arrival order, padded tokens)`.
        """
        budget, slack, extra = self.settings.max_batch_tokens, self.settings.max_padding, group[0].max_extra_length
        eligible = [item for item in self.pending if item.job.group == group]
        by_length = sorted(eligible, key=lambda item: item.tokens)  # stable: arrival order among equals
        steps = [0]  # steps[i]: the first i rows' own steps
        for item in by_length:
            steps.append(steps[-1] + item.tokens + extra)

        def fits(low, high):
            rows, longest = high - low + 1, by_length[high].tokens
            return rows * longest <= budget and rows * (longest + extra) <= (1 + slack) * (steps[high + 1] - steps[low])

        low = high = next(i for i, item in enumerate(by_length) if item is eligible[0])
        target = eligible[0].tokens
        while True:
            candidates = []
            if low > 0 and fits(low - 1, high):
                candidates.append((target - by_length[low - 1].tokens, low - 1, high))
            if high + 1 < len(by_length) and fits(low, high + 1):
                candidates.append((by_length[high + 1].tokens - target, low, high + 1))
            if not candidates:
                break
            _, low, high = min(candidates)
        taken = {id(item) for item in by_length[low: high + 1]}
        batch = [item for item in eligible if id(item) in taken]
        self.pending = [item for item in self.pending if id(item) not in taken]
        self.queued -= len(batch)
        return batch, len(batch) * by_length[high].tokens

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
            options, languages, align = group = first.job.group
            remaining = first.job.arrival + delay - loop.time()
            if (
                remaining > 0
                and not self.draining
                and self._waiting_tokens(group) < self.settings.max_batch_tokens
            ):
                self._arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                continue  # the queue may have changed: look again
            batch, padded = self._take(group)
            now = loop.time()
            for item in batch:
                self.metrics.queue_wait.observe(now - item.job.arrival)
            # Jobs cancelled while their batch runs are answered by nobody; their results are dropped.
            texts = [item.job.texts[item.index] for item in batch]
            prefixes = [None if item.job.target_prefix is None else item.job.target_prefix[item.index] for item in batch]
            # An engine's `translate` takes `target_prefix` only where it serves prefixes, and `cancelled` where it
            # drops rows (engines.py).
            extra = {"target_prefix": prefixes} if any(prefixes) else {}
            if align:
                extra["return_alignment"] = True
            if getattr(self.engine, "drops_rows", False):
                extra["cancelled"] = self._cancelled(batch)
            if getattr(self.engine, "streams_rows", False) and any(item.job.stream for item in batch):
                extra["finished"] = self._finished(batch, loop)
            self.running, self.running_dropped = batch, 0
            start = time.perf_counter()
            try:
                # A language pair (checked when the request came) binds the engine's tokenizer for this search.
                engine = self.engine if languages is None else self.engine.with_languages(*languages)
                outputs = await loop.run_in_executor(
                    self.executor, functools.partial(engine.translate, texts, options, **extra)
                )
                if len(outputs) != len(texts):
                    raise RuntimeError(f"the engine returned {len(outputs)} translations for {len(texts)} texts")
            except Exception as error:  # noqa: BLE001 - every request of the batch gets the error
                logger.exception(
                    "A search of %d sentences failed (request_id=%s)", len(batch),
                    ",".join(dict.fromkeys(str(item.job.request_id) for item in batch)),
                )
                for item in batch:
                    item.job.fail(error)
                continue
            finally:
                self.running, self.running_dropped = [], 0
                self.metrics.search_seconds.observe(time.perf_counter() - start)
                self.metrics.batch_sentences.observe(len(batch))
                self.metrics.batch_tokens.observe(padded)
            for item, text in zip(batch, outputs):
                self._answer(item, text)
