"""Line files: the one line reader of the package (UTF-8, one sentence per line) and its atomic writer.

Lines end at "\\n" (a "\\r" just before it is dropped too, for files written
on Windows) and nowhere else. `str.splitlines()` would also split at form
feeds, the information separators \\x1c-\\x1e, NEL (\\x85) and U+2028/U+2029;
those occur inside real sentences, and splitting there would give more
lines than the file has and shift every pair after them.

`write_lines` writes a file whole or not at all (a temporary beside it,
renamed when complete); `check_text_file` and `check_output_path` refuse, in
one line naming the argument, what a translation run cannot read or must not
write, before any work starts.

Standard library only: the ONNX serving runtime (`export/runtime.py`) reads
its input with this module in a process without TensorFlow, Keras or NumPy.

Example:

```python
from keras_transformer.textio import read_lines

sources = read_lines("newstest2014.en")   # or "train.en.gz"; None or "-" reads stdin
```
"""

import codecs
import gzip
import io
import os
import sys
import zlib

STDIN = "-"

from keras_transformer.utils import atomic_path

__all__ = [
    "STDIN", "check_output_path", "check_text_file", "count_lines", "iter_lines", "read_lines", "split_lines",
    "write_lines",
]

# How much of a file `check_text_file` reads to tell text from binary data.
SNIFF_BYTES = 1 << 16
GZIP_MAGIC = b"\x1f\x8b"


def split_lines(text):
    """Splits text at "\\n" (and "\\r\\n") only; a final line end adds no empty line.

    Example:
    >>> split_lines("a\\x85b\\r\\n\\nc\\n")
    ['a\\x85b', '', 'c']
    """
    lines = text.split("\n")
    last = lines.pop()  # The text after the last "\n": "" when the text ends with one.
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if last:
        lines.append(last)
    return lines


def iter_lines(path=None):
    """The lines of a UTF-8 text file (plain or `.gz`), or of stdin, one at a time.

    Line ends are removed; empty lines are kept. The file is opened (and a
    missing file reported) before the first line is asked for; it is read
    lazily, so a large corpus is never held in memory twice.

    Args:
        path: str or path-like; `None` or "-" reads standard input. A name
            ending in `.gz` is read through gzip.

    Returns:
        An iterator of str.

    Raises:
        FileNotFoundError: `path` does not exist.
        IsADirectoryError: `path` is a directory.
        ValueError: while iterating, a line that is not valid UTF-8 (the
            message names the file, or stdin, and the 1-based line number),
            or a `.gz` file that is not valid gzip.
    """
    if path is None or os.fspath(path) == STDIN:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # A text stream standing in for stdin (tests, notebooks).
            return iter(split_lines(sys.stdin.read()))
        return _decoded(stream, "stdin", close=False)
    name = os.fspath(path)
    if os.path.isdir(name):
        raise IsADirectoryError(f"{name} is a directory; expected a text file with one sentence per line")
    try:
        handle = gzip.open(name, "rb") if name.endswith(".gz") else open(name, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"No such file: {name}") from None
    return _decoded(handle, name, close=True)


def read_lines(path=None):
    """All lines of a UTF-8 text file (plain or `.gz`), or of stdin, as a list.

    See `iter_lines` for the arguments and errors. Empty lines are kept, so
    that outputs written line by line stay aligned with the input.

    Example:
    >>> read_lines("test.en")[:2]
    ['A sentence.', 'Another one.']
    """
    return list(iter_lines(path))


def _decoded(handle, name, close):
    """Yields the decoded lines of a binary stream; `name` goes into error messages."""
    number = 0
    try:
        for number, raw in enumerate(handle, start=1):
            # Binary streams split at b"\n" only, which is the rule we want.
            if raw.endswith(b"\n"):
                raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # Written by some Windows editors.
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{name}, line {number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at "
                    f"position {error.start} of the line: {error.reason}). Convert the text to "
                    "UTF-8, e.g. `iconv -f latin1 -t utf-8`."
                ) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise ValueError(f"{name}: not a valid gzip file after line {number} ({error})") from None
    finally:
        if close:
            handle.close()


def count_lines(path):
    """The number of lines `iter_lines(path)` gives, counted in binary (fast; a `.gz` file is decompressed).

    Returns None for stdin (`None` or "-"), which cannot be read twice.
    """
    if path is None or os.fspath(path) == STDIN:
        return None
    name = os.fspath(path)
    count, last = 0, b"\n"
    with gzip.open(name, "rb") if name.endswith(".gz") else open(name, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def check_text_file(path, name="path"):
    """Refuses, before reading it, a file that `iter_lines` could not read as text.

    Reads the first `SNIFF_BYTES` (decompressed, for `.gz`): a NUL byte means
    binary data; gzip data under a name without `.gz` is named as such.
    Invalid UTF-8 is reported by the reader itself, with its line number.
    `None` or "-" (stdin) is not checked.

    Args:
        path: str or path-like.
        name: how the message names the argument (e.g. "src_path", "--src").

    Raises:
        FileNotFoundError, IsADirectoryError, ValueError: one line naming
            `name`, the file and what is allowed.
    """
    if path is None or os.fspath(path) == STDIN:
        return
    file = os.fspath(path)
    if os.path.isdir(file):
        raise IsADirectoryError(f"{name}: {file} is a directory; expected a text file with one sentence per line")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{name}: No such file: {file}")
    allowed = "expected UTF-8 text, one sentence per line (plain, or gzip-compressed with a .gz name)"
    try:
        with gzip.open(file, "rb") if file.endswith(".gz") else open(file, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise ValueError(f"{name}: {file} is not a valid gzip file ({error}); {allowed}") from None
    if not file.endswith(".gz") and head.startswith(GZIP_MAGIC):
        raise ValueError(f"{name}: {file} is gzip-compressed but its name does not end in .gz; {allowed}")
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{name}: {file} is binary (a NUL byte at offset {nul}); {allowed}")


def check_output_path(path, name="out_path", overwrite=False, source=None, source_name="src_path",
                      overwrite_name="overwrite=True"):
    """Refuses an output file that cannot or must not be written, before any work starts.

    Args:
        path: the output file (str or path-like).
        name, source_name, overwrite_name: how the message names the
            arguments (e.g. "--output", "--src", "--overwrite").
        overwrite: bool, an existing file may be replaced.
        source: the input file, which the output must not be.

    Raises:
        FileNotFoundError: the directory of `path` does not exist.
        IsADirectoryError: `path` is a directory.
        ValueError: `path` is the input file.
        FileExistsError: `path` exists and `overwrite` is False.
    """
    file = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(file))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{name}: the directory of {file} does not exist ({directory}); create it first"
        )
    if os.path.isdir(file):
        raise IsADirectoryError(f"{name}: {file} is a directory; expected a file name to write the lines to")
    if source is not None and os.fspath(source) != STDIN and os.path.exists(file) and os.path.exists(source):
        if os.path.samefile(file, source):
            raise ValueError(
                f"{name}: {file} is the input file ({source_name}); write the output to another file"
            )
    if os.path.exists(file) and not overwrite:
        raise FileExistsError(f"{name}: {file} already exists; pass {overwrite_name} to replace it")


def write_lines(path, lines, overwrite=False):
    """Writes `lines` to `path` atomically: a temporary file beside it, renamed when complete.

    The lines are written as they come (an iterator is never held whole).
    If writing fails or the process is killed, `path` is left as it was; a
    temporary left by a killed process is deleted by the next `write_lines`
    to the same path.

    Args:
        path: output file; a name ending in `.gz` is written gzip-compressed
            (what `iter_lines` reads back).
        lines: iterable of str, one per line (without its line end).
        overwrite: bool, replace an existing file.

    Returns:
        int, the number of lines written.

    Raises:
        FileExistsError: when `path` exists and `overwrite` is False.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
    count = 0
    with atomic_path(path, replace_stale=True) as temporary, open(temporary, "wb") as raw:
        # A `.gz` name is written gzip-compressed, as `iter_lines` reads it (no name or time in the header).
        packed = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if path.endswith(".gz") else None
        sink = io.BufferedWriter(packed) if packed is not None else raw
        for line in lines:
            sink.write((line + "\n").encode("utf-8"))
            count += 1
        sink.flush()
        if packed is not None:
            packed.close()  # writes gzip's trailer; `raw` stays open
        raw.flush()
        os.fsync(raw.fileno())
    return count
