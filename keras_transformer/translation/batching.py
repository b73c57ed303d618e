"""Batches of a translation: texts checked, sorted by length into padded batches, a progress bar.

NumPy only (the ONNX Runtime server uses it too).
"""

import contextlib

import numpy as np

from keras_transformer.decoding import LENGTH_BUCKET

# Sentences per search when neither `batch_size` nor `max_batch_tokens` is given.
DEFAULT_BATCH_SIZE = 32
# Lines that `translate_iterable` and `translate_file` read, sort and translate together.
DEFAULT_WINDOW = 10_000


class _NoBar:
    """What `progress_bar` returns without a bar: counts nothing, imports nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def update(self, n=1):
        pass


def progress_bar(progress, **kwargs):
    """A tqdm bar on stderr when `progress` is true; tqdm is imported only then (it adds to a server's start-up).

    `progress` may also be the caller's own counter (anything with
    `update(n)`, such as a tqdm bar or `progress.CountProgress`), which is
    then told the sentences done and left open.
    """
    if callable(getattr(progress, "update", None)):
        return contextlib.nullcontext(progress)
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


def check_batch_limits(batch_size, max_batch_tokens):
    """Refuses a `batch_size` or `max_batch_tokens` that is neither None nor a positive integer."""
    for name, value in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer or None")


def length_batches(lengths, batch_size=None, max_batch_tokens=None):
    """Groups items into batches of similar length, longest first.

    Items are sorted by length (longest first; equal lengths keep their
    order), then cut into batches of at most `batch_size` items whose padded
    size, items x the longest length rounded up to a multiple of
    `LENGTH_BUCKET` (as the search pads sources), is at most
    `max_batch_tokens`. An item longer than `max_batch_tokens` is a batch
    of its own. With neither limit, `DEFAULT_BATCH_SIZE` items per batch.
    Rounding to the bucket keeps the number of distinct batch shapes (each
    compiled once on TensorFlow and JAX) near the number of length buckets.

    Args:
        lengths: list of int, e.g. the source tokens of each sentence.
        batch_size: int >= 1 or None, items per batch.
        max_batch_tokens: int >= 1 or None, padded tokens per batch.

    Returns:
        list of lists of indices into `lengths`; every index once.

    Example:
    >>> length_batches([3, 20, 5, 9], max_batch_tokens=32)
    [[1], [3, 2], [0]]
    """
    check_batch_limits(batch_size, max_batch_tokens)
    if batch_size is None and max_batch_tokens is None:
        batch_size = DEFAULT_BATCH_SIZE
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, start = [], 0
    while start < len(order):
        rows = len(order) - start if batch_size is None else batch_size
        if max_batch_tokens is not None:
            padded = -(-max(lengths[order[start]], 1) // LENGTH_BUCKET) * LENGTH_BUCKET
            rows = min(rows, max(1, max_batch_tokens // padded))
        batches.append(order[start: start + rows])
        start += rows
    return batches


def batch_cancelled(cancelled, batch, count):
    """`cancelled` (None, or a callable of flags per text of `count`) for the rows of one batch (text indices)."""
    if cancelled is None:
        return None

    def flags():
        found = cancelled()
        if found is None:
            return None
        found = np.asarray(found, bool)
        if found.shape != (count,):
            raise ValueError(f"cancelled() returned {found.shape[0] if found.ndim else found!r} flags for {count} texts")
        return found[batch]

    return flags


def check_texts(texts, name):
    """`texts` as a list of str (a single str is a list of one); TypeError naming the first that is not."""
    if isinstance(texts, str):
        texts = [texts]
    else:
        try:
            texts = list(texts)
        except TypeError:
            raise TypeError(f"{name} must be a str or a list of str, received {type(texts).__name__}") from None
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, received {type(text).__name__}: {text!r}")
    return texts


def check_split_sentences(split_sentences, target_prefix):
    """Refuses a `split_sentences` other than False, True or a language code, or one with a target prefix."""
    if not (split_sentences is True or (isinstance(split_sentences, str) and split_sentences.strip())):
        raise ValueError(
            f"split_sentences={split_sentences!r} must be False, True or a language code such as 'en' or 'de'"
        )
    if target_prefix is not None:
        raise ValueError(
            "split_sentences and target_prefix cannot be used together: a prefix starts one sentence's "
            "translation; split the text yourself and give each sentence its prefix"
        )


def padded(rows):
    """int32 `[len(rows), longest]`: the rows, then pad ids (0)."""
    ids = np.zeros((len(rows), max(len(row) for row in rows)), "int32")
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids
