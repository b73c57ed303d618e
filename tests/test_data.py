import gzip

import numpy as np
import pytest

from keras_transformer import data


def test_read_parallel_plain_and_gzip(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8")
    with gzip.open(tmp_path / "a.de.gz", "wt", encoding="utf-8") as f:
        f.write("eins\nzwei\n")
    assert data.read_parallel(tmp_path / "a.en", tmp_path / "a.de.gz") == (["one", "two"], ["eins", "zwei"])


def test_mismatched_line_counts_name_both_files(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n")
    (tmp_path / "a.de").write_text("eins\n")
    with pytest.raises(ValueError, match=r"a\.en has 2 lines, .*a\.de has 1"):
        data.read_parallel(tmp_path / "a.en", tmp_path / "a.de")


def test_empty_file_is_named(tmp_path):
    (tmp_path / "empty.en").write_text("")
    with pytest.raises(ValueError, match=r"empty\.en is empty"):
        data.read_lines(tmp_path / "empty.en")


def test_undecodable_bytes_name_file_and_line(tmp_path):
    (tmp_path / "bad.de").write_bytes("gut\n".encode() + b"schlecht \xff\n")
    with pytest.raises(ValueError, match=r"bad\.de, line 2: not valid UTF-8"):
        data.read_lines(tmp_path / "bad.de")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        data.read_lines(tmp_path / "nothere")


def synthetic_pairs(rng, n=300, low=4, high=40):
    lengths = rng.integers(2, 30, size=n)
    sources = [np.append(rng.integers(low, high, size=k), 3).astype("int32") for k in lengths]
    targets = [np.concatenate([[2], rng.integers(low, high, size=k + 1), [3]]).astype("int32") for k in lengths]
    return sources, targets


def test_batches_respect_the_token_budget_and_shift_labels(rng):
    sources, targets = synthetic_pairs(rng)
    dataset = data.make_dataset(sources, targets, tokens_per_batch=200, seed=1)
    seen_pairs = 0
    for inputs, labels in dataset.as_numpy_iterator():
        src, dec = inputs["encoder_token_ids"], inputs["decoder_token_ids"]
        assert src.shape[0] * src.shape[1] <= 200
        assert dec.shape[0] * (dec.shape[1] + 1) <= 200
        np.testing.assert_array_equal(dec[:, 1:], labels[:, :-1])  # labels = inputs shifted by one
        assert np.all(dec[:, 0] == 2)
        seen_pairs += src.shape[0]
    assert seen_pairs == len(sources)
    assert int(dataset.cardinality()) == sum(1 for _ in dataset)


def test_every_pair_appears_once_per_epoch(rng):
    sources, targets = synthetic_pairs(rng, n=50)
    dataset = data.make_dataset(sources, targets, tokens_per_batch=128, seed=3)
    seen = sorted(
        tuple(row[row > 0]) for inputs, _ in dataset.as_numpy_iterator() for row in inputs["encoder_token_ids"]
    )
    assert seen == sorted(tuple(s) for s in sources)


def test_budget_smaller_than_a_sequence_is_rejected(rng):
    sources, targets = synthetic_pairs(rng, n=10)
    with pytest.raises(ValueError, match="tokens_per_batch=10 is smaller than the longest sequence"):
        data.make_dataset(sources, targets, tokens_per_batch=10)


def test_encode_pairs_adds_special_ids_and_drops_long_pairs():
    class FakeTokenizer:
        """Ids 10 + word length for source text, 20 + word length for target text (`target=True`)."""

        def encode(self, texts, add_start=False, add_end=True, target=False):
            base = 20 if target else 10
            return [([2] if add_start else []) + [base + len(w) for w in t.split()] + ([3] if add_end else []) for t in texts]

    sources, targets = data.encode_pairs(FakeTokenizer(), ["a bb", "x " * 20, "c"], ["d", "e", "ff g"], max_length=6)
    assert [s.tolist() for s in sources] == [[11, 12, 3], [11, 3]]
    assert [t.tolist() for t in targets] == [[2, 21, 3], [2, 22, 21, 3]]  # the target side's own model


@pytest.mark.parametrize("repeat", [False, True])
def test_pipelines_run_without_the_autotuner_thread(rng, repeat):
    """tf.data's autotuner sleeps on a timer of up to 60 s that an iterator's destructor waits for.

    With it, the end of a Quick start's `model.fit` waited 38-56 s after the
    last step (`py-spy`: `RootDataset::Iterator::~Iterator` waiting on its
    thread). Every pipeline `make_dataset` builds, training and validation,
    turns it off.
    """
    sources, targets = synthetic_pairs(rng, n=20)
    dataset = data.make_dataset(sources, targets, tokens_per_batch=128, seed=3, repeat=repeat)
    assert dataset.options().autotune.enabled is False
    assert next(iter(dataset))[0]["encoder_token_ids"].shape[0] >= 1
