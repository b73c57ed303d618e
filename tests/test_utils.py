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
