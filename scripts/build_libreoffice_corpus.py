"""Rebuild the bundled English->German corpus from Debian's LibreOffice packages.

The corpus pairs LibreOffice's English and German help pages and UI messages.
They come from three Debian packages, read without installing them:

- ``libreoffice-help-en-us`` and ``libreoffice-help-de``: the help as HTML
  pages. Every paragraph and heading carries an id (``<p id="par_id3146957">``,
  ``<h2 id="hd_id3143284">``) that is the same in every language, so a pair is
  (page path below the language root, element id, occurrence of that id).
- ``libreoffice-l10n-de``: the UI messages as gettext ``.mo`` catalogs under
  ``usr/lib/libreoffice/program/resource/de/LC_MESSAGES``. LibreOffice's
  msgid is ``context + "\\x04" + English text`` and the msgstr is the German,
  so a pair is (catalog, context).

Pairs are cleaned and filtered (see `clean_segment` and `reject_reason`), one
German is kept per English sentence, the pairs are split by a salted hash of
the English sentence, and test/valid pairs that nearly duplicate a training
sentence are moved into train (see `move_near_duplicates`).

Everything is deterministic: with the same packages and salt, two runs write
byte-identical files.

Usage:

    python scripts/build_libreoffice_corpus.py \\
        --output keras_transformer/datasets/libreoffice_en_de [--workdir DIR] \\
        [--deb PATH.deb ...] [--package-version 4:7.4.7-1+deb12u14]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import html
import html.parser
import io
import json
import logging
import pathlib
import re
import shutil
import struct
import subprocess
import tempfile
import unicodedata

import numpy as np
from scipy import sparse
from tqdm import tqdm

logger = logging.getLogger(__name__)

PACKAGES = ("libreoffice-help-en-us", "libreoffice-help-de", "libreoffice-l10n-de")
HELP_ROOTS = {
    "libreoffice-help-en-us": "usr/share/libreoffice/help/en-US",
    "libreoffice-help-de": "usr/share/libreoffice/help/de",
}
MO_DIR = "usr/lib/libreoffice/program/resource/de/LC_MESSAGES"
COPYRIGHT_PATH = "usr/share/doc/{package}/copyright"
MPL_LICENSE_PATH = pathlib.Path("/usr/share/common-licenses/MPL-2.0")

DEFAULT_SALT = "keras_transformer/libreoffice_en_de/v1"
TEST_FRACTION = 0.04
VALID_FRACTION = 0.02
SPLITS = ("train", "valid", "test")

MIN_WORDS = 3
MAX_WORDS = 40
MAX_CHARS = 250
MIN_RATIO = 0.5
MAX_RATIO = 2.0
MIN_LETTER_FRACTION = 0.5
# Near-duplicate test: Jaccard similarity of the sets of character 4-grams.
NGRAM_SIZE = 4
JACCARD_THRESHOLD = 0.7

_PAR_ID_RE = re.compile(r"^(par|hd)_id")
_HEADING_OR_PARAGRAPH = {"p", "h1", "h2", "h3", "h4", "h5", "h6"}
_VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
    "param", "source", "track", "wbr",
}
_WHITESPACE_RE = re.compile(r"\s+")
_PLACEHOLDER_RE = re.compile(
    r"%\d"  # %1
    r"|%[A-Za-z][A-Za-z_]+%?"  # %PRODUCTVERSION, %NAME, %OBJECT_NAME%
    r"|%[-+ #0-9.]*[sdiufgxXc](?![A-Za-z])"  # printf: %s, %d, %.2f
    r"|\$\(?[A-Za-z_]+\d*\)?\$?"  # $(ARG1), $NAME, $DEPLOYED$
    r"|\$\d"  # $1
    r"|\{[A-Za-z_]?\w*\}"  # {0}, {name}, {}
    r"|%%"
)
_URL_RE = re.compile(r"https?://|ftp://|www\.|mailto:|\b[\w.+-]+@[\w-]+\.\w", re.IGNORECASE)
_MARKUP_RE = re.compile(r"[<>]")
# Product placeholders and what they stand for. %PRODUCTVERSION is filled in
# from the package version (e.g. "7.4").
_PRODUCT_PLACEHOLDERS = {
    "%PRODUCTNAME": "LibreOffice",
    "%OOOVENDOR": "The Document Foundation",
}


# --------------------------------------------------------------------------
# Reading the Debian packages.


def _run(command, **kwargs):
    logger.debug("Running %s", " ".join(command))
    return subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)


def _require_tool(name):
    if shutil.which(name) is None:
        raise RuntimeError(
            f"The command {name!r} was not found on PATH; building the corpus needs "
            "dpkg-deb (and apt-get unless every .deb is given with --deb)."
        )


def deb_control(deb_path):
    """Returns `(package, version)` from a .deb's control file."""
    _require_tool("dpkg-deb")
    out = _run(["dpkg-deb", "--showformat=${Package}\\t${Version}", "--show", str(deb_path)])
    package, version = out.stdout.strip().split("\t")
    return package, version


def download_debs(directory, packages=PACKAGES, package_version=None):
    """Downloads packages with `apt-get download` into `directory`.

    Args:
        directory: `pathlib.Path` to download into.
        packages: names of the packages to download.
        package_version: str or None. When given, `PKG=VERSION` is downloaded for
            every package (they come from one source package); otherwise apt's
            candidate version.

    Returns:
        A list of paths to the downloaded .deb files.
    """
    _require_tool("apt-get")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for package in packages:
        spec = f"{package}={package_version}" if package_version else package
        logger.info("apt-get download %s", spec)
        before = set(directory.glob("*.deb"))
        try:
            _run(["apt-get", "download", spec], cwd=directory)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(
                f"`apt-get download {spec}` failed (exit {error.returncode}): "
                f"{error.stderr.strip()}. Run `apt-get update` first, or pass the "
                ".deb files with --deb."
            ) from error
        new = sorted(set(directory.glob("*.deb")) - before)
        if not new:  # Already present from an earlier run in the same workdir.
            new = sorted(directory.glob(f"{package}_*.deb"))
        paths.extend(new)
    return paths


def resolve_debs(deb_paths):
    """Maps each needed package name to its .deb, checking that all are present.

    Returns:
        A dict `{package: (path, version)}` with exactly the keys of `PACKAGES`.
    """
    found = {}
    for path in deb_paths:
        package, version = deb_control(path)
        if package not in PACKAGES:
            logger.warning("Ignoring %s: package %r is not one of %s", path, package, PACKAGES)
            continue
        if package in found and found[package][1] != version:
            raise ValueError(
                f"Two versions of {package} were given: {found[package][1]} "
                f"({found[package][0]}) and {version} ({path}); give exactly one."
            )
        found[package] = (pathlib.Path(path), version)
    missing = [p for p in PACKAGES if p not in found]
    if missing:
        raise ValueError(
            f"Missing .deb files for {missing}; got packages {sorted(found)}. "
            f"All of {list(PACKAGES)} are needed."
        )
    versions = {version for _, version in found.values()}
    if len(versions) != 1:
        logger.warning("The packages come from different versions: %s", versions)
    return found


def extract_deb(deb_path, destination):
    """Unpacks a .deb's data archive into `destination` (no installation)."""
    _require_tool("dpkg-deb")
    destination.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb_path), str(destination)])
    return destination


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------
# Help pages.


class _HelpParagraphParser(html.parser.HTMLParser):
    """Collects the text of every `<p>`/`<hN>` whose id starts with par_id/hd_id.

    Inline OS/module switches (`<span class="switchinline">`) hold one hidden
    `<span>` per variant; only the "default..." variant is kept, so "Choose
    Tools - Options" does not become "Choose LibreOffice - Preferences Tools -
    Options". Text in `<pre>` blocks (code) is dropped.
    """

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs = []  # [(id, text)]
        self._stack = []
        self._current = None  # (id, depth, parts)
        self._skip_depth = None

    def handle_starttag(self, tag, attrs):
        if tag in _VOID_TAGS:
            if tag == "br" and self._current is not None:
                self._current[2].append(" ")
            return
        self._stack.append(tag)
        depth = len(self._stack)
        attributes = dict(attrs)
        element_id = attributes.get("id") or ""
        if self._current is None:
            if tag in _HEADING_OR_PARAGRAPH and _PAR_ID_RE.match(element_id):
                self._current = (element_id, depth, [])
            return
        if self._skip_depth is None:
            hidden_variant = (
                tag == "span"
                and "hidden" in attributes
                and not element_id.startswith("default")
            )
            if hidden_variant or tag == "pre":
                self._skip_depth = depth

    def handle_startendtag(self, tag, attrs):
        if tag == "br" and self._current is not None:
            self._current[2].append(" ")

    def handle_endtag(self, tag):
        if tag in _VOID_TAGS or tag not in self._stack:
            return
        while self._stack:  # Tolerates unclosed inner tags.
            if self._stack.pop() == tag:
                break
        depth = len(self._stack)
        if self._skip_depth is not None and depth < self._skip_depth:
            self._skip_depth = None
        if self._current is not None and depth < self._current[1]:
            element_id, _, parts = self._current
            self.paragraphs.append((element_id, "".join(parts)))
            self._current = None
            self._skip_depth = None

    def handle_data(self, data):
        if self._current is not None and self._skip_depth is None:
            self._current[2].append(data)


def parse_help_page(text):
    """Returns `{(element_id, occurrence): raw_text}` for one help page."""
    parser = _HelpParagraphParser()
    parser.feed(text)
    parser.close()
    seen = collections.Counter()
    result = {}
    for element_id, paragraph in parser.paragraphs:
        result[(element_id, seen[element_id])] = paragraph
        seen[element_id] += 1
    return result


def read_help(root):
    """Returns `{(relative_path, element_id, occurrence): raw_text}` under a help root."""
    root = pathlib.Path(root)
    pages = sorted(p for p in (root / "text").rglob("*.html"))
    if not pages:
        raise FileNotFoundError(f"No help pages (*.html) found under {root / 'text'}")
    result = {}
    for page in tqdm(pages, desc=f"help {root.name}", unit="page", mininterval=2.0):
        relative = page.relative_to(root).as_posix()
        for key, text in parse_help_page(page.read_text(encoding="utf-8")).items():
            result[(relative,) + key] = text
    return result


def pair_help(english_root, german_root):
    """Pairs help paragraphs by (page path, paragraph id, occurrence).

    Returns:
        A sorted list of `(key, english, german)` with raw (uncleaned) text.
    """
    english = read_help(english_root)
    german = read_help(german_root)
    keys = sorted(english.keys() & german.keys())
    logger.info(
        "Help: %d English and %d German paragraphs, %d paired by (page, id)",
        len(english), len(german), len(keys),
    )
    return [("help:" + "#".join(map(str, key)), english[key], german[key]) for key in keys]


# --------------------------------------------------------------------------
# UI messages.


def read_mo(path):
    """Parses a gettext .mo file.

    Returns:
        A list of `(msgid, msgstr)` str pairs in file order; the header entry
        (empty msgid) is skipped. Plural entries keep their singular forms.
    """
    data = pathlib.Path(path).read_bytes()
    magic = struct.unpack("<I", data[:4])[0]
    if magic == 0x950412DE:
        endian = "<"
    elif magic == 0xDE120495:
        endian = ">"
    else:
        raise ValueError(f"{path} is not a gettext .mo file (magic number {magic:#x})")
    _, count, originals, translations = struct.unpack(endian + "4I", data[4:20])
    entries = []
    for i in range(count):
        length, offset = struct.unpack(
            endian + "2I", data[originals + 8 * i : originals + 8 * i + 8]
        )
        msgid = data[offset : offset + length].decode("utf-8")
        length, offset = struct.unpack(
            endian + "2I", data[translations + 8 * i : translations + 8 * i + 8]
        )
        msgstr = data[offset : offset + length].decode("utf-8")
        if not msgid:
            continue
        entries.append((msgid.split("\x00")[0], msgstr.split("\x00")[0]))
    return entries


def _strip_mnemonic(text, context):
    """Removes keyboard-shortcut markers: `~` (resource strings) and one `_` (.ui)."""
    text = text.replace("~", "")
    if "|" in context and "extended_tip" not in context and text.count("_") == 1:
        text = re.sub(r"_(?=\w|\.)", "", text)
    return text


def pair_ui(mo_directory):
    """Pairs UI messages by (catalog, msgctxt): English msgid vs German msgstr.

    Returns:
        A sorted list of `(key, english, german)` with shortcut markers removed.
    """
    mo_files = sorted(pathlib.Path(mo_directory).glob("*.mo"))
    if not mo_files:
        raise FileNotFoundError(f"No .mo catalogs found in {mo_directory}")
    pairs = []
    for mo_file in mo_files:
        for msgid, msgstr in read_mo(mo_file):
            if not msgstr:
                continue
            context, _, english = msgid.rpartition("\x04")
            pairs.append((
                f"ui:{mo_file.stem}#{context}",
                _strip_mnemonic(english, context),
                _strip_mnemonic(msgstr, context),
            ))
    pairs.sort()
    logger.info("UI: %d translated messages in %d catalogs", len(pairs), len(mo_files))
    return pairs


# --------------------------------------------------------------------------
# Cleaning and filtering.


def clean_segment(text, product_version="7.4"):
    """NFC, product placeholders filled in, whitespace collapsed.

    Help text arrives with HTML tags already removed and entities decoded by
    the parser; UI strings carry no HTML (those with `<`/`>` are dropped by
    `reject_reason`).
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("%PRODUCTVERSION", product_version)
    for placeholder, value in _PRODUCT_PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    text = text.replace("\u00a0", " ").replace("\u200b", "")
    return _WHITESPACE_RE.sub(" ", text).strip()


def _letter_fraction(text):
    visible = [c for c in text if not c.isspace()]
    if not visible:
        return 0.0
    return sum(c.isalpha() for c in visible) / len(visible)


def reject_reason(english, german):
    """Returns why a cleaned pair is dropped, or None to keep it."""
    if not english or not german:
        return "empty"
    if english == german or english.casefold() == german.casefold():
        return "untranslated"
    for side in (english, german):
        if _MARKUP_RE.search(side):
            return "markup"
        if _PLACEHOLDER_RE.search(side):
            return "placeholder"
        if _URL_RE.search(side):
            return "url"
    for side in (english, german):
        words = len(side.split())
        if words < MIN_WORDS:
            return "too_few_words"
        if words > MAX_WORDS:
            return "too_many_words"
        if len(side) > MAX_CHARS:
            return "too_many_chars"
    ratio = len(german) / len(english)
    if not MIN_RATIO <= ratio <= MAX_RATIO:
        return "length_ratio"
    if min(_letter_fraction(english), _letter_fraction(german)) < MIN_LETTER_FRACTION:
        return "mostly_non_letters"
    return None


def select_translations(pairs):
    """Keeps one German per English: the most frequent, ties -> first sorted.

    Args:
        pairs: iterable of `(english, german)`.

    Returns:
        A dict `{english: german}` with sorted keys.
    """
    candidates = collections.defaultdict(collections.Counter)
    for english, german in pairs:
        candidates[english][german] += 1
    return {
        english: min(counts.items(), key=lambda item: (-item[1], item[0]))[0]
        for english, counts in sorted(candidates.items())
    }


# --------------------------------------------------------------------------
# Splitting.


def normalize_key(text):
    """The split key: NFC, lowercased, whitespace collapsed."""
    return _WHITESPACE_RE.sub(" ", unicodedata.normalize("NFC", text).lower()).strip()


def split_hash(english, salt):
    """A float in [0, 1) from sha256(salt + normalised lowercased English)."""
    digest = hashlib.sha256((salt + normalize_key(english)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_splits(sentences, salt, test_fraction=TEST_FRACTION, valid_fraction=VALID_FRACTION):
    """Returns `{english: split}`: hash < test_fraction -> test, then valid, rest train."""
    splits = {}
    for english in sentences:
        u = split_hash(english, salt)
        if u < test_fraction:
            splits[english] = "test"
        elif u < test_fraction + valid_fraction:
            splits[english] = "valid"
        else:
            splits[english] = "train"
    return splits


def loose_key(text):
    """Lowercased, without punctuation, digits and repeated spaces."""
    text = "".join(c if c.isalpha() or c.isspace() else " " for c in normalize_key(text))
    return _WHITESPACE_RE.sub(" ", text).strip()


def _ngram_matrix(texts, n=NGRAM_SIZE):
    """Binary sparse matrix [len(texts), hashed n-grams] of character n-grams."""
    indptr, indices = [0], []
    vocabulary = {}
    for text in texts:
        padded = f" {loose_key(text)} "
        grams = {padded[i : i + n] for i in range(max(1, len(padded) - n + 1))}
        indices.extend(vocabulary.setdefault(g, len(vocabulary)) for g in sorted(grams))
        indptr.append(len(indices))
    data = np.ones(len(indices), dtype=np.float32)
    return sparse.csr_matrix(
        (data, np.asarray(indices, dtype=np.int64), np.asarray(indptr, dtype=np.int64)),
        shape=(len(texts), max(1, len(vocabulary))),
    )


def near_duplicate_mask(queries, references, threshold=JACCARD_THRESHOLD, chunk_size=256):
    """For each query, whether a reference nearly duplicates it.

    Near duplicate: the same `loose_key` (case, punctuation, digits ignored),
    or a Jaccard similarity >= `threshold` between the sets of character
    `NGRAM_SIZE`-grams of the loose keys. Computed as a sparse product of
    binary n-gram matrices, in chunks of queries.

    Returns:
        A bool array of shape [len(queries)].
    """
    reference_keys = {loose_key(text) for text in references}
    mask = np.array([loose_key(text) in reference_keys for text in queries], dtype=bool)
    if not queries or not references:
        return mask
    matrix = _ngram_matrix(list(queries) + list(references))
    query_matrix = matrix[: len(queries)]
    reference_matrix = matrix[len(queries) :].T.tocsc()
    query_sizes = np.asarray(query_matrix.sum(axis=1)).ravel()
    reference_sizes = np.asarray(reference_matrix.sum(axis=0)).ravel()
    for start in range(0, len(queries), chunk_size):
        stop = min(start + chunk_size, len(queries))
        intersection = (query_matrix[start:stop] @ reference_matrix).toarray()
        union = query_sizes[start:stop, None] + reference_sizes[None, :] - intersection
        jaccard = intersection / np.maximum(union, 1.0)
        mask[start:stop] |= (jaccard >= threshold).any(axis=1)
    return mask


def move_near_duplicates(splits, threshold=JACCARD_THRESHOLD):
    """Moves test/valid sentences that nearly duplicate a train sentence into train.

    Repeats until nothing moves, because a moved sentence may be the near
    duplicate of another held-out one.

    Returns:
        `(splits, moved)`: the updated `{english: split}` and `{split: count moved}`.
    """
    splits = dict(splits)
    moved = collections.Counter()
    candidates = sorted(e for e, s in splits.items() if s != "train")
    references = sorted(e for e, s in splits.items() if s == "train")
    round_number = 0
    while candidates and references:
        round_number += 1
        mask = near_duplicate_mask(candidates, references, threshold)
        newly = [e for e, m in zip(candidates, mask) if m]
        logger.info("Near duplicates, round %d: %d held-out sentences move to train",
                    round_number, len(newly))
        if not newly:
            break
        for english in newly:
            moved[splits[english]] += 1
            splits[english] = "train"
        candidates = [e for e, m in zip(candidates, mask) if not m]
        references = newly  # Only the newly moved ones can cause further moves.
    return splits, dict(sorted(moved.items()))


# --------------------------------------------------------------------------
# Writing.


def write_gzip_lines(path, lines):
    """Writes UTF-8 lines to a gzip file with mtime=0 and no file name.

    Returns:
        `(sha256 of the gz file, sha256 of the uncompressed text)`.
    """
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(text)
    pathlib.Path(path).write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest(), hashlib.sha256(text).hexdigest()


def _product_version(package_version):
    match = re.search(r"(?:\d+:)?(\d+)\.(\d+)", package_version)
    if not match:
        raise ValueError(f"Cannot read a LibreOffice version from {package_version!r}")
    return f"{match.group(1)}.{match.group(2)}"


def build_corpus(debs, output_dir, workdir, salt=DEFAULT_SALT, license_file=MPL_LICENSE_PATH):
    """Builds the corpus from the three .deb files.

    Args:
        debs: dict `{package: (deb_path, version)}` from `resolve_debs`.
        output_dir: folder to write the gz files, manifest.json, LICENSE.MPL-2.0
            and COPYRIGHT.debian into (created if needed; README.md is left alone).
        workdir: scratch folder for the unpacked packages.
        salt: str salt of the split hash.
        license_file: path of the MPL-2.0 text to copy.

    Returns:
        The manifest dict (also written to `output_dir/manifest.json`).
    """
    output_dir = pathlib.Path(output_dir)
    workdir = pathlib.Path(workdir)
    license_file = pathlib.Path(license_file)
    if not license_file.is_file():
        raise FileNotFoundError(
            f"The MPL-2.0 text was not found at {license_file}; install Debian's "
            "base-files or pass --license-file."
        )
    roots = {}
    for package, (deb_path, version) in sorted(debs.items()):
        destination = workdir / "extracted" / package
        if destination.exists():
            shutil.rmtree(destination)
        logger.info("Unpacking %s %s", package, version)
        roots[package] = extract_deb(deb_path, destination)
    product_version = _product_version(debs["libreoffice-l10n-de"][1])

    raw = pair_help(
        roots["libreoffice-help-en-us"] / HELP_ROOTS["libreoffice-help-en-us"],
        roots["libreoffice-help-de"] / HELP_ROOTS["libreoffice-help-de"],
    )
    raw += pair_ui(roots["libreoffice-l10n-de"] / MO_DIR)

    reasons = collections.Counter()
    kept_by_source = collections.Counter()
    kept = []
    for key, english, german in tqdm(raw, desc="clean", unit="pair", mininterval=2.0):
        english = clean_segment(english, product_version)
        german = clean_segment(german, product_version)
        reason = reject_reason(english, german)
        reasons[reason or "kept"] += 1
        if reason is None:
            kept.append((english, german))
            kept_by_source[key.split(":", 1)[0]] += 1
    logger.info("Filtering %d raw pairs: %s", len(raw), dict(sorted(reasons.items())))

    translations = select_translations(kept)
    logger.info("%d unique English sentences after one-German-per-English", len(translations))

    splits = assign_splits(translations, salt)
    hashed_counts = collections.Counter(splits.values())
    splits, moved = move_near_duplicates(splits)

    output_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    counts = {}
    for split in SPLITS:
        english_sentences = sorted(
            (e for e, s in splits.items() if s == split),
            key=lambda e: (split_hash(e, salt), e),
        )
        counts[split] = len(english_sentences)
        for language, lines in (
            ("en", english_sentences),
            ("de", [translations[e] for e in english_sentences]),
        ):
            name = f"{split}.{language}.gz"
            sha_gz, sha_text = write_gzip_lines(output_dir / name, lines)
            files[name] = {
                "lines": len(lines),
                "bytes": (output_dir / name).stat().st_size,
                "sha256_gz": sha_gz,
                "sha256_text": sha_text,
            }
    logger.info("Pairs per split: %s", counts)

    shutil.copyfile(license_file, output_dir / "LICENSE.MPL-2.0")
    copyright_source = roots["libreoffice-help-en-us"] / COPYRIGHT_PATH.format(
        package="libreoffice-help-en-us"
    )
    shutil.copyfile(copyright_source, output_dir / "COPYRIGHT.debian")

    manifest = {
        "name": "libreoffice_en_de",
        "format_version": 1,
        "source_language": "en",
        "target_language": "de",
        "license": "MPL-2.0",
        "license_files": ["LICENSE.MPL-2.0", "COPYRIGHT.debian"],
        "source": "LibreOffice help pages and UI messages from Debian packages",
        "packages": [
            {
                "name": package,
                "version": debs[package][1],
                "deb_sha256": _sha256_file(debs[package][0]),
            }
            for package in PACKAGES
        ],
        "salt": salt,
        "test_fraction": TEST_FRACTION,
        "valid_fraction": VALID_FRACTION,
        "filters": {
            "min_words": MIN_WORDS,
            "max_words": MAX_WORDS,
            "max_chars": MAX_CHARS,
            "min_length_ratio": MIN_RATIO,
            "max_length_ratio": MAX_RATIO,
            "min_letter_fraction": MIN_LETTER_FRACTION,
        },
        "near_duplicates": {
            "method": "same text after lowercasing and removing punctuation/digits, or "
            f"Jaccard similarity of character {NGRAM_SIZE}-gram sets >= {JACCARD_THRESHOLD}",
            "ngram_size": NGRAM_SIZE,
            "jaccard_threshold": JACCARD_THRESHOLD,
            "hashed_counts": {split: hashed_counts.get(split, 0) for split in SPLITS},
            "moved_to_train": {split: moved.get(split, 0) for split in ("valid", "test")},
        },
        "stats": {
            "raw_pairs": {"help": sum(k.startswith("help:") for k, _, _ in raw),
                          "ui": sum(k.startswith("ui:") for k, _, _ in raw)},
            "filter_outcomes": dict(sorted(reasons.items())),
            "kept_pairs_by_source": dict(sorted(kept_by_source.items())),
            "unique_english": len(translations),
        },
        "splits": {
            split: {"pairs": counts[split], "source": f"{split}.en.gz", "target": f"{split}.de.gz"}
            for split in SPLITS
        },
        "files": files,
    }
    (output_dir / "manifest.json").write_text(
        json.dumps(manifest, indent=2, ensure_ascii=False, sort_keys=False) + "\n",
        encoding="utf-8",
    )
    total = sum(f["bytes"] for f in files.values())
    logger.info("Wrote %s (%.2f MB of gzip data)", output_dir, total / 1e6)
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Rebuild the bundled LibreOffice English->German corpus from Debian packages."
    )
    parser.add_argument("--output", required=True, type=pathlib.Path,
                        help="Folder to write the corpus into.")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="Scratch folder for downloads and unpacked packages "
                        "(default: a temporary folder that is removed afterwards).")
    parser.add_argument("--deb", action="append", default=[], type=pathlib.Path,
                        help="A .deb to use instead of downloading (repeat for all three).")
    parser.add_argument("--package-version", default=None,
                        help="Debian version to download, e.g. 4:7.4.7-1+deb12u14 "
                        "(default: apt's candidate).")
    parser.add_argument("--salt", default=DEFAULT_SALT, help="Salt of the split hash.")
    parser.add_argument("--license-file", type=pathlib.Path, default=MPL_LICENSE_PATH,
                        help="Path of the MPL-2.0 text to ship.")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    def run(workdir):
        deb_paths = list(args.deb)
        have = {deb_control(path)[0] for path in deb_paths}
        missing = [package for package in PACKAGES if package not in have]
        if missing:
            deb_paths += download_debs(workdir / "debs", missing, args.package_version)
        debs = resolve_debs(deb_paths)
        return build_corpus(debs, args.output, workdir, salt=args.salt,
                            license_file=args.license_file)

    if args.workdir is not None:
        manifest = run(args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="libreoffice_corpus_") as tmp:
            manifest = run(pathlib.Path(tmp))
    print(json.dumps({s: v["pairs"] for s, v in manifest["splits"].items()}))


if __name__ == "__main__":
    main()
