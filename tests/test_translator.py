"""Translator, the translate / evaluate entry points, attention scores and plots."""

import io
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import tiny_model, to_numpy
from keras_transformer.evaluate import evaluate
from keras_transformer.evaluate import main as evaluate_main
from keras_transformer.generation import generate
from keras_transformer.tokenizers.sentencepiece import train_tokenizer
from keras_transformer.translate import main as translate_main
from keras_transformer.translator import Translator

SUBJECTS = ["The teacher", "A student", "My neighbour", "The old owner", "Our children", "Nobody"]
VERBS = ["likes", "sees", "paints", "crosses", "changes", "finds"]
OBJECTS = ["the street", "a house", "the big garden", "two cats", "the red car", "it"]
ENDINGS = [".", "!"]
SENTENCES = [f"{s} {v} {o}{e}" for s, v, o, e in itertools.product(SUBJECTS, VERBS, OBJECTS, ENDINGS)]  # 432
TEXTS = ["Nobody sees it!", "", "The old owner paints the big garden.", "A student finds two cats.", "   ",
         "Our children like the red car."]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SENTENCES, vocabulary_size=120)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(vocabulary_size=tokenizer.vocabulary_size, seed=3)


@pytest.fixture(scope="module")
def preset(tmp_path_factory, model, tokenizer):
    directory = tmp_path_factory.mktemp("presets") / "tiny_with_tokenizer"
    model.save_to_preset(directory, tokenizer=tokenizer)
    return str(directory)


class CopyModel:
    """Decoding protocol in NumPy: predicts the source token at each position.

    Source `tokens + [end]` -> target `[start] + tokens + [end]`, so a
    translator built on it must give back its input text.
    """

    pad_id, unk_id, start_id, end_id = 0, 1, 2, 3

    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size

    def encode(self, encoder_token_ids):
        return np.zeros(tuple(encoder_token_ids.shape) + (1,), "float32")

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        return {"source": to_numpy(encoder_token_ids)}

    def decode_step(self, token_ids, index, cache):
        source = to_numpy(cache["source"])
        target = source[:, min(index, source.shape[1] - 1)]
        logits = np.full((source.shape[0], self.vocabulary_size), -10.0, "float32")
        logits[np.arange(len(target)), np.where(target > 0, target, self.end_id)] = 10.0
        return logits, {"source": source}


# ---------------------------------------------------------------------- #
# Translator
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("beam_size", [1, 3])
def test_round_trip_through_the_tokenizer_keeps_order_and_empty_strings(tokenizer, beam_size):
    translator = Translator(CopyModel(tokenizer.vocabulary_size), tokenizer)
    # batch_size=2: several batches, sorted by length, so the order must be restored.
    out = translator.translate(TEXTS, beam_size=beam_size, batch_size=2)
    assert out == ["Nobody sees it!", "", "The old owner paints the big garden.", "A student finds two cats.",
                   "", "Our children like the red car."]


def test_finished_tells_each_text_once_empty_ones_first_then_each_batch(tokenizer):
    """A model without a step driver: `finished` hears each batch's texts when the batch is done."""
    model = CopyModel(tokenizer.vocabulary_size)
    searches, encode = [], model.encode
    model.encode = lambda ids: searches.append(len(ids)) or encode(ids)
    translator = Translator(model, tokenizer)
    told = []
    out = translator.translate(TEXTS, beam_size=1, batch_size=2,
                               finished=lambda i, text: told.append((i, text, len(searches))))
    assert sorted((i, text) for i, text, _ in told) == sorted(enumerate(out))
    assert out == translator.translate(TEXTS, beam_size=1, batch_size=2)
    # Nothing to translate: told before any search; then the two texts of each batch once it is done.
    assert [(i, searches) for i, _, searches in told[:2]] == [(1, 0), (4, 0)]
    assert [searches for _, _, searches in told[2:]] == [1, 1, 2, 2]
    told.clear()
    found = translator.translate_hypotheses(["Nobody sees it!", "A student finds two cats."], beam_size=2,
                                            num_hypotheses=2, finished=lambda i, hypotheses: told.append((i, hypotheses)))
    assert sorted(told) == sorted(enumerate(found))
    with pytest.raises(ValueError, match="finished cannot be used with split_sentences"):
        translator.translate(TEXTS, split_sentences=True, finished=lambda i, text: None)


def test_translator_equals_generating_each_sentence_alone(model, tokenizer):
    translator = Translator(model, tokenizer)
    texts = [t for t in TEXTS if t.strip()]
    out = translator.translate(texts, beam_size=2, batch_size=3, max_extra_length=5)
    for text, translation in zip(texts, out):
        source = np.array(tokenizer.encode([text], add_start=False, add_end=True), "int32")
        assert source[0, -1] == tokenizer.end_id and tokenizer.start_id not in source
        ids = generate(model, source, beam_size=2, max_extra_length=5)
        assert translation == tokenizer.decode(ids)[0]


def test_translate_accepts_a_single_string_and_an_empty_list(tokenizer):
    translator = Translator(CopyModel(tokenizer.vocabulary_size), tokenizer)
    assert translator.translate("Nobody sees it!") == ["Nobody sees it!"]
    assert translator.translate([]) == []


def test_translator_errors(model, tokenizer):
    with pytest.raises(ValueError, match="tokenizer has 120 pieces but the model's vocabulary_size is 50"):
        Translator(tiny_model(), tokenizer)
    translator = Translator(model, tokenizer)
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        translator.translate(["a"], batch_size=0)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, received int"):
        translator.translate(["a", 5])
    with pytest.raises(TypeError, match="texts must be a str or a list of str, received NoneType"):
        translator.translate(None)
    with pytest.raises(ValueError, match="beam_size=0"):
        translator.translate(["Nobody sees it!"], beam_size=0)


def test_from_preset_needs_a_tokenizer(tmp_path, model):
    model.save_to_preset(tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match="has no tokenizer \\(tokenizer.model"):
        Translator.from_preset(str(tmp_path / "no_tokenizer"))
    with pytest.raises(ValueError, match="built-in architecture preset"):
        Translator.from_preset("tiny")


def test_from_preset_translates_like_the_saved_model(preset, model, tokenizer):
    loaded = Translator.from_preset(preset)
    texts = ["Nobody sees it!", "A student finds two cats."]
    assert loaded.translate(texts, beam_size=1) == Translator(model, tokenizer).translate(texts, beam_size=1)


def test_long_sources_are_cut_to_max_sequence_length(tokenizer):
    copy = CopyModel(tokenizer.vocabulary_size)
    copy.max_sequence_length = 6
    sentence = "The old owner paints the big garden."
    out = Translator(copy, tokenizer).translate([sentence])[0]
    assert sentence.startswith(out) and out != sentence


# ---------------------------------------------------------------------- #
# python -m keras_transformer.translate
# ---------------------------------------------------------------------- #
def test_translate_cli_stdin_to_stdout(preset, monkeypatch, capsys):
    lines = ["Nobody sees it!", "", "A student finds two cats."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    translate_main(["--preset", preset, "--beam-size", "1", "--batch-size", "2"])
    captured = capsys.readouterr()
    expected = Translator.from_preset(preset).translate(lines, beam_size=1)
    assert captured.out.splitlines() == expected
    assert captured.out.splitlines()[1] == ""
    assert "Translating" in captured.err  # progress on stderr, a terminal
    # stderr redirected to a file or a pipe: no bar.
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    translate_main(["--preset", preset, "--beam-size", "1", "--batch-size", "2"])
    captured = capsys.readouterr()
    assert captured.out.splitlines() == expected and captured.err == ""


def test_translate_cli_files_and_refusal_to_overwrite(preset, tmp_path, capsys):
    source = tmp_path / "in.en"
    source.write_text("Nobody sees it!\nA student finds two cats.\n", encoding="utf-8")
    output = tmp_path / "out.de"
    args = ["--preset", preset, "--input", str(source), "--output", str(output), "--beam-size", "1", "--no-progress"]
    translate_main(args)
    first = output.read_text(encoding="utf-8")
    assert len(first.splitlines()) == 2
    output.write_text("keep me\n", encoding="utf-8")
    with pytest.raises(SystemExit) as error:
        translate_main(args)
    assert error.value.code == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert output.read_text(encoding="utf-8") == "keep me\n"
    translate_main(args + ["--overwrite"])
    assert output.read_text(encoding="utf-8") == first
    assert sorted(os.listdir(tmp_path)) == ["in.en", "out.de"], "temporary file left behind"


def test_translate_cli_without_tokenizer_is_a_clear_error(tmp_path, model, monkeypatch, capsys):
    model.save_to_preset(tmp_path / "p")
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n"))
    with pytest.raises(SystemExit) as error:
        translate_main(["--preset", str(tmp_path / "p")])
    assert error.value.code == 2
    assert "has no tokenizer (tokenizer.model" in capsys.readouterr().err


@pytest.mark.slow
def test_translate_cli_as_a_module(preset):
    """`python -m keras_transformer.translate` in a fresh process, stdin -> stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer.translate", "--preset", preset, "--beam-size", "2"],
        input="Nobody sees it!\n\nA student finds two cats.\n",
        capture_output=True, text=True, timeout=300, check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    expected = Translator.from_preset(preset).translate(
        ["Nobody sees it!", "", "A student finds two cats."], beam_size=2)
    assert result.stdout.splitlines() == expected


# ---------------------------------------------------------------------- #
# evaluate
# ---------------------------------------------------------------------- #
def test_evaluate_scores_a_perfect_copy(tokenizer):
    translator = Translator(CopyModel(tokenizer.vocabulary_size), tokenizer)
    sentences = SENTENCES[:20]
    result = evaluate(translator, sentences, sentences, beam_size=1)
    assert result["bleu"] == pytest.approx(100.0)
    assert result["chrf"] == pytest.approx(100.0)
    assert result["bleu_signature"].startswith("BLEU|nrefs:1|")
    assert result["chrf_signature"].startswith("chrF2|")
    assert result["hypotheses"] == sentences
    with pytest.raises(ValueError, match="2 sources but 1 references"):
        evaluate(translator, ["a", "b"], ["a"])


def test_evaluate_cli_json_keys(preset, tmp_path, capsys):
    (tmp_path / "src.en").write_text("Nobody sees it!\nA student finds two cats.\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("Niemand sieht es!\nEine Studentin findet zwei Katzen.\n", encoding="utf-8")
    evaluate_main(["--preset", preset, "--src", str(tmp_path / "src.en"), "--ref", str(tmp_path / "ref.de"),
                   "--beam-size", "1", "--json", "--no-progress"])
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"bleu", "chrf", "bleu_signature", "chrf_signature", "bleu_details", "chrf_details",
                           "sentences",
                           "beam_size", "length_penalty", "preset", "quantize", "src", "ref"}
    assert result["sentences"] == 2 and result["beam_size"] == 1 and result["quantize"] is None
    assert 0.0 <= result["bleu"] <= 100.0 and 0.0 <= result["chrf"] <= 100.0


def test_evaluate_cli_needs_both_files(preset, tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate_main(["--preset", preset, "--src", str(tmp_path / "src.en")])
    assert "pass both --src and --ref" in capsys.readouterr().err


def test_evaluate_cli_text_output_on_the_bundled_test_split(preset, capsys):
    evaluate_main(["--preset", preset, "--limit", "3", "--beam-size", "1", "--no-progress",
                   "--max-extra-length", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert out[1].startswith("chrF2|nrefs:1|")


# ---------------------------------------------------------------------- #
# Attention scores and plots
# ---------------------------------------------------------------------- #
def test_attention_scores_shapes_and_masks(model):
    src = np.array([[5, 6, 7, 3, 0], [8, 3, 0, 0, 0]], "int32")
    tgt = np.array([[2, 9, 10], [2, 11, 0]], "int32")
    scores = model.attention_scores(src, tgt)
    assert sorted(scores) == ["cross_attention", "decoder_self_attention", "encoder_self_attention"]
    for name, shape in [("encoder_self_attention", (2, 4, 5, 5)), ("decoder_self_attention", (2, 4, 3, 3)),
                        ("cross_attention", (2, 4, 3, 5))]:
        assert len(scores[name]) == 2
        for weights in scores[name]:
            assert isinstance(weights, np.ndarray) and weights.shape == shape
            np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    cross = scores["cross_attention"][1]
    assert np.abs(cross[0, :, :, 4]).max() < 1e-6 and np.abs(cross[1, :, :, 2:]).max() < 1e-6  # padding keys
    self_attention = scores["decoder_self_attention"][0]
    assert np.abs(np.triu(self_attention, k=1)).max() < 1e-6  # causal


def test_plots_put_the_tokens_on_the_axes(model, tokenizer):
    from matplotlib.figure import Figure

    from keras_transformer.visualize import plot_attention, plot_attention_heads, token_labels

    src = np.array(tokenizer.encode(["Nobody sees it!"]), "int32")
    tgt = np.array([[2, 10, 11]], "int32")
    scores = model.attention_scores(src, tgt)
    source_labels = token_labels(tokenizer, np.pad(src[0], (0, 2)))  # padding dropped
    target_labels = token_labels(tokenizer, tgt[0])
    assert len(source_labels) == src.shape[1] and source_labels[-1] == "</s>" and target_labels[0] == "<s>"

    figure = plot_attention(scores["cross_attention"][1][0, 2], target_labels, source_labels, title="layer 2, head 3")
    assert isinstance(figure, Figure)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == source_labels
    assert [t.get_text() for t in ax.get_yticklabels()] == target_labels
    assert ax.get_title() == "layer 2, head 3"

    grid = plot_attention_heads(scores["encoder_self_attention"][0][0], source_labels, source_labels, columns=3)
    panels = [ax for ax in grid.axes if ax.get_title().startswith("head")]
    assert [ax.get_title() for ax in panels] == ["head 1", "head 2", "head 3", "head 4"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == source_labels
    two = plot_attention_heads(scores["encoder_self_attention"][0][0], heads=[0, 3])
    assert len([ax for ax in two.axes if ax.get_title().startswith("head")]) == 2
    figure.savefig(io.BytesIO(), format="png")  # renders

    with pytest.raises(ValueError, match=r"shape \[heads, query, key\], received shape \(3, 3\)"):
        plot_attention_heads(np.eye(3))
    with pytest.raises(ValueError, match="head 4 is outside"):
        plot_attention_heads(np.ones((4, 2, 2)) / 2, heads=[4])


def _rebuilt(document, translations):
    """`document` with each sentence of `translations` (a dict) replaced by its translation, in one pass."""
    import re

    pattern = re.compile("|".join(re.escape(s) for s in sorted(translations, key=len, reverse=True)))
    return pattern.sub(lambda match: translations[match.group(0)], document)


def test_split_sentences_translates_documents_as_their_sentences_one_by_one(model, tokenizer, tmp_path):
    translator = Translator(model, tokenizer)
    sentences = SENTENCES[5::41][:8]
    one_by_one = dict(zip(sentences, translator.translate(sentences, beam_size=2)))
    documents = [
        f"{sentences[0]}  {sentences[1]}\n\n{sentences[2]}", f"  {sentences[3]}\t{sentences[4]} ", sentences[5], "",
        "   ", f"{sentences[6]}\n{sentences[7]}\n",
    ]
    expected = [_rebuilt(d, one_by_one) for d in documents]
    assert translator.translate(documents, beam_size=2, split_sentences=True) == expected
    assert list(translator.translate_iterable(iter(documents), beam_size=2, window=2, split_sentences="en")) == expected
    # A file: one document per line, written back line for line.
    lines = [d.replace("\n", " ") for d in documents]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    translator.translate_file(tmp_path / "in.en", tmp_path / "out.de", beam_size=2, split_sentences=True)
    assert (tmp_path / "out.de").read_text(encoding="utf-8").split("\n")[:-1] == [
        _rebuilt(line, one_by_one) for line in lines
    ]


def test_split_sentences_cuts_a_long_sentence_to_the_model_limit_instead_of_truncating(model, tokenizer, caplog):
    translator = Translator(model, tokenizer)
    limit = model.max_sequence_length
    long = ", ".join(SENTENCES[i][:-1] for i in range(0, 200, 7)) + "."
    assert len(tokenizer.encode([long], add_end=True)[0]) > limit
    split = translator.split_texts([long])
    assert len(split.units) > 1 and split.join(split.units) == [long]
    assert all(len(tokenizer.encode([u], add_end=True)[0]) <= limit for u in split.units)
    assert all(u.endswith(",") for u in split.units[:-1])  # cut at clause boundaries
    with caplog.at_level("WARNING"):
        (translated,) = translator.translate([long], beam_size=1, split_sentences=True)
    assert "keeping the first" not in caplog.text  # nothing truncated
    assert translated == " ".join(translator.translate(split.units, beam_size=1))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(split_sentences="  "), "split_sentences='  ' must be False, True or a language code"),
        (dict(split_sentences=1), "split_sentences=1 must be False, True or a language code"),
        (dict(split_sentences=True, target_prefix=["Der"]), "split_sentences and target_prefix cannot be used"),
    ],
)
def test_split_sentences_refusals_are_one_line(model, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        Translator(model, tokenizer).translate(["Nobody sees it!"], **arguments)


def test_translate_cli_split_sentences(preset, monkeypatch, capsys):
    lines = ["Nobody sees it! A student finds two cats.", "", "The teacher likes the street."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    translate_main(["--preset", preset, "--beam-size", "1", "--split-sentences", "--no-progress"])
    expected = Translator.from_preset(preset).translate(lines, beam_size=1, split_sentences=True)
    assert capsys.readouterr().out.splitlines() == expected
