"""Parallel text -> token ids -> length-bucketed tf.data batches.

The batches follow the paper (section 5.1): sentence pairs of similar length
are batched together so that each batch holds about `tokens_per_batch` source
and `tokens_per_batch` target tokens (the paper used ~25000 of each). The
same tf.data pipeline feeds the TensorFlow, JAX and PyTorch backends.
"""

import logging
import pathlib

import numpy as np

from keras_transformer import textio

logger = logging.getLogger(__name__)


def read_lines(path):
    """Lines of a UTF-8 corpus file, plain or .gz, without line endings.

    `keras_transformer.textio.read_lines` (lines end at "\\n" only), plus the
    corpus rule that a file may not be empty.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty, or a line is not valid UTF-8 (the
            message names the file and the 1-based line number).
    """
    lines = textio.read_lines(pathlib.Path(path))
    if not lines:
        raise ValueError(f"{path} is empty; a corpus file needs one sentence per line")
    return lines


def read_parallel(source_path, target_path):
    """Aligned (source, target) sentence lists from two parallel files.

    Raises:
        ValueError: the files have different line counts (both are named).
    """
    sources, targets = read_lines(source_path), read_lines(target_path)
    if len(sources) != len(targets):
        raise ValueError(
            f"Parallel files differ in length: {source_path} has {len(sources)} lines, "
            f"{target_path} has {len(targets)}. Line i of one must translate line i of the other."
        )
    return sources, targets


def encode_pairs(tokenizer, sources, targets, max_length):
    """Token ids for training: source + [end], [start] + target + [end].

    Targets are encoded with `target=True`: a tokenizer with one model per
    language (an imported `MarianTokenizer`) cuts them with the target
    language's; the shared `Tokenizer` has one for both.
    Pairs with an empty side or longer than `max_length` tokens (after the
    special ids) are dropped and counted in the log.

    Returns:
        `(source_ids, target_ids)`: lists of int32 numpy arrays.
    """
    source_tokens = tokenizer.encode(list(sources), add_start=False, add_end=True, target=False)
    target_tokens = tokenizer.encode(list(targets), add_start=True, add_end=True, target=True)
    kept_source, kept_target, dropped = [], [], 0
    for s, t in zip(source_tokens, target_tokens):
        if len(s) < 2 or len(t) < 3 or len(s) > max_length or len(t) > max_length:
            dropped += 1
            continue
        kept_source.append(np.asarray(s, "int32"))
        kept_target.append(np.asarray(t, "int32"))
    if dropped:
        logger.info("Dropped %d of %d pairs (empty or longer than %d tokens)", dropped, len(source_tokens), max_length)
    if not kept_source:
        raise ValueError(f"No sentence pair is between 1 and {max_length - 2} tokens long")
    return kept_source, kept_target


def bucket_boundaries(max_length, min_boundary=8, step=1.25):
    """Bucket upper bounds (exclusive) growing geometrically up to max_length + 1."""
    boundaries, boundary = [], min_boundary
    while boundary <= max_length:
        boundaries.append(int(boundary))
        boundary = max(boundary * step, boundary + 1)
    boundaries.append(max_length + 1)
    return sorted(set(boundaries))


def make_dataset(
    source_ids,
    target_ids,
    tokens_per_batch=25000,
    shuffle=True,
    seed=0,
    repeat=False,
    max_length=None,
):
    """A tf.data pipeline of `({"encoder_token_ids", "decoder_token_ids"}, labels)`.

    Pairs are grouped into buckets by length; a bucket whose longest pair
    has n tokens is batched `tokens_per_batch // n` pairs at a time, so every
    batch holds at most `tokens_per_batch` (padded) tokens on each side.
    Sequences are padded to the bucket's bound, which keeps the number of
    distinct batch shapes small (one compilation per shape on JAX and XLA).

    Args:
        source_ids, target_ids: lists of 1-D int arrays from `encode_pairs`
            (targets start with the start id and end with the end id).
        tokens_per_batch: int, token budget per side of a batch.
        shuffle: shuffle pairs (reshuffled each epoch) before bucketing.
        seed: shuffle seed.
        repeat: repeat forever (for step-based training).
        max_length: longest sequence; defaults to the longest given.

    Returns:
        `tf.data.Dataset`; decoder inputs are targets without the last
        token, labels are targets without the first.
    """
    try:
        import tensorflow as tf
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "Training batches sentence pairs with tf.data on every Keras backend, and TensorFlow is not "
            'installed: pip install "keras-aiayn[train]"', name="tensorflow",
        ) from error

    if len(source_ids) != len(target_ids) or not source_ids:
        raise ValueError(
            f"Need the same non-zero number of sources and targets, received "
            f"{len(source_ids)} and {len(target_ids)}"
        )
    lengths = np.maximum([len(s) for s in source_ids], [len(t) for t in target_ids])
    max_length = int(max_length or lengths.max())
    if tokens_per_batch < max_length:
        raise ValueError(
            f"tokens_per_batch={tokens_per_batch} is smaller than the longest sequence "
            f"({max_length} tokens); raise it or lower the maximum length"
        )
    boundaries = bucket_boundaries(max_length)
    # Bucket i holds lengths in [boundaries[i-1], boundaries[i]); padded to boundaries[i] - 1.
    batch_sizes = [max(1, tokens_per_batch // (b - 1)) for b in boundaries]
    batch_sizes.append(batch_sizes[-1])

    def flat(arrays):
        # All sequences in one flat tensor plus offsets: the dataset holds
        # indices and slices on the fly (no Python generator, no copies).
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype("int64")
        return tf.constant(np.concatenate(arrays).astype("int32")), tf.constant(offsets)

    source_flat, source_offsets = flat(source_ids)
    target_flat, target_offsets = flat(target_ids)

    def lookup(i):
        return (
            source_flat[source_offsets[i]:source_offsets[i + 1]],
            target_flat[target_offsets[i]:target_offsets[i + 1]],
        )

    # No model-based autotuning: its thread sleeps on a timer that doubles up to 60 s, and an iterator's
    # destructor waits for it (TF 2.21), so `model.fit` sat idle after its last step. The maps keep
    # AUTOTUNE (then the number of cores); this pipeline only slices and pads ids.
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.range(len(source_ids)).with_options(options)
    if shuffle:
        dataset = dataset.shuffle(len(source_ids), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.map(lookup, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.bucket_by_sequence_length(
        element_length_func=lambda s, t: tf.maximum(tf.shape(s)[0], tf.shape(t)[0]),
        bucket_boundaries=boundaries,
        bucket_batch_sizes=batch_sizes,
        padded_shapes=([None], [None]),
        padding_values=(0, 0),
        pad_to_bucket_boundary=True,
    )

    def split(source, target):
        inputs = {"encoder_token_ids": source, "decoder_token_ids": target[:, :-1]}
        return inputs, target[:, 1:]

    dataset = dataset.map(split, num_parallel_calls=tf.data.AUTOTUNE)
    if not repeat:
        # Bucketing hides the number of batches; counting it once lets Keras
        # show progress and end validation without an "ran out of data" warning.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(count_batches(dataset)))
    return dataset.prefetch(tf.data.AUTOTUNE)


def count_batches(dataset):
    """Number of batches in one pass over a finite dataset."""
    return int(dataset.reduce(0, lambda count, _: count + 1))


def load_wmt14(split="train", source_language="en", target_language="de"):
    """WMT14 English-German through `tensorflow-datasets` (needs internet).

    Not exercised by the tests (nothing downloads at run time there).

    Returns:
        `(sources, targets)` lists of str.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ImportError(
            "load_wmt14 needs tensorflow-datasets: pip install tensorflow-datasets"
        ) from None
    pair = "-".join(sorted((source_language, target_language)))
    dataset = tfds.load(f"wmt14_translate/{pair}", split=split, as_supervised=False)
    sources, targets = [], []
    for example in tfds.as_numpy(dataset):
        sources.append(example[source_language].decode("utf-8"))
        targets.append(example[target_language].decode("utf-8"))
    return sources, targets
