"""Training progress in the user's units: optimizer steps out of the total, passes over the data.

`model.fit` counts "epochs" and batches; `run_training` runs one fit epoch per
checkpoint interval (the resume points), so Keras' own display would read
`Epoch 1/29 ... 100/100` for a run asked for 18 passes over the data. This
callback shows what was asked for instead. `CountProgress` shows the stages
after `fit` (the validation loss and BLEU) in batches and sentences.
"""

import logging
import sys
import time

import keras

logger = logging.getLogger(__name__)


def format_duration(seconds):
    """`H:MM:SS` (or `M:SS` under an hour) of a number of seconds; "?" when unknown."""
    if seconds is None:
        return "?"
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def _close_bar(owner):
    """Ends `owner`'s tqdm bar and the logging redirection opened with it (both None when lines are logged)."""
    if owner._redirect is not None:
        owner._redirect.__exit__(None, None, None)
        owner._redirect = None
    if owner._bar is not None:
        owner._bar.close()
        owner._bar = None


class TrainingProgress(keras.callbacks.Callback):
    """Shows training progress in optimizer steps, with an ETA, and a line per checkpoint.

    The step is read from `optimizer.iterations`, which counts updates (under
    gradient accumulation, one per `gradient_accumulation_steps` batches).
    Shown: the step out of `total_steps`, the elapsed time and the time left
    (measured from the first step of this run, so a resumed run and the
    compilation of the first step do not skew it), the pass over the
    training data (`step * accumulation / batches_per_pass`), the loss (the
    mean over the current checkpoint interval, as Keras reports it) and the
    learning rate the optimizer uses.

    At the end of each `fit` epoch (one checkpoint interval in
    `run_training`) one line is logged (INFO, logger
    `keras_transformer.progress`) with the validation loss when there is one.
    With `bar=True`, a `tqdm` bar shows the same between those lines.

    Args:
        total_steps: int, optimizer steps of the whole run (all fit epochs).
        batches_per_pass: int, batches in one pass over the training data.
        checkpoint_every: optional int; lines at a step that is a multiple
            of it say "checkpoint at step ..." (`PeriodicCheckpoint` saves
            there), others (a run stopped early) just "step ...".
        bar: bool, draw a progress bar (default: when stderr is a terminal).

    Example:
    >>> progress = TrainingProgress(total_steps=2900, batches_per_pass=161, checkpoint_every=100)
    >>> model.fit(data, epochs=29, steps_per_epoch=100, callbacks=[progress], verbose=0)
    ... INFO keras_transformer.progress: checkpoint at step 100/2900 (3%): pass 0.6/18.0, loss 6.1234, ...
    """

    def __init__(self, total_steps, batches_per_pass, checkpoint_every=None, bar=None):
        super().__init__()
        if total_steps < 1 or batches_per_pass < 1:
            raise ValueError(
                f"total_steps={total_steps} and batches_per_pass={batches_per_pass} must be positive"
            )
        self.total_steps = int(total_steps)
        self.batches_per_pass = int(batches_per_pass)
        self.checkpoint_every = checkpoint_every
        self.bar = sys.stderr.isatty() if bar is None else bool(bar)
        self._bar = None
        self._redirect = None
        self._first = None  # (step, time) at the end of the first batch of this run
        self._last_refresh = 0.0

    # What the user asked about.
    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _learning_rate(self):
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _passes(self, step):
        accumulation = getattr(self.model.optimizer, "gradient_accumulation_steps", None) or 1
        return step * accumulation / self.batches_per_pass

    def _timing(self, step):
        """`(elapsed seconds, seconds left or None)` of this run at `step`."""
        now = time.monotonic()
        elapsed = now - self._started
        if self._first is None or step <= self._first[0]:
            return elapsed, None
        first_step, first_time = self._first
        per_step = (now - first_time) / (step - first_step)
        return elapsed, per_step * max(self.total_steps - step, 0)

    def summary(self, step, logs=None):
        """The progress line at `step`: step, pass, loss (and val_loss), lr, elapsed, ETA."""
        logs = logs or {}
        passes = self._passes(self.total_steps)
        digits = 1 if passes >= 1 else 2
        parts = [f"pass {self._passes(step):.{digits}f}/{passes:.{digits}f}"]
        for name in ("loss", "val_loss"):
            if logs.get(name) is not None:
                parts.append(f"{name} {float(logs[name]):.4f}")
        parts.append(f"lr {self._learning_rate():.2e}")
        elapsed, left = self._timing(step)
        percent = 100 * step // self.total_steps
        return (
            f"step {step}/{self.total_steps} ({percent}%): {', '.join(parts)}; "
            f"{format_duration(elapsed)} elapsed, ETA {format_duration(left)}"
        )

    # Keras hooks.
    def on_train_begin(self, logs=None):
        self._started = time.monotonic()
        self._first = None
        if self.bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            step = self._step()  # after BackupAndRestore when it runs first
            self._bar = tqdm(
                total=self.total_steps,
                initial=step,
                unit="step",
                dynamic_ncols=True,
                bar_format="step {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}",
            )
            # Log lines are written above the bar rather than through it.
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        if self._first is None:
            self._first = (self._step(), now)
        if self._bar is not None and now - self._last_refresh >= 0.5:
            self._last_refresh = now
            self._update_bar(self._step(), logs)

    def on_epoch_end(self, epoch, logs=None):
        step = self._step()
        if self._bar is not None:
            self._update_bar(step, logs)
        checkpoint = bool(self.checkpoint_every) and step > 0 and step % self.checkpoint_every == 0
        logger.info("%s%s", "checkpoint at " if checkpoint else "", self.summary(step, logs))

    def _update_bar(self, step, logs):
        logs = logs or {}
        postfix = f"pass {self._passes(step):.2f}"
        if logs.get("loss") is not None:
            postfix += f", loss {float(logs['loss']):.4f}"
        self._bar.set_postfix_str(f"{postfix}, lr {self._learning_rate():.2e}", refresh=False)
        self._bar.update(step - self._bar.n)

    def on_train_end(self, logs=None):
        _close_bar(self)


class CountProgress:
    """Progress of a loop over a known number of items (batches, sentences): a tqdm bar or logged lines.

    For the stages outside `fit` that take minutes on a large model (the
    validation loss and BLEU at the end of `run_training`). With `bar`, a
    `tqdm` bar on stderr; without, a line logged (INFO, logger
    `keras_transformer.progress`) at most every `every_seconds`. Either way
    a last line says how many items took how long. `update(n)` is what
    `Translator.translate(progress=...)` calls, so an instance counts the
    sentences of a translation as they are done.

    Args:
        description: str, what is counted, e.g. "validation BLEU".
        total: int, the number of items (None: unknown, no ETA).
        unit: str, e.g. "sentences".
        bar: bool, draw a progress bar (default: when stderr is a terminal).
        every_seconds: float, the least time between two logged lines.

    Example:
    >>> with CountProgress("validation BLEU", total=469, unit="sentences", bar=False) as progress:
    ...     translator.translate(sources, progress=progress)
    ... INFO keras_transformer.progress: validation BLEU: 64/469 sentences (13%), 0:31 elapsed, ETA 3:16
    ... INFO keras_transformer.progress: validation BLEU: 469 sentences in 3:49
    """

    def __init__(self, description, total, unit, bar=None, every_seconds=30.0):
        if total is not None and total < 0:
            raise ValueError(f"total={total} must be None or >= 0")
        self.description = description
        self.total = total
        self.unit = unit
        self.bar = sys.stderr.isatty() if bar is None else bool(bar)
        self.every_seconds = float(every_seconds)
        self.done = 0
        self._bar = None
        self._redirect = None
        self._started = self._last_line = None

    def __enter__(self):
        self._started = self._last_line = time.monotonic()
        if self.bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=self.total, desc=self.description, unit=f" {self.unit}", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        else:
            logger.info("%s", self.summary(self._started))
        return self

    def update(self, n=1):
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_seconds and (self.total is None or self.done < self.total):
            self._last_line = now
            logger.info("%s", self.summary(now))

    def summary(self, now=None):
        """`DESCRIPTION: DONE/TOTAL UNIT (P%), ELAPSED elapsed, ETA LEFT` (without TOTAL: no percentage, no ETA)."""
        elapsed = (now if now is not None else time.monotonic()) - self._started
        if not self.total:
            return f"{self.description}: {self.done} {self.unit}, {format_duration(elapsed)} elapsed"
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        return (f"{self.description}: {self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%), "
                f"{format_duration(elapsed)} elapsed, ETA {format_duration(left)}")

    def __exit__(self, exc_type, exc_value, traceback):
        _close_bar(self)
        if exc_type is None:
            elapsed = time.monotonic() - self._started
            logger.info("%s: %d %s in %s", self.description, self.done, self.unit, format_duration(elapsed))
        return False


class BatchCounter(keras.callbacks.Callback):
    """Counts `evaluate`'s batches on a `CountProgress` (`model.evaluate(..., callbacks=[BatchCounter(p)])`)."""

    def __init__(self, progress):
        super().__init__()
        self.progress = progress

    def on_test_batch_end(self, batch, logs=None):
        self.progress.update(1)
