"""The small English->German corpus bundled with the package.

LibreOffice's English and German help pages and UI messages (MPL-2.0), taken
from Debian's `libreoffice-help-en-us`, `libreoffice-help-de` and
`libreoffice-l10n-de` packages by `scripts/build_libreoffice_corpus.py`. It lets the
Quick start, notebooks and tests train and evaluate offline.

Example:

```python
from keras_transformer.datasets import load_bundled, verify_manifest

verify_manifest()
english, german = load_bundled("train")   # two aligned lists of str
```

See `libreoffice_en_de/README.md` for how it was built and its baselines.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import pathlib

from keras_transformer.textio import read_lines

logger = logging.getLogger(__name__)

BUNDLED_DIR = pathlib.Path(__file__).resolve().parent / "libreoffice_en_de"
"""Folder of the bundled corpus: the gzip files, manifest.json, license, README."""

SPLITS = ("train", "valid", "test")
SOURCE_LANGUAGE = "en"
TARGET_LANGUAGE = "de"

__all__ = [
    "BUNDLED_DIR",
    "SPLITS",
    "ManifestError",
    "bundled_paths",
    "load_bundled",
    "data_record",
    "load_manifest",
    "portable_name",
    "verify_manifest",
]

BUNDLED_PREFIX = "bundled:"
"""How `portable_name` marks a bundled file: `bundled:libreoffice_en_de/train.en.gz`."""


class ManifestError(ValueError):
    """A bundled file does not match manifest.json (missing, count or checksum)."""


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; allowed splits are {', '.join(SPLITS)}.")


def bundled_paths(split):
    """Returns `(source_path, target_path)` of one split's gzip files.

    Args:
        split: "train", "valid" or "test".

    Returns:
        Two `pathlib.Path`: the English (`{split}.en.gz`) and German
        (`{split}.de.gz`) files, one sentence per line, UTF-8.
    """
    _check_split(split)
    return (
        BUNDLED_DIR / f"{split}.{SOURCE_LANGUAGE}.gz",
        BUNDLED_DIR / f"{split}.{TARGET_LANGUAGE}.gz",
    )


def portable_name(path):
    """How a preset's metadata names a data file, so that it means the same on another machine.

    A file of the bundled corpus is named by the corpus and file
    (`bundled:libreoffice_en_de/train.en.gz`), not by where the package is
    installed; any other file by the path as given.

    Args:
        path: str or path-like, or None.

    Returns:
        str, or None for None.
    """
    if path is None:
        return None
    given = os.fspath(path)
    if pathlib.Path(given).resolve().parent == BUNDLED_DIR:
        return f"{BUNDLED_PREFIX}{BUNDLED_DIR.name}/{pathlib.Path(given).name}"
    return given


def data_record(splits):
    """The `data` entry of a preset's `metadata.json`: which files, named portably.

    Args:
        splits: dict of split name -> `(source_path, target_path)` (paths
            or None).

    Returns:
        dict: split name -> `[source, target]` as `portable_name` writes
        them, and, when a file of the bundled corpus is among them,
        `bundled_corpus`: its name and version (the Debian version of the
        LibreOffice packages it was built from) and the keras-aiayn version
        that ships it.

    Example:
    >>> data_record({"train": bundled_paths("train"), "valid": ("dev.en", "dev.de")})["train"]
    ['bundled:libreoffice_en_de/train.en.gz', 'bundled:libreoffice_en_de/train.de.gz']
    """
    record = {split: [portable_name(path) for path in paths] for split, paths in splits.items()}
    names = [name for names in record.values() for name in names if name is not None]
    if any(name.startswith(BUNDLED_PREFIX) for name in names):
        from keras_transformer import __version__

        manifest = load_manifest()
        versions = sorted({package["version"] for package in manifest.get("packages", [])})
        record["bundled_corpus"] = {
            "name": manifest["name"],
            "version": ", ".join(versions),
            "keras_aiayn": __version__,
        }
    return record


def load_bundled(split):
    """Loads one split of the bundled corpus.

    Args:
        split: "train", "valid" or "test".

    Returns:
        `(english, german)`: two lists of str of the same length, line i of
        one being the translation of line i of the other.
    """
    source_path, target_path = bundled_paths(split)
    english = read_lines(source_path)
    german = read_lines(target_path)
    if len(english) != len(german):
        raise ManifestError(
            f"{source_path.name} has {len(english)} lines but {target_path.name} has "
            f"{len(german)}; the files must be aligned line by line."
        )
    logger.debug("Loaded %d %s pairs from %s", len(english), split, BUNDLED_DIR)
    return english, german


def load_manifest():
    """Returns the parsed `manifest.json` of the bundled corpus."""
    path = BUNDLED_DIR / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8"))


def verify_manifest():
    """Checks every bundled file's line count and sha256 against manifest.json.

    Checks the sha256 of the gzip file and of its uncompressed text, the line
    count, and that each split's two files have the manifest's pair count.

    Returns:
        The manifest dict, when everything matches.

    Raises:
        ManifestError: naming the first file that is missing or differs.
    """
    manifest = load_manifest()
    files = manifest.get("files", {})
    expected_names = {bundled_paths(split)[i].name for split in SPLITS for i in (0, 1)}
    missing_entries = sorted(expected_names - files.keys())
    if missing_entries:
        raise ManifestError(f"manifest.json has no entry for {missing_entries}")
    for name, expected in sorted(files.items()):
        path = BUNDLED_DIR / name
        if not path.is_file():
            raise ManifestError(f"{path} is listed in manifest.json but does not exist")
        compressed = path.read_bytes()
        sha_gz = hashlib.sha256(compressed).hexdigest()
        if sha_gz != expected["sha256_gz"]:
            raise ManifestError(
                f"{name}: sha256 of the gzip file is {sha_gz}, manifest.json says "
                f"{expected['sha256_gz']}"
            )
        text = gzip.decompress(compressed)
        sha_text = hashlib.sha256(text).hexdigest()
        if sha_text != expected["sha256_text"]:
            raise ManifestError(
                f"{name}: sha256 of the uncompressed text is {sha_text}, manifest.json "
                f"says {expected['sha256_text']}"
            )
        lines = text.count(b"\n")
        if lines != expected["lines"]:
            raise ManifestError(
                f"{name}: has {lines} lines, manifest.json says {expected['lines']}"
            )
    for split in SPLITS:
        pairs = manifest["splits"][split]["pairs"]
        for path in bundled_paths(split):
            if files[path.name]["lines"] != pairs:
                raise ManifestError(
                    f"{path.name}: manifest.json lists {files[path.name]['lines']} lines "
                    f"but {pairs} pairs for the {split} split"
                )
    logger.info("Bundled corpus verified: %s",
                {split: manifest["splits"][split]["pairs"] for split in SPLITS})
    return manifest
