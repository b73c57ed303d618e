"""The one line reader of the package: UTF-8 text, one sentence per line.

Lines end at "\\n" (a "\\r" just before it is dropped too, for files written
on Windows) and nowhere else. `str.splitlines()` would also split at form
feeds, the information separators \\x1c-\\x1e, NEL (\\x85) and U+2028/U+2029;
those occur inside real sentences, and splitting there would give more
lines than the file has and shift every pair after them.

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
import os
import sys
import zlib

STDIN = "-"

__all__ = ["STDIN", "iter_lines", "read_lines", "split_lines"]


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
