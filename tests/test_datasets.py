"""The bundled LibreOffice en-de corpus, its build helpers and its baselines."""

import gzip
import importlib.util
import pathlib
import sys
import hashlib
import shutil
import struct
import unicodedata

import pytest

from keras_transformer import datasets
from keras_transformer.datasets import baselines

# The corpus builder is a maintainer's script, not part of the installed package.
_BUILDER = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "build_libreoffice_corpus.py"
_spec = importlib.util.spec_from_file_location("build_libreoffice_corpus", _BUILDER)
build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build  # dataclasses and pickling look modules up by name
_spec.loader.exec_module(build)


# --- The shipped data -------------------------------------------------------


def test_manifest_verifies():
    manifest = datasets.verify_manifest()
    assert set(manifest["splits"]) == set(datasets.SPLITS)
    assert {p["name"] for p in manifest["packages"]} == set(build.PACKAGES)
    assert "build_date" not in manifest


@pytest.mark.parametrize("split", datasets.SPLITS)
def test_counts_match_manifest(split):
    manifest = datasets.load_manifest()
    english, german = datasets.load_bundled(split)
    assert len(english) == len(german) == manifest["splits"][split]["pairs"]
    for path in datasets.bundled_paths(split):
        assert manifest["files"][path.name]["lines"] == len(english)


@pytest.mark.parametrize("split", datasets.SPLITS)
def test_load_bundled_is_aligned_nfc_and_non_empty(split):
    english, german = datasets.load_bundled(split)
    assert english and len(english) == len(german)
    for line in english + german:
        assert line.strip() == line and line
        assert "\n" not in line
        assert unicodedata.normalize("NFC", line) == line
    assert sum(e != g for e, g in zip(english, german)) == len(english)  # no untranslated pair


def test_bundled_paths_are_gzip_files_in_bundled_dir():
    source, target = datasets.bundled_paths("valid")
    assert source == datasets.BUNDLED_DIR / "valid.en.gz"
    assert target == datasets.BUNDLED_DIR / "valid.de.gz"
    assert source.read_bytes()[:2] == b"\x1f\x8b"


def test_portable_names_name_the_bundled_corpus_and_keep_other_paths_as_given(tmp_path, monkeypatch):
    source, target = datasets.bundled_paths("train")
    assert datasets.portable_name(source) == "bundled:libreoffice_en_de/train.en.gz"
    # A relative path that resolves into the bundled corpus is still the corpus.
    monkeypatch.chdir(datasets.BUNDLED_DIR.parent)
    assert datasets.portable_name("libreoffice_en_de/valid.de.gz") == "bundled:libreoffice_en_de/valid.de.gz"
    # Other files: exactly as given, relative or absolute, not resolved.
    assert datasets.portable_name("../data/dev.en") == "../data/dev.en"
    assert datasets.portable_name(tmp_path / "dev.en") == str(tmp_path / "dev.en")
    assert datasets.portable_name(None) is None


def test_data_record_adds_the_bundled_corpus_only_when_used():
    manifest = datasets.load_manifest()
    record = datasets.data_record({"train": datasets.bundled_paths("train"), "valid": ("dev.en", "dev.de")})
    assert record["train"] == ["bundled:libreoffice_en_de/train.en.gz", "bundled:libreoffice_en_de/train.de.gz"]
    assert record["valid"] == ["dev.en", "dev.de"]
    assert record["bundled_corpus"]["name"] == manifest["name"]
    assert record["bundled_corpus"]["version"] == manifest["packages"][0]["version"]
    assert "site-packages" not in str(record) and str(datasets.BUNDLED_DIR) not in str(record)
    assert "bundled_corpus" not in datasets.data_record({"train": ("a.en", "a.de"), "valid": (None, None)})


@pytest.mark.parametrize("function", [datasets.load_bundled, datasets.bundled_paths])
def test_bad_split_raises(function):
    with pytest.raises(ValueError, match=r"'dev'.*train, valid, test"):
        function("dev")


def test_test_and_train_share_no_english_sentence():
    train, _ = datasets.load_bundled("train")
    test, _ = datasets.load_bundled("test")
    valid, _ = datasets.load_bundled("valid")
    train_keys = {build.normalize_key(e) for e in train}
    assert not train_keys & {build.normalize_key(e) for e in test}
    assert not train_keys & {build.normalize_key(e) for e in valid}
    # Nor one that is identical up to case, punctuation and digits.
    loose_train = {build.loose_key(e) for e in train}
    assert not loose_train & {build.loose_key(e) for e in test}


def test_shipped_data_is_small_and_licensed():
    total = sum(p.stat().st_size for p in datasets.BUNDLED_DIR.iterdir() if p.is_file())
    assert total < 2_000_000
    license_text = (datasets.BUNDLED_DIR / "LICENSE.MPL-2.0").read_text(encoding="utf-8")
    assert "Mozilla Public License Version 2.0" in license_text


def test_verify_manifest_names_a_corrupted_file(tmp_path, monkeypatch):
    copy = tmp_path / "corpus"
    shutil.copytree(datasets.BUNDLED_DIR, copy)
    with gzip.GzipFile(copy / "valid.de.gz", "wb", mtime=0) as f:
        f.write(b"nur eine Zeile\n")
    monkeypatch.setattr(datasets, "BUNDLED_DIR", copy)
    with pytest.raises(datasets.ManifestError, match=r"valid\.de\.gz.*sha256"):
        datasets.verify_manifest()


# --- Build helpers ------------------------------------------------------------


def test_help_parser_keeps_default_variant_and_skips_code():
    page = (
        '<p id="par_id1" class="paragraph">Choose <span class="switchinline">'
        '<span hidden="true" id="MACx" class="MAC">LibreOffice - Preferences</span>'
        '<span hidden="true" id="defaultx">Tools - Options</span></span> now.</p>'
        '<h2 id="hd_id2">Title<br>Two</h2>'
        '<p id="par_id3">Run <pre>code()</pre>it</p>'
        '<p id="lang_id4">not a paragraph id</p>'
        '<p id="par_id1">Second occurrence</p>'
    )
    parsed = build.parse_help_page(page)
    assert parsed == {
        ("par_id1", 0): "Choose Tools - Options now.",
        ("hd_id2", 0): "Title Two",
        ("par_id3", 0): "Run it",
        ("par_id1", 1): "Second occurrence",
    }


def _write_mo(path, entries):
    """A minimal little-endian .mo writer for the test."""
    entries = sorted(entries.items())
    keys = [k.encode() for k, _ in entries]
    values = [v.encode() for _, v in entries]
    count = len(entries)
    originals = 28
    translations = originals + 8 * count
    offset = translations + 8 * count
    tables, blob = b"", b""
    for strings in (keys, values):
        for s in strings:
            tables += struct.pack("<2I", len(s), offset + len(blob))
            blob += s + b"\x00"
    header = struct.pack("<7I", 0x950412DE, 0, count, originals, translations, 0, 0)
    path.write_bytes(header + tables + blob)


def test_ui_pairs_use_context_strip_mnemonics(tmp_path):
    _write_mo(tmp_path / "sw.mo", {
        "": "Content-Type: text/plain; charset=UTF-8\n",
        "STR_SAVE\x04~Save the document now": "Dokument jetzt ~speichern",
        "dialog|label\x04Pr_operties of the page": "_Eigenschaften der Seite",
        "STR_EMPTY\x04Untranslated entry": "",
    })
    assert build.pair_ui(tmp_path) == [
        ("ui:sw#STR_SAVE", "Save the document now", "Dokument jetzt speichern"),
        ("ui:sw#dialog|label", "Properties of the page", "Eigenschaften der Seite"),
    ]


@pytest.mark.parametrize("english, german, reason", [
    ("Save the file now.", "Datei jetzt speichern.", None),
    ("Save the file.", "Save the file.", "untranslated"),
    ("Delete %1 rows now.", "%1 Zeilen jetzt löschen.", "placeholder"),
    ("Cannot open $(ARG1) file.", "Kann $(ARG1) nicht öffnen.", "placeholder"),
    ("Value {0} is invalid here.", "Wert {0} ist hier ungültig.", "placeholder"),
    ("See https://example.org for details.", "Siehe https://example.org für mehr.", "url"),
    ("Two words", "Zwei Wörter", "too_few_words"),
    ("A short one here.", "Eine sehr sehr sehr lange deutsche Übersetzung hier.", "length_ratio"),
    ("=SUM(1;2;3;4) gives 10.", "=SUMME(1;2;3;4) ergibt 10.", "mostly_non_letters"),
])
def test_reject_reason(english, german, reason):
    assert build.reject_reason(english, german) == reason


def test_clean_segment_fills_product_names_and_normalises():
    text = "Cafe\u0301  in %PRODUCTNAME\u00a0%PRODUCTVERSION by %OOOVENDOR "
    assert build.clean_segment(text, "7.4") == (
        "Café in LibreOffice 7.4 by The Document Foundation"
    )


def test_select_translations_most_frequent_then_sorted():
    pairs = [("Open it.", "Öffne es."), ("Open it.", "Es öffnen."), ("Open it.", "Öffne es."),
             ("Close it.", "Schließe es."), ("Close it.", "Es schließen.")]
    assert build.select_translations(pairs) == {
        "Close it.": "Es schließen.",  # tie -> first sorted
        "Open it.": "Öffne es.",  # most frequent
    }


def test_move_near_duplicates_moves_only_close_held_out_sentences():
    splits = {
        "Enter the maximum font size for the Ruby text.": "train",
        "Enter the maximum font size for the ruby text!": "test",  # same loose key
        "Enter the maximum font sizes for the Ruby text.": "valid",  # high Jaccard
        "Shows the spelling dialog for the whole document.": "test",
    }
    moved, counts = build.move_near_duplicates(splits)
    assert moved["Enter the maximum font size for the ruby text!"] == "train"
    assert moved["Enter the maximum font sizes for the Ruby text."] == "train"
    assert moved["Shows the spelling dialog for the whole document."] == "test"
    assert counts == {"test": 1, "valid": 1}


def test_split_hash_is_salted_and_case_insensitive():
    assert build.split_hash("Open  File", "a") == build.split_hash("open file", "a")
    assert build.split_hash("open file", "a") != build.split_hash("open file", "b")
    assert 0.0 <= build.split_hash("open file", "a") < 1.0


def test_write_gzip_lines_is_byte_identical(tmp_path):
    first = build.write_gzip_lines(tmp_path / "a.gz", ["Eins zwei", "drei"])
    second = build.write_gzip_lines(tmp_path / "b.gz", ["Eins zwei", "drei"])
    assert first == second
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()
    assert first[1] == hashlib.sha256(b"Eins zwei\ndrei\n").hexdigest()
    assert (tmp_path / "a.gz").read_bytes()[4:8] == b"\x00\x00\x00\x00"  # mtime 0


# --- Baselines ----------------------------------------------------------------


def test_retrieval_returns_training_german_for_a_training_sentence():
    train_en = ["Open the file.", "Close the window.", "Print the current page.",
                "Insert a new table."]
    train_de = ["Öffnen Sie die Datei.", "Schließen Sie das Fenster.",
                "Drucken Sie die aktuelle Seite.", "Fügen Sie eine neue Tabelle ein."]
    queries = ["Close the window.", "Print the current page.", "insert a new TABLE"]
    for analyzer, ngram_range in (("char", (3, 5)), ("word", (1, 2))):
        assert baselines.retrieval_translations(
            train_en, train_de, queries, analyzer, ngram_range
        ) == [train_de[1], train_de[2], train_de[3]]


def test_retriever_errors_quote_the_received_value():
    with pytest.raises(ValueError, match=r"analyzer='bpe'.*char.*word"):
        baselines.TfidfRetriever(analyzer="bpe")
    with pytest.raises(ValueError, match=r"2 sentences but train_target has 1"):
        baselines.retrieval_translations(["a b", "c d"], ["x"], ["a b"])


def test_score_of_perfect_translation_is_100():
    references = ["Öffnen Sie die Datei jetzt.", "Schließen Sie das Fenster."]
    result = baselines.score(references, references)
    assert result["bleu"] == pytest.approx(100.0)
    assert result["chrf"] == pytest.approx(100.0)


@pytest.mark.slow
def test_baselines_on_the_bundled_test_split():
    result = baselines.evaluate_baselines("test")
    assert result["pairs"] == datasets.load_manifest()["splits"]["test"]["pairs"]
    assert 0 < result["copy"]["bleu"] < result["retrieval"]["bleu"] < 100
