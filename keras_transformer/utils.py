"""Small helpers shared by the package."""

import contextlib
import numbers
import os
import pathlib
import shutil
import tempfile
import uuid


def is_integer(value):
    """True for Python and NumPy integers, False for bools (JSON `true` is not a layer count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value):
    """True for Python and NumPy ints and floats, False for bools and strings."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def open_hdf5(path):
    """Opens an HDF5 file (a Keras `.weights.h5`) for reading.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` is not HDF5 (or is damaged); the message names it.
    """
    import h5py

    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such weights file: {path}")
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise ValueError(f"{path} is not an HDF5 weights file (.weights.h5): {error}") from None


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yields a temporary path beside `path`; renames it onto `path` on success.

    On any error the temporary file is removed and `path` is left as it was,
    so a killed or failed write never leaves a truncated file behind.

    Args:
        path: the final file path.
        suffix: ending for the temporary name (Keras wants `.weights.h5`).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield temporary
        # mkstemp creates the file private (0600); give it the permissions a
        # plain open() would, so that presets can be shared.
        umask = os.umask(0)
        os.umask(umask)
        if os.path.exists(temporary):
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


@contextlib.contextmanager
def atomic_directory(directory):
    """Yields an empty staging directory beside `directory`; moves it into place on success.

    An existing `directory` is replaced only once the new one is complete; on
    any error the staging directory is removed and `directory` is left as it
    was. Callers check `overwrite` themselves.
    """
    directory = pathlib.Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
        if directory.exists():
            trash = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex}"
            os.replace(directory, trash)
            os.replace(staging, directory)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
