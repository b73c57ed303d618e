"""Every bad input gets a clear error, on every backend (issue 13, items 6, 8, 9 and 10).

Tables of inputs: text that `str.splitlines()` would split wrongly, corrupt
presets, ids and shapes that the backends would otherwise treat differently,
and the command-line entry points, which must answer a user error with one
line on stderr and exit status 2.
"""

import gzip
import importlib
import io
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import keras_transformer as kt
from conftest import BACKEND, tiny_model, to_numpy
from keras_transformer import data, textio, translate
from keras_transformer.evaluate import main as evaluate_main
from keras_transformer.generation import generate
from keras_transformer.tokenizers.sentencepiece import _sentences, train_tokenizer
from keras_transformer.train import main as train_main
from keras_transformer.translate import main as translate_main
from keras_transformer.average import main as average_main

# ---------------------------------------------------------------------- #
# Item 6: one line reader, lines end at "\n" only
# ---------------------------------------------------------------------- #
# Characters at which str.splitlines() splits but a line of a corpus does not end.
NOT_LINE_ENDS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"]
LINES = [f"left{c}right" for c in NOT_LINE_ENDS] + ["", "windows", "last"]
TEXT = "\n".join(LINES[:-2]) + "\nwindows\r\nlast"  # A CRLF line, and no final line end.


def _write(path, text_or_bytes):
    raw = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else text_or_bytes
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)
    return path


def _write_raw(path, raw):
    """Bytes as they are, even to a name ending in .gz."""
    path.write_bytes(raw)
    return path


def _stdin(monkeypatch, raw):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))


READERS = {
    "textio": textio.read_lines,
    "translate (re-exported for export.runtime)": translate.read_lines,
    "data": data.read_lines,
    "tokenizer": lambda path: list(_sentences([path])),  # Strips and skips blank lines.
}


@pytest.mark.parametrize("suffix", [".txt", ".gz"])
@pytest.mark.parametrize("reader", READERS, ids=list(READERS))
def test_every_reader_splits_at_newline_only(tmp_path, reader, suffix):
    path = _write(tmp_path / f"corpus{suffix}", TEXT)
    expected = LINES if reader != "tokenizer" else [line.strip() for line in LINES if line.strip()]
    assert READERS[reader](path) == expected
    assert translate.read_lines is textio.read_lines


@pytest.mark.parametrize("path", [None, "-"])
@pytest.mark.parametrize("binary", [True, False], ids=["bytes", "text_stream"])
def test_stdin_splits_at_newline_only(monkeypatch, binary, path):
    if binary:
        _stdin(monkeypatch, TEXT.encode("utf-8"))
    else:
        monkeypatch.setattr(sys, "stdin", io.StringIO(TEXT))
    assert textio.read_lines(path) == LINES


@pytest.mark.parametrize(
    "text,lines",
    [("", []), ("\n", [""]), ("a", ["a"]), ("a\n", ["a"]), ("a\n\n", ["a", ""]), ("a\r\nb\r", ["a", "b\r"]),
     ("\ufeffbom\n", ["bom"])],
    ids=["empty", "one_empty_line", "no_line_end", "line_end", "blank_last", "crlf", "utf8_bom"],
)
def test_line_end_edge_cases(tmp_path, text, lines):
    assert textio.read_lines(_write(tmp_path / "f.txt", text)) == lines


def test_bundled_corpus_has_the_manifest_line_counts():
    from keras_transformer.datasets import bundled_paths, load_bundled, load_manifest

    files = load_manifest()["files"]
    for split in ("valid", "test"):
        english, german = load_bundled(split)
        source, target = bundled_paths(split)
        assert (len(english), len(german)) == (files[source.name]["lines"], files[target.name]["lines"])


def test_textio_imports_only_the_standard_library():
    """The lean ONNX runtime reads its input with textio, without Keras, TensorFlow or NumPy."""
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('textio', {textio.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = sorted({'keras', 'numpy', 'tensorflow', 'jax', 'torch', 'h5py'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


BAD_UTF8 = b"fine\nbad \xff byte\n"


@pytest.mark.parametrize(
    "source,match",
    [
        ("file", r"bad\.txt, line 2: not valid UTF-8 \(byte 0xff at position 4"),
        ("gzip", r"bad\.txt\.gz, line 2: not valid UTF-8"),
        ("stdin", r"stdin, line 2: not valid UTF-8"),
        ("not_gzip", r"fake\.gz: not a valid gzip file"),
        ("truncated_gzip", r"cut\.gz: not a valid gzip file"),
        ("missing", r"No such file: .*missing\.txt"),
        ("directory", r"is a directory"),
    ],
)
def test_reading_errors_name_the_file_and_line(tmp_path, monkeypatch, source, match):
    path = {
        "file": lambda: _write(tmp_path / "bad.txt", BAD_UTF8),
        "gzip": lambda: _write(tmp_path / "bad.txt.gz", BAD_UTF8),
        "stdin": lambda: _stdin(monkeypatch, BAD_UTF8),
        "not_gzip": lambda: _write_raw(tmp_path / "fake.gz", b"plain text\n"),
        "truncated_gzip": lambda: _write_raw(tmp_path / "cut.gz", gzip.compress(b"x\n" * 1000)[:30]),
        "missing": lambda: tmp_path / "missing.txt",
        "directory": lambda: tmp_path,
    }[source]()
    with pytest.raises((ValueError, OSError), match=match):
        textio.read_lines(path)


def test_tokenizer_training_reports_the_reading_error_not_sentencepiece(tmp_path):
    path = _write(tmp_path / "bad.en", BAD_UTF8)
    with pytest.raises(ValueError, match=r"bad\.en, line 2: not valid UTF-8"):
        train_tokenizer([path], vocabulary_size=20)


@pytest.mark.parametrize(
    "sentences,vocabulary_size,match",
    [
        (["a b c", "hello world"] * 5, 500, r"vocabulary_size=500 is too large for this corpus: .* at most \d+ pieces"),
        ([" ", ""], 20, "No sentence to train the vocabulary on"),
        (["a b c", "hello world"] * 5, 6, r"vocabulary_size=6 is too small for this corpus: .* at least 15 \(--vocab"),
    ],
    ids=["vocabulary_too_large", "no_sentences", "vocabulary_too_small"],
)
def test_sentencepiece_internal_errors_become_advice(sentences, vocabulary_size, match):
    with pytest.raises(ValueError, match=match):
        train_tokenizer(sentences, vocabulary_size=vocabulary_size)


# ---------------------------------------------------------------------- #
# Item 8: presets and weights files are checked before they are used
# ---------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def saved_preset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("inputs") / "preset"
    tiny_model().save_to_preset(directory)
    return directory


def _copy_preset(saved_preset, tmp_path):
    import shutil

    return shutil.copytree(saved_preset, tmp_path / "preset")


def _edit_config(directory, edit):
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    path.write_bytes(edit(saved))


def _with_config(**values):
    def edit(saved):
        saved["config"].update(values)
        return json.dumps(saved).encode()

    return edit


BAD_CONFIGS = {
    "list": (lambda saved: b"[1, 2]", r"config\.json must hold a JSON object .*received a JSON array"),
    "null": (lambda saved: b"null", r"config\.json must hold a JSON object .*received a JSON null"),
    "not_utf8": (lambda saved: b'{"class_name": "\xff"}', r"config\.json is not UTF-8 text"),
    "truncated": (lambda saved: json.dumps(saved).encode()[:40], r"config\.json is not valid JSON"),
    "config_is_a_list": (
        lambda saved: json.dumps(dict(saved, config=[1])).encode(), r"'config' must be a JSON object .*array"
    ),
    "unknown_key": (_with_config(num_layer=2), r"unknown TransformerModel argument\(s\) \['num_layer'\]"),
    "num_layers_true": (_with_config(num_layers=True), r"num_layers=True must be a positive integer"),
    "num_layers_float": (_with_config(num_layers=2.0), r"num_layers=2\.0 must be a positive integer"),
    "num_heads_string": (_with_config(num_heads="4"), r"num_heads='4' must be a positive integer"),
    "dropout_string": (_with_config(dropout="0.1"), r"dropout='0\.1' must be a number in \[0, 1\)"),
    "attention_dropout_nan": (_with_config(attention_dropout=float("nan")), r"attention_dropout=nan"),
    "epsilon_zero": (_with_config(layer_norm_epsilon=0), r"layer_norm_epsilon=0 must be a positive number"),
    "normalize_first_string": (_with_config(normalize_first="yes"), r"normalize_first='yes' must be True or False"),
    "start_id_is_end_id": (_with_config(start_id=3), r"start_id=3 and end_id=3 must differ"),
    "unk_id_is_pad_id": (_with_config(unk_id=0), r"pad_id=0 and unk_id=0 must differ"),
    "end_id_true": (_with_config(end_id=True), r"end_id=True must be an integer"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_json_is_refused_naming_the_file(saved_preset, tmp_path, case):
    edit, match = BAD_CONFIGS[case]
    directory = _copy_preset(saved_preset, tmp_path)
    _edit_config(directory, edit)
    with pytest.raises(ValueError, match=match) as error:
        kt.TransformerModel.from_preset(str(directory))
    assert "config.json" in str(error.value)


@pytest.mark.parametrize(
    "saved_layers,config_layers,match",
    [
        (3, 2, r"holds 127 weight arrays but the model described by .*config\.json has 85; layers in the file "
               r"that the model does not have: decoder_layer_2, encoder_layer_2\."),
        (1, 2, r"holds 43 weight arrays but .* has 85; layers of the model missing from the file: "
               r"decoder_layer_1, encoder_layer_1\."),
    ],
    ids=["more_layers_in_the_file", "fewer_layers_in_the_file"],
)
def test_every_weight_of_the_file_must_be_used(tmp_path, saved_layers, config_layers, match):
    tiny_model(num_layers=saved_layers).save_to_preset(tmp_path / "p")
    _edit_config(tmp_path / "p", _with_config(num_layers=config_layers))
    with pytest.raises(ValueError, match=match):
        kt.TransformerModel.from_preset(str(tmp_path / "p"))


def test_optimizer_state_in_the_weights_file_is_not_an_extra_weight(tmp_path, rng):
    model = tiny_model()
    kt_training = importlib.import_module("keras_transformer.training")
    kt_training.compile_model(model, warmup_steps=10)
    src = rng.integers(4, 50, size=(4, 5)).astype("int32")
    model.fit({"encoder_token_ids": src, "decoder_token_ids": src}, src, epochs=1, verbose=0)
    model.save_to_preset(tmp_path / "p")
    loaded = kt.TransformerModel.from_preset(str(tmp_path / "p"))
    for expected, actual in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(to_numpy(expected), to_numpy(actual))


@pytest.mark.parametrize(
    "content,match",
    [(b"not hdf5 at all", r"model\.weights\.h5 is not an HDF5 weights file"),
     (b"", r"model\.weights\.h5 is not an HDF5 weights file")],
    ids=["text", "empty"],
)
def test_weights_file_that_is_not_hdf5_is_named(saved_preset, tmp_path, content, match):
    directory = _copy_preset(saved_preset, tmp_path)
    (directory / "model.weights.h5").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        kt.TransformerModel.from_preset(str(directory))


@pytest.mark.parametrize(
    "content,match",
    [(b"garbage", r"Cannot load the tokenizer .*tokenizer\.model: Not a serialized SentencePiece model"),
     (b"", r"Cannot load the tokenizer .*tokenizer\.model: Not a SentencePiece model: 0 bytes")],
    ids=["garbage", "empty"],
)
def test_bad_tokenizer_model_is_named(saved_preset, tmp_path, content, match):
    directory = _copy_preset(saved_preset, tmp_path)
    (directory / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        kt.TransformerModel.from_preset(str(directory))


# ---------------------------------------------------------------------- #
# Item 9: one check of ids, batches and cache positions, on every backend
# ---------------------------------------------------------------------- #
HUGE = 2**32 + 7  # JAX without x64 would read it as 7 after an int32 cast.
ID_MESSAGE = r"contains token id {}, outside \[0, 50\) for vocabulary_size=50\."


def _ids(*rows, dtype="int64"):
    return np.array(rows, dtype)


@pytest.mark.parametrize(
    "call,match",
    [
        ("call_encoder", "encoder_token_ids " + ID_MESSAGE.format(HUGE)),
        ("call_decoder", "decoder_token_ids " + ID_MESSAGE.format(HUGE)),
        ("encode", "encoder_token_ids " + ID_MESSAGE.format(HUGE)),
        ("generate", "encoder_token_ids " + ID_MESSAGE.format(HUGE)),
        ("decode_step", "token_ids " + ID_MESSAGE.format(HUGE)),
        ("decode_step_too_large", "token_ids " + ID_MESSAGE.format(50)),
        ("decode_step_negative", "token_ids " + ID_MESSAGE.format(-1)),
    ],
)
def test_int64_ids_are_range_checked_before_any_cast(call, match):
    model = tiny_model()
    good = _ids([5, 6, 3])
    bad = _ids([5, HUGE, 3])
    cache = model.init_cache(model.encode(good), good, 4)
    run = {
        "call_encoder": lambda: model({"encoder_token_ids": bad, "decoder_token_ids": _ids([2, 5])}),
        "call_decoder": lambda: model({"encoder_token_ids": good, "decoder_token_ids": bad}),
        "encode": lambda: model.encode(bad),
        "generate": lambda: generate(model, bad, beam_size=2),
        "decode_step": lambda: model.decode_step(_ids(HUGE), 0, cache),
        "decode_step_too_large": lambda: model.decode_step(_ids(50), 0, cache),
        "decode_step_negative": lambda: model.decode_step(np.array([-1], "int32"), 0, cache),
    }[call]
    with pytest.raises(ValueError, match=match):
        run()


def _tensor(array):
    import keras

    return keras.ops.convert_to_tensor(array)


@pytest.mark.parametrize("encoder_batch,decoder_batch", [(2, 1), (1, 2)])
@pytest.mark.parametrize("inputs", ["numpy", "tensors"])
@pytest.mark.parametrize("entry", ["call", "decode"])
def test_encoder_decoder_batch_mismatch_is_refused(encoder_batch, decoder_batch, inputs, entry):
    model = tiny_model()
    src = np.tile(np.array([[5, 6, 3]], "int32"), (encoder_batch, 1))
    tgt = np.tile(np.array([[2, 7]], "int32"), (decoder_batch, 1))
    if inputs == "tensors":
        src, tgt = _tensor(src), _tensor(tgt)
    match = (
        rf"Batch sizes differ \(encoder_token_ids {encoder_batch}, .*decoder_token_ids {decoder_batch}\); "
        "every input must have the same batch size"
    )
    with pytest.raises(ValueError, match=match):
        if entry == "call":
            model({"encoder_token_ids": src, "decoder_token_ids": tgt})
        else:
            model.decode(tgt, model.encode(src), src)


@pytest.mark.parametrize(
    "case,match",
    [
        ("index_past_the_cache", r"index=4 is outside the cache of length 4 \(init_cache max_length\)"),
        ("negative_index", r"index=-1 is outside the cache of length 4"),
        ("tensor_index_past_the_cache", r"index=9 is outside the cache of length 4"),
        ("batch_other_than_the_cache", r"Batch sizes differ \(token_ids 2, cache 1\)"),
        ("encoder_outputs_of_another_batch", r"Batch sizes differ \(encoder_token_ids 1, encoder_outputs 2\)"),
    ],
)
def test_decode_step_and_init_cache_check_their_arguments(case, match):
    model = tiny_model()
    src = np.array([[5, 6, 3]], "int32")
    cache = model.init_cache(model.encode(src), src, 4)
    token = np.array([5], "int32")
    run = {
        "index_past_the_cache": lambda: model.decode_step(token, 4, cache),
        "negative_index": lambda: model.decode_step(token, -1, cache),
        "tensor_index_past_the_cache": lambda: model.decode_step(token, _tensor(np.int32(9)), cache),
        "batch_other_than_the_cache": lambda: model.decode_step(np.array([5, 6], "int32"), 0, cache),
        "encoder_outputs_of_another_batch": lambda: model.init_cache(model.encode(np.tile(src, (2, 1))), src, 4),
    }[case]
    with pytest.raises(ValueError, match=match):
        run()


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_layers=True), r"num_layers=True must be a positive integer"),
        (dict(num_heads=True), r"num_heads=True must be a positive integer"),
        (dict(dropout="0.1"), r"dropout='0\.1' must be a number in \[0, 1\)"),
        (dict(attention_dropout=-0.1), r"attention_dropout=-0\.1 must be a number in \[0, 1\)"),
        (dict(use_fused_attention=1), r"use_fused_attention=1 must be True or False"),
        (dict(start_id=3), r"start_id=3 and end_id=3 must differ"),
        (dict(unk_id=2), r"unk_id=2 and start_id=2 must differ"),
        (dict(start_id=2.0), r"start_id=2\.0 must be an integer in \[0, vocabulary_size=50\)"),
    ],
)
def test_constructor_checks_types_and_distinct_special_ids(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(**overrides)


# ---------------------------------------------------------------------- #
# Item 10: the entry points answer a user error with one line and status 2
# ---------------------------------------------------------------------- #
SENTENCES = [f"{s} {v} {o}." for s, v, o in itertools.product(
    ["The cat", "A dog", "My friend"], ["sees", "likes", "finds"], ["the house", "a tree", "it"])]


@pytest.fixture(scope="module")
def translating_preset(tmp_path_factory):
    tokenizer = train_tokenizer(SENTENCES, vocabulary_size=60)
    directory = tmp_path_factory.mktemp("inputs") / "translating"
    tiny_model(vocabulary_size=tokenizer.vocabulary_size).save_to_preset(directory, tokenizer=tokenizer)
    return directory


def _one_line_error(capsys, run):
    with pytest.raises(SystemExit) as error:
        run()
    err = capsys.readouterr().err
    assert error.value.code == 2, err
    assert "Traceback" not in err, err
    # Log lines may come before it; the error itself is one line, the last.
    errors = [line for line in err.strip().split("\n") if ": error: " in line]
    assert len(errors) == 1 and err.strip().split("\n")[-1] == errors[0], err
    return errors[0]


def test_evaluate_cli_scores_as_many_sentences_as_the_files_have_lines(translating_preset, tmp_path, capsys):
    """Two 5-line files with U+2028, NEL and a form feed inside sentences: 5 pairs, not more."""
    lines = ["The cat sees\u2028the house.", "A dog\x85likes it.", "My friend\x0cfinds a tree.", "", "The cat."]
    (tmp_path / "src.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    evaluate_main(["--preset", str(translating_preset), "--src", str(tmp_path / "src.en"),
                   "--ref", str(tmp_path / "ref.de"), "--beam-size", "1", "--max-extra-length", "2",
                   "--json", "--no-progress"])
    assert json.loads(capsys.readouterr().out)["sentences"] == 5


def test_translate_cli_writes_one_line_per_input_line(translating_preset, monkeypatch, capsys):
    _stdin(monkeypatch, "The cat\u2028sees it.\nA dog\x1elikes it.\n".encode("utf-8"))
    translate_main(["--preset", str(translating_preset), "--beam-size", "1", "--max-extra-length", "2",
                    "--no-progress"])
    assert capsys.readouterr().out.count("\n") == 2


def _broken_preset(translating_preset, tmp_path, broken):
    import shutil

    directory = shutil.copytree(translating_preset, tmp_path / "broken")
    if broken == "tokenizer":
        (directory / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    else:
        _edit_config(directory, BAD_CONFIGS[broken][0])
    return str(directory)


CLI_CASES = {
    "translate_stdin_not_utf8": r"stdin, line 2: not valid UTF-8",
    "translate_input_not_utf8": r"bad\.en, line 2: not valid UTF-8",
    "translate_input_missing": r"No such file: .*missing\.en",
    "translate_config_list": r"config\.json must hold a JSON object",
    "translate_config_null": r"config\.json must hold a JSON object",
    "translate_config_not_utf8": r"config\.json is not UTF-8 text",
    "translate_config_dropout_string": r"dropout='0\.1' must be a number",
    "translate_config_num_layers_true": r"num_layers=True must be a positive integer",
    "translate_bad_tokenizer": r"tokenizer\.model: Not a serialized SentencePiece model",
    "evaluate_src_not_utf8": r"bad\.en, line 2: not valid UTF-8",
    "evaluate_config_list": r"config\.json must hold a JSON object",
    "average_not_hdf5": r"notes\.weights\.h5 is not an HDF5 weights file",
    "average_missing": r"(?i)no such checkpoint( file)?: .*gone\.weights\.h5",
    "train_src_not_utf8": r"bad\.en, line 2: not valid UTF-8",
    "train_src_missing": r"No such file: .*missing\.en",
    "train_truncated_state": r"state\.json is (damaged|not readable JSON) .* pass --overwrite",
    "train_vocabulary_too_large": r"vocabulary_size=5000 is too large for this corpus.*--vocabulary-size",
    "train_vocabulary_too_small": r"vocabulary_size=5 is too small for this corpus.*--vocabulary-size",
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_user_errors_are_one_line_and_exit_2(case, translating_preset, tmp_path, monkeypatch, capsys):
    preset = str(translating_preset)
    bad = str(_write(tmp_path / "bad.en", BAD_UTF8))
    good = str(_write(tmp_path / "good.en", "\n".join(SENTENCES) + "\n"))
    ref = str(_write(tmp_path / "ref.de", "eins\nzwei\n"))
    if case.startswith("translate_stdin"):
        _stdin(monkeypatch, BAD_UTF8)
    if "_config_" in case or case.endswith("_tokenizer"):
        broken = "tokenizer" if case.endswith("_tokenizer") else case.split("_config_")[1]
        preset = _broken_preset(translating_preset, tmp_path, broken)
        _stdin(monkeypatch, b"The cat.\n")
    if case == "average_not_hdf5":
        _write(tmp_path / "notes.weights.h5", "plain text\n")
    if case == "train_truncated_state":
        (tmp_path / "run" / "training").mkdir(parents=True)
        (tmp_path / "run" / "training" / "state.json").write_text('{"preset": "tiny", "fini')
    run = {
        "translate_stdin_not_utf8": lambda: translate_main(["--preset", preset]),
        "translate_input_not_utf8": lambda: translate_main(["--preset", preset, "--input", bad]),
        "translate_input_missing": lambda: translate_main(["--preset", preset, "--input",
                                                           str(tmp_path / "missing.en")]),
        "evaluate_src_not_utf8": lambda: evaluate_main(["--preset", preset, "--src", bad, "--ref", ref]),
        "evaluate_config_list": lambda: evaluate_main(["--preset", preset, "--src", ref, "--ref", ref]),
        "average_not_hdf5": lambda: average_main([str(tmp_path / "notes.weights.h5"), "--output",
                                                  str(tmp_path / "avg.weights.h5")]),
        "average_missing": lambda: average_main([str(tmp_path / "gone.weights.h5"), "--output",
                                                 str(tmp_path / "avg.weights.h5")]),
        "train_src_not_utf8": lambda: train_main(["--output", str(tmp_path / "run"), "--preset", "tiny",
                                                  "--train-src", bad, "--train-tgt", good]),
        "train_src_missing": lambda: train_main(["--output", str(tmp_path / "run"), "--preset", "tiny",
                                                 "--train-src", str(tmp_path / "missing.en"), "--train-tgt", good]),
        "train_truncated_state": lambda: train_main(["--output", str(tmp_path / "run"), "--preset", "tiny"]),
        "train_vocabulary_too_large": lambda: train_main(["--output", str(tmp_path / "run"), "--preset", "tiny",
                                                          "--train-src", good, "--train-tgt", good,
                                                          "--vocabulary-size", "5000"]),
        "train_vocabulary_too_small": lambda: train_main(["--output", str(tmp_path / "run"), "--preset", "tiny",
                                                          "--train-src", good, "--train-tgt", good,
                                                          "--vocabulary-size", "5"]),
    }.get(case, lambda: translate_main(["--preset", preset]))
    line = _one_line_error(capsys, run)
    assert re.search(CLI_CASES[case], line), line


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="a process-level check; the message is the same on every backend")
def test_translate_module_non_utf8_stdin_prints_no_traceback(translating_preset):
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer.translate", "--preset", str(translating_preset)],
        input=BAD_UTF8, capture_output=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert "python -m keras_transformer.translate: error: stdin, line 2: not valid UTF-8" in stderr
