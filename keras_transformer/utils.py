"""Small helpers shared by the package."""

import argparse
import contextlib
import json
import math
import numbers
import os
import pathlib
import re
import shutil
import tempfile
import uuid


def cpu_flags():
    """The CPU's feature flags from Linux's /proc/cpuinfo (`amx_bf16`, `avx512_bf16`, ...); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    except OSError:
        return frozenset()


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
def atomic_path(path, suffix="", replace_stale=False):
    """Yields a temporary path beside `path`; renames it onto `path` on success.

    On any error the temporary file is removed and `path` is left as it was,
    so a killed or failed write never leaves a truncated file behind.

    Args:
        path: the final file path.
        suffix: ending for the temporary name (Keras wants `.weights.h5`).
        replace_stale: bool. Name the temporary `.NAME.tmp-PID-HEX` (then
            `suffix` must be "") and first delete those that killed writers
            of `path` left (`remove_stale_temporaries`): for files written
            again and again at the same place, such as translations.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if replace_stale:
        if suffix:
            raise ValueError(f"suffix={suffix!r}: a temporary that replace_stale recognises has no suffix")
        remove_stale_temporaries(path)
        temporary = str(temporary_sibling(path, "tmp"))
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    else:
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
            _fsync(temporary)
        os.replace(temporary, path)
        _fsync(directory)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def read_json_file(path):
    """A JSON file's value; `ValueError` naming the file if it is not UTF-8 JSON."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid UTF-8 JSON: {error}") from None


def write_bytes_atomically(path, data):
    """Writes `data` to `path` through `atomic_path`, flushed to disk before the rename."""
    with atomic_path(path) as temporary, open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path


def check_output_directory(output, overwrite, is_replaceable, what, source=None, flag="overwrite=True (--overwrite)"):
    """Refuses an `output` directory that must not be written; returns it as a `pathlib.Path`.

    Nothing a user wrote is replaced but an earlier output of the same kind
    (a preset, an export): the `source` being read (or a directory that
    holds it) is refused in any case, an existing `output` without
    `overwrite`, and with it a file or a directory that holds files but is
    not such an output. The writer then replaces it atomically
    (`atomic_directory`).

    Args:
        output: the directory to write.
        overwrite: whether an existing `output` may be replaced.
        is_replaceable: `pathlib.Path -> bool`, whether a directory is an
            earlier output of this kind.
        what: that kind, for the messages ("an ONNX export (python -m export.onnx)").
        source: what the output is made from, when it is a path (a preset
            or checkpoint directory); names and models are not compared.
        flag: how the caller spells `overwrite` in the message.

    Raises:
        FileExistsError: `output` exists and `overwrite` is False.
        ValueError: `output` is (or holds) `source`, is a file, or is a
            directory of something else.
    """
    output = pathlib.Path(output)
    if isinstance(source, (str, os.PathLike)) and pathlib.Path(source).exists():
        source_path, target = pathlib.Path(source).resolve(), output.resolve()
        if target == source_path or target in source_path.parents:
            what_it_is = "is the directory of" if target == source_path else f"holds ({os.fspath(source)})"
            raise ValueError(
                f"{output} {what_it_is} the model being read: writing there would delete the model; "
                "choose another output directory"
            )
    if not output.exists():
        return output
    if not output.is_dir():
        raise ValueError(f"{output} is a file, not a directory; choose another output directory")
    if not overwrite:
        raise FileExistsError(f"{output} already exists; pass {flag} to replace it")
    if any(output.iterdir()) and not is_replaceable(output):
        raise ValueError(
            f"{output} holds files but is not {what}, so it is not replaced (only an earlier one would be); "
            "empty it or choose another output directory"
        )
    return output


@contextlib.contextmanager
def atomic_directory(directory):
    """Yields an empty staging directory beside `directory`; moves it into place on success.

    An existing `directory` is replaced only once the new one is complete; on
    any error the staging directory is removed and `directory` is left as it
    was. Callers check `overwrite` themselves.
    """
    directory = pathlib.Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    staging = temporary_sibling(directory, "tmp")
    staging.mkdir()
    try:
        yield staging
        replace_directory(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_directory(staging, directory):
    """Moves the complete directory `staging` onto `directory`, replacing what is there.

    Two renames: an existing `directory` is renamed away to `.NAME.old-PID-HEX`
    (then deleted), and `staging` takes its place. A kill between them leaves
    no `directory`, its old content and `staging` under their temporary names
    (`stale_temporaries`); a reader never sees a partial `directory`.
    """
    directory = pathlib.Path(directory)
    trash = None
    if directory.exists():
        trash = temporary_sibling(directory, "old")
        os.replace(directory, trash)
    os.replace(staging, directory)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_directory(directory):
    """Renames `directory` away (atomic), then deletes it: a kill never leaves half of it in place."""
    trash = temporary_sibling(directory, "old")
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync(path):
    """Flushes a file or directory to disk (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# `.NAME.tmp-PID-HEX` (being written) and `.NAME.old-PID-HEX` (being deleted)
# beside NAME; older versions wrote `.NAME.tmp-HEX` without the process id.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)-)?[0-9a-f]{32}$")


def temporary_sibling(path, kind):
    """`.NAME.{kind}-PID-HEX` beside `path`: a name `remove_stale_temporaries` recognises."""
    path = pathlib.Path(path)
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex}"


def _process_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _writers(name, target):
    """The process ids (None: not recorded) of a temporary `name` of `target`, or None if it is not one.

    A temporary of a temporary counts: a directory staged as `.NAME.tmp-PID-HEX`
    is itself written atomically (`save_to_preset` into the staging path of
    `atomic_directory`), as `..NAME.tmp-PID-HEX.tmp-PID-HEX`; a kill there
    leaves it beside NAME, and it is NAME's leftover.
    """
    writers = []
    while (match := _TEMPORARY.match(name)) is not None:
        writers.append(match["pid"])
        if match["name"] == target:
            return writers
        name = match["name"]
    return None


def stale_temporaries(path):
    """Leftovers of killed writers of `path`: `.NAME.tmp-*` / `.NAME.old-*` (and theirs) of dead processes."""
    path = pathlib.Path(path)
    if not path.parent.is_dir():
        return []
    stale = []
    for entry in sorted(path.parent.iterdir()):
        writers = _writers(entry.name, path.name)
        if writers is None or any(pid is not None and _process_alive(int(pid)) for pid in writers):
            continue
        stale.append(entry)
    return stale


def remove_stale_temporaries(path):
    """Deletes `stale_temporaries(path)`; returns what was removed."""
    removed = []
    for entry in stale_temporaries(path):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        removed.append(entry)
    return removed


# ---------------------------------------------------------------------- #
# argparse types: nonsense values are refused with one line (exit 2).
# ---------------------------------------------------------------------- #
def _number(kind, text):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text):
    """argparse type: an integer >= 1."""
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text}")
    return value


def non_negative_int(text):
    """argparse type: an integer >= 0."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def port_number(text):
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0-65535 (0: any free port), got {text}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0."""
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def auto_or_bool(text):
    """argparse type: "auto", or true / false (any case) as a bool."""
    value = {"auto": "auto", "true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be auto, true or false, got {text}")
    return value


def unit_interval(text):
    """argparse type: a number in [0, 1) (a probability such as label smoothing)."""
    value = _number(float, text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value
