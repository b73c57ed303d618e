"""Reading text lines: one reader for the package (standard library only).

Lines end at "\n" (a preceding "\r" is dropped) and nowhere else:
`str.splitlines()` also splits at \x0b, \x0c, \x1c-\x1e, \x85, U+2028 and
U+2029, which would give more lines than the file has and misalign
sources, references and translations.
"""

import gzip
import os
import sys


def split_lines(text):
    """`text` cut at "\n" (and "\r\n"); a final line end adds no empty line."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path=None):
    """Lines of a UTF-8 file (plain or `.gz`), or of stdin when `path` is None or "-".

    Only the line ends are removed; empty lines are kept.

    Raises:
        ValueError: the bytes are not UTF-8 (naming the file and line).
    """
    if path is None or path == "-":
        if not hasattr(sys.stdin, "buffer"):  # A text stream (e.g. io.StringIO): already decoded.
            return split_lines(sys.stdin.read())
        data, name = sys.stdin.buffer.read(), "standard input"
    else:
        opener = gzip.open if os.fspath(path).endswith(".gz") else open
        with opener(path, "rb") as f:
            data, name = f.read(), os.fspath(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{name} is not UTF-8 text (line {line}, byte {error.start}); convert it to UTF-8") from None
    return split_lines(text)
