"""Small helpers shared by the package."""

import contextlib
import os
import tempfile


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
