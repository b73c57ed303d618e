"""Large inputs: token-budget batches, `Translator.translate_iterable` / `translate_file`, `--src F --output G`.

A file is streamed window by window, sorted into batches of at most
`max_batch_tokens` padded source tokens, and written in input order to a
temporary beside the output, renamed when complete. Most of this is the
framework-free Translator (stand-in engines, run once); the bundled test
split is translated by a Keras model on every backend, and by ONNX Runtime
in tests/test_export_onnx.py.
"""

import gzip
import itertools
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import BACKEND, tiny_model
from keras_transformer.datasets import bundled_paths
from keras_transformer.decoding import LENGTH_BUCKET
from keras_transformer.textio import read_lines
from keras_transformer.tokenizers.sentencepiece import train_tokenizer
from keras_transformer.translate import main as translate_main
from keras_transformer.translator import DEFAULT_BATCH_SIZE, Translator, length_batches
from test_translator import SENTENCES, CopyModel

REPO = pathlib.Path(__file__).resolve().parents[1]
# Lines with what str.splitlines() would split at, empty and blank lines, and sentences of many lengths.
LINES = list(itertools.islice(itertools.cycle(
    SENTENCES[::7] + ["", "The cat\u2028sees it.", "A dog\x85likes\x0cit.", "   ", "Nobody."]
), 70))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SENTENCES, vocabulary_size=120)


class RecordingCopy(CopyModel):
    """`CopyModel` with a `generate` of its own (no search) that records each batch's shape."""

    def __init__(self, vocabulary_size, fail_at=None):
        super().__init__(vocabulary_size)
        self.shapes, self.fail_at = [], fail_at

    def generate(self, encoder_token_ids, beam_size=4, length_penalty=0.6, max_extra_length=50):
        if self.fail_at is not None and len(self.shapes) == self.fail_at:
            raise RuntimeError("the engine failed")
        ids = np.asarray(encoder_token_ids)
        self.shapes.append(ids.shape)
        return np.concatenate([np.full((len(ids), 1), self.start_id, ids.dtype), ids], axis=1)


def _write(path, lines):
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return path


# ---------------------------------------------------------------------- #
# length_batches: the one batching of translate, translate_file and score
# ---------------------------------------------------------------------- #
def _padded(length):
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


@pytest.mark.parametrize("batch_size, max_batch_tokens", [(None, None), (5, None), (None, 100), (4, 100), (None, 3)])
def test_length_batches_respect_both_limits_longest_first(batch_size, max_batch_tokens):
    lengths = list(np.random.default_rng(0).integers(1, 60, 300))
    batches = length_batches(lengths, batch_size=batch_size, max_batch_tokens=max_batch_tokens)
    assert sorted(itertools.chain(*batches)) == list(range(300))
    flat = [lengths[i] for i in itertools.chain(*batches)]
    assert flat == sorted(lengths, reverse=True)
    for batch in batches:
        rows, longest = len(batch), max(lengths[i] for i in batch)
        assert rows <= (batch_size or (DEFAULT_BATCH_SIZE if max_batch_tokens is None else rows))
        if max_batch_tokens is not None:
            assert rows * _padded(longest) <= max_batch_tokens or rows == 1
    if max_batch_tokens is not None and batch_size is None:  # full batches: nothing left on the table
        for batch, following in zip(batches, batches[1:]):
            assert (len(batch) + 1) * _padded(lengths[batch[0]]) > max_batch_tokens


def test_translate_batches_by_tokens_and_still_by_sentences(tokenizer):
    engine = RecordingCopy(tokenizer.vocabulary_size)
    translator = Translator(engine, tokenizer)
    by_tokens = translator.translate(LINES, max_batch_tokens=48)
    assert all(rows * _padded(length) <= 48 or rows == 1 for rows, length in engine.shapes)
    engine.shapes.clear()
    assert translator.translate(LINES, batch_size=3) == by_tokens
    assert max(rows for rows, _ in engine.shapes) == 3
    engine.shapes.clear()
    translator.translate(LINES)
    assert max(rows for rows, _ in engine.shapes) == DEFAULT_BATCH_SIZE


# ---------------------------------------------------------------------- #
# Streaming
# ---------------------------------------------------------------------- #
def test_translate_iterable_reads_one_window_at_a_time(tokenizer):
    translator = Translator(RecordingCopy(tokenizer.vocabulary_size), tokenizer)
    read = []

    def source():
        for line in LINES:
            read.append(line)
            yield line

    stream = translator.translate_iterable(source(), window=9, max_batch_tokens=64)
    assert read == []  # nothing is read before the first translation is asked for
    first = [next(stream) for _ in range(9)]
    assert len(read) == 9  # one window read, translated and given back
    second = next(stream)
    assert len(read) == 18
    rest = list(stream)
    assert len(read) == len(LINES)
    assert first + [second] + rest == translator.translate(LINES)


@pytest.mark.parametrize("name", ["in.en", "in.en.gz"])
def test_translate_file_writes_every_window_in_input_order(tokenizer, tmp_path, name, capsys):
    engine = RecordingCopy(tokenizer.vocabulary_size)
    translator = Translator(engine, tokenizer)
    src, out = _write(tmp_path / name, LINES), tmp_path / "out.de"
    written = translator.translate_file(src, out, window=8, max_batch_tokens=40, progress=True)
    assert written == len(LINES)
    assert all(rows * _padded(length) <= 40 or rows == 1 for rows, length in engine.shapes)
    expected = translator.translate(LINES)
    assert read_lines(out) == expected
    assert expected[LINES.index("")] == "" and expected[LINES.index("   ")] == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "out.de"])  # no temporary left
    err = capsys.readouterr().err
    assert "Translating" in err and "sentences/s" in err and f"{len(LINES)}/{len(LINES)}" in err


def test_translate_file_compresses_a_gz_output_that_reads_back(tokenizer, tmp_path):
    translator = Translator(RecordingCopy(tokenizer.vocabulary_size), tokenizer)
    src, out = _write(tmp_path / "in.en", LINES), tmp_path / "out.de.gz"
    assert translator.translate_file(src, out, window=8) == len(LINES)
    expected = translator.translate(LINES)
    with gzip.open(out, "rt", encoding="utf-8", newline="\n") as f:  # gzip data, not text under a .gz name
        assert f.read() == "".join(line + "\n" for line in expected)
    assert read_lines(out) == expected
    # The package's own reader takes it back as input: a .gz output is a .gz input.
    assert translator.translate_file(out, tmp_path / "again.de") == len(LINES)


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("missing", FileNotFoundError, r"src_path: No such file: .*missing\.en"),
        ("directory", IsADirectoryError, r"src_path: .*dir is a directory"),
        ("binary", ValueError, r"src_path: .*blob\.bin is binary \(a NUL byte at offset 3\); expected UTF-8 text"),
        ("gzip_without_gz", ValueError, r"src_path: .*packed\.en is gzip-compressed but its name does not end in \.gz"),
        ("gz_not_gzip", ValueError, r"src_path: .*fake\.en\.gz is not a valid gzip file"),
        ("no_directory", FileNotFoundError, r"out_path: the directory of .*nowhere/out\.de does not exist"),
        ("output_is_input", ValueError, r"out_path: .*in\.en is the input file \(src_path\); write the output to"),
        ("output_exists", FileExistsError, r"out_path: .*old\.de already exists; pass overwrite=True to replace it"),
        ("output_is_a_directory", IsADirectoryError, r"out_path: .*dir is a directory"),
        ("max_batch_tokens_0", ValueError, r"max_batch_tokens=0 must be a positive integer or None"),
        ("max_batch_tokens_negative", ValueError, r"max_batch_tokens=-4 must be a positive integer or None"),
        ("max_batch_tokens_float", ValueError, r"max_batch_tokens=2\.5 must be a positive integer or None"),
        ("window_0", ValueError, r"window=0 must be a positive integer"),
        ("beam_size_0", ValueError, r"beam_size=0 must be an integer >= 1"),
    ],
)
def test_translate_file_refuses_bad_input_before_writing_anything(tokenizer, tmp_path, case, error, match):
    engine = RecordingCopy(tokenizer.vocabulary_size)
    translator = Translator(engine, tokenizer)
    src, out = _write(tmp_path / "in.en", LINES), tmp_path / "out.de"
    (tmp_path / "dir").mkdir()
    (tmp_path / "old.de").write_text("keep me\n")
    kwargs = {}
    if case == "missing":
        src = tmp_path / "missing.en"
    elif case == "directory":
        src = tmp_path / "dir"
    elif case == "binary":
        src = tmp_path / "blob.bin"
        src.write_bytes(b"abc\x00\x01\x02 sentence\n")
    elif case == "gzip_without_gz":
        src = tmp_path / "packed.en"
        src.write_bytes(gzip.compress(b"A sentence.\n"))
    elif case == "gz_not_gzip":
        src = tmp_path / "fake.en.gz"
        src.write_text("A sentence.\n")
    elif case == "no_directory":
        out = tmp_path / "nowhere" / "out.de"
    elif case == "output_is_input":
        out = tmp_path / "dir" / ".." / "in.en"  # the same file, spelled differently
    elif case == "output_exists":
        out = tmp_path / "old.de"
    elif case == "output_is_a_directory":
        out = tmp_path / "dir"
    elif case.startswith("max_batch_tokens"):
        kwargs["max_batch_tokens"] = {"0": 0, "negative": -4, "float": 2.5}[case.split("_")[-1]]
    elif case == "window_0":
        kwargs["window"] = 0
    elif case == "beam_size_0":
        kwargs["beam_size"] = 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(error, match=match) as raised:
        translator.translate_file(src, out, **kwargs)
    assert "\n" not in str(raised.value)
    assert engine.shapes == []  # nothing was translated
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not (tmp_path / "nowhere").exists()


def test_a_bad_line_or_a_failing_engine_mid_file_writes_nothing(tokenizer, tmp_path):
    src = tmp_path / "in.en"
    src.write_bytes("".join(line + "\n" for line in LINES[:30]).encode() + b"bad \xff byte\n")
    out = tmp_path / "out.de"
    out.write_text("the old translation\n")
    translator = Translator(RecordingCopy(tokenizer.vocabulary_size), tokenizer)
    with pytest.raises(ValueError, match=r"in\.en, line 31: not valid UTF-8"):
        translator.translate_file(src, out, window=8, overwrite=True)
    failing = Translator(RecordingCopy(tokenizer.vocabulary_size, fail_at=3), tokenizer)
    with pytest.raises(RuntimeError, match="the engine failed"):
        failing.translate_file(_write(tmp_path / "good.en", LINES), out, window=8, batch_size=2, overwrite=True)
    assert out.read_text() == "the old translation\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.en", "in.en", "out.de"]


KILLED_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[4])
import numpy as np
from keras_transformer.tokenizers.sentencepiece import load_tokenizer
from keras_transformer.translator import Translator

class SlowCopy:
    pad_id, unk_id, start_id, end_id = 0, 1, 2, 3
    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size
    def generate(self, ids, **search):
        open(sys.argv[3], "a").write("batch\\n")
        time.sleep(0.2)
        return np.concatenate([np.full((len(ids), 1), 2, ids.dtype), ids], axis=1)

tokenizer = load_tokenizer(sys.argv[5])
Translator(SlowCopy(tokenizer.vocabulary_size), tokenizer).translate_file(sys.argv[1], sys.argv[2], window=4,
                                                                          batch_size=2)
"""


@pytest.mark.slow
def test_a_killed_run_leaves_no_output_and_the_next_run_clears_its_temporary(tokenizer, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    src, out, marker = _write(work / "in.en", LINES), work / "out.de", tmp_path / "batches"
    tokenizer.save(tmp_path / "tokenizer")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(src), str(out), str(marker), str(REPO),
                                str(tmp_path / "tokenizer")], env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        # Killed after several windows were written to the temporary.
        while not (marker.is_file() and marker.read_text().count("batch") >= 6):
            assert process.poll() is None, "the translation ended before it was killed"
            assert time.monotonic() < deadline, "no batch was translated in time"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    names = sorted(p.name for p in work.iterdir())
    assert "out.de" not in names
    (temporary,) = [name for name in names if name != "in.en"]
    assert re.fullmatch(r"\.out\.de\.tmp-\d+-[0-9a-f]{32}", temporary)
    translator = Translator(RecordingCopy(tokenizer.vocabulary_size), tokenizer)
    assert translator.translate_file(src, out) == len(LINES)
    assert sorted(p.name for p in work.iterdir()) == ["in.en", "out.de"]
    assert read_lines(out) == translator.translate(LINES)


# ---------------------------------------------------------------------- #
# python -m keras_transformer.translate --src F --output G
# ---------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def preset(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("translate-file") / "preset"
    tiny_model(vocabulary_size=tokenizer.vocabulary_size, seed=3).save_to_preset(directory, tokenizer=tokenizer)
    return str(directory)


def test_translate_cli_streams_src_to_output_or_stdout(preset, tokenizer, tmp_path, capsys, monkeypatch):
    engine = RecordingCopy(tokenizer.vocabulary_size)
    translator = Translator(engine, tokenizer)
    # The command's plumbing, with a stand-in engine (loading a preset is tested in test_translator.py).
    monkeypatch.setattr(Translator, "from_preset", classmethod(lambda cls, name, quantize=None: translator))
    lines = LINES[:9]
    src, out = _write(tmp_path / "in.en.gz", lines), tmp_path / "out.de"
    search = ["--beam-size", "1", "--max-extra-length", "2"]
    translate_main(["--preset", preset, "--src", str(src), "--output", str(out), "--max-batch-tokens", "64",
                    "--window", "5", "--no-progress", *search])
    assert all(rows * _padded(length) <= 64 or rows == 1 for rows, length in engine.shapes)
    expected = translator.translate(lines, beam_size=1, max_extra_length=2)
    assert read_lines(out) == expected
    assert f"Wrote {len(lines)} lines to {out}" in capsys.readouterr().err
    translate_main(["--preset", preset, "--input", str(src), "--batch-size", "5", "--no-progress", *search])
    assert capsys.readouterr().out.split("\n")[:-1] == expected


@pytest.mark.parametrize(
    "case, match",
    [
        ("max_batch_tokens_0", r"argument --max-batch-tokens: must be a positive integer \(>= 1\), got 0"),
        ("no_directory", r"--output: the directory of .*nowhere/out\.de does not exist .*; create it first"),
        ("output_is_src", r"--output: .*in\.en is the input file \(--src\); write the output to another file"),
        ("binary_src", r"--src: .*blob\.en is binary \(a NUL byte at offset 0\)"),
        ("missing_src", r"--src: No such file: .*missing\.en"),
    ],
)
def test_translate_cli_refuses_bad_files_in_one_line(preset, tmp_path, capsys, case, match):
    src = _write(tmp_path / "in.en", LINES[:3])
    (tmp_path / "blob.en").write_bytes(b"\x00\x00")
    args = {
        "max_batch_tokens_0": ["--src", str(src), "--max-batch-tokens", "0"],
        "no_directory": ["--src", str(src), "--output", str(tmp_path / "nowhere" / "out.de")],
        "output_is_src": ["--src", str(src), "--output", str(src)],
        "binary_src": ["--src", str(tmp_path / "blob.en"), "--output", str(tmp_path / "out.de")],
        "missing_src": ["--src", str(tmp_path / "missing.en")],
    }[case]
    with pytest.raises(SystemExit) as error:
        translate_main(["--preset", preset, *args])
    err = capsys.readouterr().err
    assert error.value.code == 2 and "Traceback" not in err
    assert re.search(match, err.strip().split("\n")[-1]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.en", "in.en"]


# ---------------------------------------------------------------------- #
# Memory stays flat (benchmarks/translate_file_memory.py)
# ---------------------------------------------------------------------- #
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_memory_stays_flat_from_20k_to_200k_lines(tmp_path):
    """Peak RSS of a stand-in engine's translate_file, fresh processes; reading the file whole grows by ~200 MB."""
    memory = pytest.importorskip("benchmarks.translate_file_memory")
    small, large = memory.measure([20_000, 200_000], work=tmp_path)
    assert (small["lines"], large["lines"]) == (20_000, 200_000)
    assert large["growth_mb"] < small["growth_mb"] + 25, (small, large)
    assert large["peak_rss_translating_mb"] < small["peak_rss_translating_mb"] + 25, (small, large)


# ---------------------------------------------------------------------- #
# The bundled test split, translated by a Keras model on every backend
# ---------------------------------------------------------------------- #
def test_bundled_test_split_translate_file_equals_translate_of_its_lines(tmp_path):
    src = bundled_paths("test")[0]
    lines = read_lines(src)
    assert len(lines) == 946
    # The whole split on TensorFlow; reading, windows, sorting and writing are the same Python on every backend,
    # so the others translate its first 150 lines (the eager PyTorch search is ~7x slower; JAX took 49-63 s for
    # the whole split in the suite, in the longer of its two lanes).
    if BACKEND != "tensorflow":
        lines = lines[:150]
        src = _write(tmp_path / "test.en", lines)
    tokenizer = train_tokenizer(lines, vocabulary_size=400)
    translator = Translator(tiny_model(vocabulary_size=tokenizer.vocabulary_size, max_sequence_length=128), tokenizer)
    search = dict(beam_size=1, max_extra_length=2, max_batch_tokens=16384)
    expected = translator.translate(lines, **search)
    assert translator.translate_file(src, tmp_path / "test.de", **search) == len(lines)
    assert read_lines(tmp_path / "test.de") == expected
