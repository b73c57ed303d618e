"""keras_transformer.utils.atomic_path."""

import os

import pytest

from keras_transformer.utils import atomic_path, check_output_directory


def test_atomic_path_writes_with_plain_open_permissions(tmp_path):
    target = tmp_path / "file.txt"
    with atomic_path(target) as temporary:
        with open(temporary, "w") as f:
            f.write("data")
    umask = os.umask(0)
    os.umask(umask)
    assert target.read_text() == "data"
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600
    assert os.listdir(tmp_path) == ["file.txt"]


def test_atomic_path_leaves_old_file_on_error(tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as temporary:
            with open(temporary, "w") as f:
                f.write("partial")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["file.txt"]


def test_atomic_path_replace_stale_removes_what_dead_writers_left(tmp_path):
    target = tmp_path / "out.txt"
    dead = tmp_path / f".out.txt.tmp-{2**22 + 1}-{'a' * 32}"  # no such process (above the default pid_max)
    live = tmp_path / f".out.txt.tmp-{os.getpid()}-{'b' * 32}"
    other = tmp_path / f".other.txt.tmp-{2**22 + 1}-{'c' * 32}"
    for path in (dead, live, other):
        path.write_text("partial")
    with atomic_path(target, replace_stale=True) as temporary:
        assert os.path.basename(temporary).startswith(f".out.txt.tmp-{os.getpid()}-")
        with open(temporary, "w") as f:
            f.write("data")
    assert target.read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == sorted(["out.txt", live.name, other.name])
    with pytest.raises(ValueError, match="suffix='.h5': a temporary that replace_stale recognises has no suffix"):
        with atomic_path(target, suffix=".h5", replace_stale=True):
            pass


def _refusal(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_an_output_directory_replaces_only_an_earlier_output_and_never_the_source(tmp_path):
    preset = tmp_path / "preset"
    preset.mkdir()
    (preset / "config.json").write_text("{}")

    def check(output, overwrite, **kwargs):
        return check_output_directory(
            output, overwrite, lambda directory: (directory / "marker").is_file(), "an X export", **kwargs
        )

    assert check(tmp_path / "new", False, source=str(preset)) == tmp_path / "new"
    assert check(tmp_path / "new", False, source="tiny") == tmp_path / "new"  # a name is not a directory
    # The model's own directory, or one that holds it, whatever the flag (the path spelt another way too).
    for output, says in ((preset, "is the directory of"), (tmp_path / "." / "preset", "is the directory of"),
                         (tmp_path, rf"holds \({preset}\)")):
        for overwrite in (False, True):
            _refusal(lambda: check(output, overwrite, source=preset), ValueError,
                     f"{says} the model being read: writing there would delete the model")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _refusal(lambda: check(mine, False), FileExistsError, "mine already exists; pass overwrite=True")
    _refusal(lambda: check(mine, False, flag="--overwrite"), FileExistsError, "already exists; pass --overwrite to")
    _refusal(lambda: check(mine, True), ValueError,
             "holds files but is not an X export, so it is not replaced .only an earlier one would be.")
    assert (mine / "notes.txt").read_text() == "mine"
    (mine / "notes.txt").unlink()
    assert check(mine, True) == mine  # empty: nothing to lose
    (mine / "marker").write_text("")
    assert check(mine, True) == mine  # an earlier export
    (tmp_path / "file").write_text("mine")
    _refusal(lambda: check(tmp_path / "file", True), ValueError, "is a file, not a directory")
