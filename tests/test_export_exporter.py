"""The exporters' shared base (export/exporter.py): the output check, staging and install, loading, the checks.

No model is converted here: a stand-in format whose export is one file shows
what the base owns for every exporter.
"""

import pathlib

import keras
import pytest

from export.exporter import Exporter, check_sentences


def _is_export(directory):
    return (pathlib.Path(directory) / "format.txt").is_file()


TOY = Exporter("Toy", "python -m export.toy", "a toy export", _is_export, tensorflow_because="it traces graphs")


def _files(root):
    return {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_staged_installs_the_export_and_replaces_only_an_earlier_one(tmp_path):
    output = tmp_path / "out"
    with TOY.staged(output, overwrite=False) as staging:
        assert staging.parent == tmp_path and staging != output and not output.exists()
        (staging / "format.txt").write_text("1")
    assert _files(tmp_path) == {pathlib.Path("out/format.txt"): b"1"}
    with TOY.staged(TOY.check_output(output, overwrite=True), overwrite=True) as staging:
        (staging / "format.txt").write_text("2")
    assert _files(tmp_path) == {pathlib.Path("out/format.txt"): b"2"}


def test_a_failed_export_leaves_nothing_and_keeps_the_earlier_one(tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "format.txt").write_text("earlier")
    with pytest.raises(RuntimeError, match="validation failed"):
        with TOY.staged(output, overwrite=True) as staging:
            (staging / "format.txt").write_text("new")
            raise RuntimeError("validation failed")
    assert _files(tmp_path) == {pathlib.Path("out/format.txt"): b"earlier"}


@pytest.mark.parametrize("overwrite, error, says", [
    (False, FileExistsError, r"out already exists; pass overwrite=True \(--overwrite\) to replace it"),
    (True, ValueError, r"out holds files but is not a toy export \(python -m export.toy\), so it is not replaced"),
])
def test_what_a_user_wrote_during_an_export_is_kept(tmp_path, overwrite, error, says):
    """The output is checked again before the install: files written there while the export ran are not lost."""
    output = tmp_path / "out"
    with pytest.raises(error, match=says):
        with TOY.staged(TOY.check_output(output, overwrite), overwrite) as staging:
            (staging / "format.txt").write_text("export")
            output.mkdir()
            (output / "notes.txt").write_text("mine")
    assert _files(tmp_path) == {pathlib.Path("out/notes.txt"): b"mine"}


def test_the_preset_directory_is_never_the_output(tmp_path):
    preset = tmp_path / "preset"
    preset.mkdir()
    for output in (preset, tmp_path):
        with pytest.raises(ValueError, match="the model being read: writing there would delete the model"):
            TOY.check_output(output, overwrite=True, preset=preset)
    # A preset name or a model is not a path: nothing to compare.
    assert TOY.check_output(tmp_path / "new", overwrite=False, preset="tiny") == tmp_path / "new"


def test_load_model_refuses_in_one_line(monkeypatch):
    with pytest.raises(TypeError, match="^source must be a preset name, a preset directory or a TransformerModel, "
                                        "received int$"):
        Exporter("Any", "python -m export.any", "an export", _is_export).load_model(3, argument="source")
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match=r"^Toy export runs on the TensorFlow backend \(it traces graphs\); "
                                           r"KERAS_BACKEND is 'jax'. Run with KERAS_BACKEND=tensorflow.$"):
        TOY.load_model("tiny")


def test_load_model_turns_dropout_off_unless_the_format_keeps_it():
    any_backend = Exporter("Any", "python -m export.any", "an export", _is_export)
    assert any_backend.load_model("tiny").dropout == 0.0
    keeps = Exporter("Any", "python -m export.any", "an export", _is_export, dropout=None)
    assert keeps.load_model("tiny").dropout == pytest.approx(0.1)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_check_sentences(value):
    with pytest.raises(ValueError, match=f"^validation_sentences={value!r} must be an integer >= 1$"):
        check_sentences(value)
    check_sentences(1)


def test_the_cli_says_a_refused_output_in_one_line(tmp_path, capsys):
    parser = TOY.parser("A toy exporter.")
    calls = []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        TOY.main(parser, ["--preset", "tiny", "--output", str(tmp_path / "out"), "--overwrite"], calls.append)
    assert exit_info.value.code == 2 and not calls
    assert capsys.readouterr().err.count("\n") == 1

    def bad_input(args):
        raise ValueError(f"quantization={args.preset!r} is not known")

    with pytest.raises(SystemExit) as exit_info:
        TOY.main(parser, ["--preset", "x", "--output", str(tmp_path / "new")], bad_input)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: quantization='x' is not known\n"
    assert TOY.main(parser, ["--preset", "tiny", "--output", str(tmp_path / "new")], calls.append) == 0
    assert [args.output for args in calls] == [str(tmp_path / "new")]
