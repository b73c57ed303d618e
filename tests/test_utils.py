"""keras_transformer.utils.atomic_path."""

import os

import pytest

from keras_transformer.utils import atomic_path


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
