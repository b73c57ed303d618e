"""Documents into sentences and back (keras_transformer/documents/sentences.py)."""

import random

import pytest

from keras_transformer import documents
from keras_transformer.datasets import load_bundled


def _whole_sentences(count=120):
    """Test-split sentences that end as sentences do and that the splitter leaves whole.

    (Some lines are titles without a full stop, which run into the next sentence when joined
    with a space; some hold two sentences themselves.)
    """
    english, _ = load_bundled("test")
    whole = [s.strip() for s in english if s.strip().endswith((".", "!", "?"))]
    whole = [s for s in whole if documents.sentence_spans(s) == [(0, len(s))]]
    assert len(whole) > count, len(whole)
    return whole[:count]


def test_split_paragraphs_of_the_test_split_gives_back_their_sentences_and_whitespace():
    sentences = _whole_sentences()
    rng = random.Random(0)
    texts, expected, position = [], [], 0
    while position < len(sentences):
        paragraphs = []
        for _ in range(rng.randint(1, 3)):
            count = rng.randint(1, 4)
            chosen = sentences[position:position + count]
            position += count
            expected += chosen
            paragraphs.append(rng.choice([" ", "  ", "\t"]).join(chosen))
        lead, tail = rng.choice(["", "  ", "\n"]), rng.choice(["", "\n", " \n"])
        texts.append(lead + rng.choice(["\n\n", "\n", "\n \n"]).join(p for p in paragraphs if p) + tail)
    split = documents.split_texts(texts)
    assert split.units == expected
    assert split.join(split.units) == texts
    # Each unit's translation lands in its place, with every other character kept.
    marked = split.join([f"<{i}>" for i in range(len(split.units))])
    for text, pieces, rebuilt in zip(texts, split.pieces, marked):
        kept = [p for p in pieces if isinstance(p, str)]
        assert all(not p.strip() for p in kept)  # only whitespace is kept around the sentences
        assert rebuilt.count("<") == sum(isinstance(p, int) for p in pieces)


def test_split_keeps_empty_and_blank_texts_and_sends_nothing_to_translate():
    split = documents.split_texts(["", "   ", "\n\n", "Hello there."])
    assert split.units == ["Hello there."]
    assert split.join(["Hallo."]) == ["", "   ", "\n\n", "Hallo."]
    with pytest.raises(ValueError, match="2 translations for 1 sentences"):
        split.join(["a", "b"])


def test_lines_are_cut_at_newlines_only():
    # str.splitlines would cut at form feed, U+0085 and U+2028: here they stay inside a line.
    text = "First line without a stop\nsecond line\x0cstill second\u2028and still. Third."
    units = documents.split_texts([text]).units
    assert units == ["First line without a stop", "second line\x0cstill second\u2028and still.", "Third."]


def test_sentence_spans_use_the_language_abbreviations():
    text = "Wählen Sie z. B. Format. Dann OK."
    assert [text[s:e] for s, e in documents.sentence_spans(text, "de")] == ["Wählen Sie z. B. Format.", "Dann OK."]


def test_cut_prefers_clause_boundaries_then_whitespace_and_keeps_every_word():
    sentence = "Select the cells, then choose Format, Cells; the dialog opens with tabs"
    fits = lambda part: len(part) <= 30  # noqa: E731
    parts = [sentence[s:e] for s, e in documents.cut_to_fit(sentence, fits)]
    assert parts == ["Select the cells,", "then choose Format, Cells;", "the dialog opens with tabs"]
    assert all(fits(p) for p in parts)
    assert " ".join(parts) == sentence
    # No whitespace at all: the longest prefix that fits.
    assert [("x" * 25)[s:e] for s, e in documents.cut_to_fit("x" * 25, fits)] == ["x" * 25]
    assert documents.cut_to_fit("y" * 70, fits) == [(0, 30), (30, 60), (60, 70)]


def test_split_with_a_limit_cuts_only_the_long_sentences():
    text = "Short one. " + ", ".join(f"clause number {i}" for i in range(12)) + ". End."
    split = documents.split_texts([text], fits=lambda part: len(part.split()) <= 10)
    assert split.units[0] == "Short one." and split.units[-1] == "End."
    assert all(len(u.split()) <= 10 for u in split.units)
    assert split.join(split.units) == [text]


@pytest.mark.parametrize("name", ["markup", "alignment"])
def test_the_old_document_paths_re_export_the_documents_modules(name):
    import importlib

    old_module = importlib.import_module(f"keras_transformer.{name}")
    new_module = importlib.import_module(f"keras_transformer.documents.{name}")
    public = [key for key in vars(new_module) if not key.startswith("_")]
    assert public and all(getattr(old_module, key) is getattr(new_module, key) for key in public)
    assert documents.split_texts is importlib.import_module("keras_transformer.documents.sentences").split_texts
