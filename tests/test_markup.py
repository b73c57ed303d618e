"""HTML in, HTML out (`keras_transformer.documents.markup`, `Translator.translate(format="html")`).

The tree, the units and the tag-carrying rule against translations made by
hand (a copy and a word reversal with their alignments), on every backend;
pages with nested inline tags, entities, untranslatable elements and broken
markup, each answered with HTML that a strict reading accepts, or refused in
one line; Keras against ONNX Runtime; a model trained to copy keeps `<b>`
on its word.
"""

import html.parser
import re

import numpy as np
import pytest

import keras_transformer as kt
from conftest import BACKEND, TINY_CORPUS, TINY_VOCABULARY_SIZE
from keras_transformer import documents
from keras_transformer.documents.alignment import WordAlignment
from keras_transformer.documents.markup import MAX_DEPTH, VOID, Page, Translated, translate_html

PAGES = {
    "nested inline": '<p>One <b>two <i>three</i></b> <a href="/x?a=1&amp;b=2" title="T">four</a> five.</p>',
    "entities": "<p>Caf&eacute; &amp; bar&nbsp;&lt;3&gt; &#169; &#x2014; B.</p>",
    "untranslatable": ("<div>Run <code>ls -l</code> now.<pre>keep <b>this</b>\n  as is</pre>"
                       "<script>if (a &amp;&amp; b < c) go();</script><style>p > b {x: 1}</style>"
                       '<p translate="no">Not <b>this</b> one.</p><span class="x notranslate">nor this</span></div>'),
    "document": ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>The title</title></head>\n"
                 "<body><h1>A head</h1><!-- a comment --><ul><li>one</li><li>two <em>words</em></li></ul>"
                 "<table><tr><td>a cell</td><td>b</td></tr></table><p>a<br>b <img src=x.png alt=\"an image\"> c</p>"
                 "</body></html>\n"),
    "unclosed": "<ul><li>one<li>two <b>bold<li><p>three<li>four</ul><p>para<p>next",
    "misnested": "<p><b>bold <i>both</b> italic</i> plain</p>",
    "stray end tags": "</div>text</span> more</p><p>x</b></p></td>",
    "self-closed": "<div/>after <span/>span <br/>line",
    "bare brackets": "a < b > c & d <> e </> f",
    "attributes": "<p id='a' data-x=\"1 &amp; 2\" hidden>Hello <a href=https://e.org/?q=1&r=2>link</a></p>",
}


class StrictReader(html.parser.HTMLParser):
    """Raises unless every element but a void one has its end tag, in order, and text holds no bare "<"."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.open = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):  # in HTML, "<div/>" is a start tag
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:] or 'nothing'}"
        self.open.pop()

    def handle_data(self, data):
        assert "<" not in data or self.open[-1:] in (["script"], ["style"]), f"a bare '<' in {data!r}"


def well_formed(document):
    reader = StrictReader()
    reader.feed(document)
    reader.close()
    assert not reader.open, f"left open: {reader.open}"
    return True


def _spans(text):
    return [match.span() for match in re.finditer(r"\S+", text)]


def copy(units):
    """Each unit translated to itself, each word aligned to itself."""
    return [Translated(unit, [WordAlignment(span, (span,)) for span in _spans(unit)]) for unit in units]


def reverse(units):
    """Each unit's words in reverse order, each aligned to where it was."""
    found = []
    for unit in units:
        spans = _spans(unit)[::-1]
        text = " ".join(unit[s:e] for s, e in spans)
        found.append(Translated(text, [WordAlignment(t, (s,)) for t, s in zip(_spans(text), spans)]))
    return found


def test_a_copy_writes_each_page_back_as_it_was():
    for name in ("nested inline", "entities", "untranslatable", "document", "attributes"):
        assert translate_html([PAGES[name]], copy) == [PAGES[name]], name


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_page_is_answered_with_well_formed_html(name):
    for translate in (copy, reverse, lambda units: [None] * len(units)):
        assert well_formed(translate_html([PAGES[name]], translate)[0])


def test_broken_markup_is_repaired_as_a_browser_does():
    assert translate_html([PAGES["unclosed"]], copy) == [
        "<ul><li>one</li><li>two <b>bold</b></li><li><p>three</p></li><li>four</li></ul><p>para</p><p>next</p>"]
    assert translate_html([PAGES["misnested"]], copy) == ["<p><b>bold <i>both</i></b> italic plain</p>"]
    assert translate_html([PAGES["stray end tags"]], copy) == ["text more<p>x</p>"]
    assert translate_html([PAGES["self-closed"]], copy) == ["<div/></div>after <span/></span>span <br/>line"]
    # ("</>" is read as nothing)
    assert translate_html([PAGES["bare brackets"]], copy) == ["a &lt; b &gt; c &amp; d &lt;&gt; e f"]


def test_each_block_is_one_unit_and_untranslatable_text_is_not_sent():
    assert Page(PAGES["document"]).units == ["The title", "A head", "one", "two words", "a cell", "b", "a", "b",
                                             "c"]
    assert Page(PAGES["untranslatable"]).units == ["Run", "now."]
    assert Page("<div>Intro <p>A <b>bold</b>\n   word.</p> tail</div>").units == ["Intro", "A bold word.", "tail"]
    assert Page("<p>  </p><b> </b>").units == []


def test_inline_tags_follow_their_aligned_words():
    assert translate_html([PAGES["nested inline"]], reverse) == [
        '<p>five. <a href="/x?a=1&amp;b=2" title="T">four</a> <b><i>three</i> two</b> One</p>']
    # A word aligned to words of two elements takes both; an element split in two is written twice.
    two = [Translated("xy z w", [WordAlignment((0, 2), ((0, 1), (2, 3))), WordAlignment((3, 4), ((4, 5),)),
                                 WordAlignment((5, 6), ((0, 1),))])]
    assert translate_html(["<b>a</b> <i>b</i> c"], lambda units: two) == ["<b><i>xy</i></b> z <b>w</b>"]
    # A word partly inside an element does not take it; a word aligned to nothing takes nothing.
    partly = [Translated("ab c", [WordAlignment((0, 2), ((0, 2),)), WordAlignment((3, 4), ())])]
    assert translate_html(["<b>a</b>b <b>c</b>"], lambda units: partly) == ["ab c"]


def test_untranslatable_elements_entities_and_attributes_are_kept():
    shout = lambda units: [Translated(unit.upper(), [WordAlignment(s, (s,)) for s in _spans(unit)]) for unit in units]
    page = translate_html([PAGES["untranslatable"]], shout)[0]
    for kept in ("<code>ls -l</code>", "<pre>keep <b>this</b>\n  as is</pre>",
                 "<script>if (a &amp;&amp; b < c) go();</script>", "<style>p > b {x: 1}</style>",
                 '<p translate="no">Not <b>this</b> one.</p>', '<span class="x notranslate">nor this</span>'):
        assert kept in page
    assert page.startswith("<div>RUN <code>") and "</code> NOW.<pre>" in page
    assert translate_html([PAGES["entities"]], shout) == ["<p>CAFÉ &amp; BAR&nbsp;&lt;3&gt; &#169; &#x2014; B.</p>"]
    assert translate_html([PAGES["attributes"]], shout) == [
        "<p id='a' data-x=\"1 &amp; 2\" hidden>HELLO <a href=https://e.org/?q=1&r=2>LINK</a></p>"]


def test_split_sentences_moves_the_alignments_to_the_block():
    page = "<p>The <b>first</b> one.  A <i>second</i> one!</p>"
    sentences = []

    def recorded(units):
        sentences.extend(units)
        return reverse(units)

    assert translate_html([page], recorded, documents.split_texts) == [
        "<p>one. <b>first</b> The one! <i>second</i> A</p>"]
    assert sentences == ["The first one.", "A second one!"]


def test_empty_and_large_documents_are_answered():
    assert translate_html(["", "   \n ", "<p></p>"], copy) == ["", "   \n ", "<p></p>"]
    large = "<p>A <b>bold</b> word &amp; one mor</p>\n" * 2500  # 100,000 characters
    assert len(large) == 100_000
    assert translate_html([large], copy) == [large]
    flat = "<p>x" * 10_000  # each <p> ends the one before: 10,000 paragraphs, not a nesting
    assert well_formed(translate_html([flat], copy)[0])


def test_deep_nesting_and_unreadable_markup_are_refused_in_one_line():
    deep = "<div>" * 10_000 + "x" + "</div>" * 10_000
    with pytest.raises(ValueError, match=rf"^texts\[1\] nests elements more than {MAX_DEPTH} deep \(line 1\); "
                                         rf"the limit is {MAX_DEPTH}$"):
        translate_html(["<p>fine</p>", deep], copy)
    inline = "<b>" * MAX_DEPTH + "x"  # at the limit: answered, and written without recursion
    assert translate_html([inline], copy) == [inline + "</b>" * MAX_DEPTH]
    with pytest.raises(ValueError, match=r"^texts\[0\] is not HTML that can be read: unknown status keyword 'foo'"):
        translate_html(["<![foo[ x ]]>"], copy)


@pytest.fixture(scope="module")
def keras_translator(tiny_preset_dir):
    return kt.Translator.from_preset(tiny_preset_dir)


def test_translate_refuses_html_with_what_it_cannot_take(keras_translator):
    with pytest.raises(ValueError, match=r"^format='xml' must be one of 'text', 'html'$"):
        keras_translator.translate(["x"], format="xml")
    with pytest.raises(ValueError, match=r"^format='html' cannot be used with target_prefix \(an HTML text"):
        keras_translator.translate(["<p>the cat</p>"], format="html", target_prefix=["the"])
    with pytest.raises(ValueError, match=r"^format='html' cannot be used with finished"):
        keras_translator.translate(["<p>the cat</p>"], format="html", finished=print)

    with pytest.raises(ValueError, match=rf"^texts\[0\] nests elements more than {MAX_DEPTH} deep \(line 1\)"):
        keras_translator.translate(["<span>" * 10_000], format="html")

    class NoAttention:  # a decoding-protocol model that gives no attention weights
        vocabulary_size, pad_id, start_id, end_id = keras_translator.model.vocabulary_size, 0, 2, 3

    translator = kt.Translator(NoAttention(), keras_translator.tokenizer)
    with pytest.raises(ValueError, match=r"^format='html' puts inline tags on the aligned words: return_alignment="
                                         r"True needs .* NoAttention does not give"):
        translator.translate(["<p>the cat</p>"], format="html")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the export holds the weights of the TensorFlow run's "
                    "tiny_preset_dir (the random initialisers differ by backend), as in test_alignment.py")
def test_onnx_runtime_answers_equal_keras(tiny_onnx_export, keras_translator):
    from export.runtime import OnnxTranslator

    pages = [PAGES["nested inline"].replace("One two three", "the cat sees"),
             "<p>the <b>old fish</b> likes <a href='#'>a red ball</a>. a dog sees <i>the cat</i>.</p>",
             PAGES["document"], PAGES["misnested"], ""]
    keywords = dict(format="html", beam_size=2, max_extra_length=4)
    ours = keras_translator.translate(pages, **keywords)
    assert OnnxTranslator(tiny_onnx_export).translate(pages, **keywords) == ours
    assert keras_translator.translate(pages, split_sentences=True, **keywords) == OnnxTranslator(
        tiny_onnx_export).translate(pages, split_sentences=True, **keywords)
    assert all(well_formed(page) for page in ours)
    assert ours[2].startswith("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="training dynamics differ by backend; the rule does not")
def test_a_model_trained_to_copy_keeps_each_tag_on_its_word():
    """One layer trained for 200 steps to copy strings of `TINY_CORPUS`'s words: each tag stays on its word."""
    import keras

    from keras_transformer import data, training

    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    tokenizer = kt.train_tokenizer(TINY_CORPUS, TINY_VOCABULARY_SIZE)
    words = sorted({word for line in TINY_CORPUS for word in line.rstrip(".").replace(".", "").split()})
    texts = [" ".join(rng.choice(words, size=rng.integers(3, 8))) for _ in range(2000)]
    sources = [np.array(ids, "int32") for ids in tokenizer.encode(texts, add_start=False, add_end=True)]
    targets = [np.concatenate([[tokenizer.start_id], source]).astype("int32") for source in sources]
    model = kt.TransformerModel(vocabulary_size=TINY_VOCABULARY_SIZE, num_layers=1, num_heads=4, hidden_dim=64,
                                intermediate_dim=128, dropout=0.0, max_sequence_length=16)
    training.compile_model(model, warmup_steps=100, learning_rate_scale=0.5, label_smoothing=0.1)
    model.fit(data.make_dataset(sources, targets, tokens_per_batch=640, seed=0, repeat=True), epochs=1,
              steps_per_epoch=200, verbose=0)
    pages = ["<p>the <b>cat</b> sees a dog</p>", "<p>my <i>old bird</i> eats <a href='#'>a red ball</a></p>",
             "<h1><b>the <i>big</i> fish</b> likes</h1><pre>the cat</pre><p>a dog <em>eats</em></p>"]
    assert kt.Translator(model, tokenizer).translate(pages, format="html", beam_size=1) == pages


# --------------------------------------------------------------------------- #
# The command and the server
# --------------------------------------------------------------------------- #
def test_the_command_translates_a_page_as_the_translator_does(tiny_preset_dir, keras_translator, tmp_path, capsys):
    from keras_transformer import translate

    page = tmp_path / "page.html"
    page.write_text("<html><body><h1>the <b>cat</b></h1>\n<p>a dog <i>sees</i> my bird.</p></body></html>\n")
    translate.main(["--preset", str(tiny_preset_dir), "--format", "html", "--beam-size", "1", "--max-extra-length",
                    "3", "--src", str(page), "--no-progress"])
    expected = keras_translator.translate([page.read_text()[:-1]], format="html", beam_size=1, max_extra_length=3)
    assert capsys.readouterr().out == expected[0] + "\n"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the export holds the weights of the TensorFlow run's "
                    "tiny_preset_dir, as in test_alignment.py")
def test_the_onnx_command_translates_a_page_as_the_onnx_translator_does(tiny_onnx_export, tmp_path, capsys):
    from export import runtime

    page = tmp_path / "page.html"
    page.write_text("<p>the <b>cat</b> sees <a href='#'>a dog</a>.</p>")
    assert runtime.main(["--model", str(tiny_onnx_export), "--format", "html", "--beam-size", "1",
                         "--max-extra-length", "3", "--src", str(page), "--no-progress"]) == 0
    expected = runtime.OnnxTranslator(tiny_onnx_export).translate(
        [page.read_text()], format="html", beam_size=1, max_extra_length=3)
    assert capsys.readouterr().out == expected[0] + "\n"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the ONNX export runs on the TensorFlow backend (test_serve.py)")
def test_the_server_answers_html_as_the_onnx_translator_and_refuses_in_one_line(tiny_onnx_export):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from export import serve
    from export.runtime import OnnxTranslator
    from test_serve import InProcessServer, post

    running = InProcessServer(serve.load_engine(tiny_onnx_export), max_extra_length=4, max_delay_ms=20,
                              request_timeout=10, max_text_chars=5000)
    try:
        pages = [PAGES["nested inline"].replace("One two three", "the cat sees"), PAGES["untranslatable"], "",
                 "<p>the <b>old fish</b> likes <a href='#'>a red ball</a>. a dog sees <i>the cat</i>.</p>"]
        translator = OnnxTranslator(tiny_onnx_export, providers=["CPUExecutionProvider"])
        for split in (False, True):
            answer = post(running.url, {"text": pages, "format": "html", "split_sentences": split})
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"translations": translator.translate(
                pages, format="html", split_sentences=split, beam_size=4, max_extra_length=4)}
        for extra, message in (
            ({"text": ["<div>" * 600]}, f"text[0] nests elements more than {MAX_DEPTH} deep (line 1); the limit is "
                                        f"{MAX_DEPTH}"),
            ({"text": ["<p>x</p>" * 1000]}, "text[0] has 8000 characters; the limit is 5000 (--max-text-chars)"),
            ({"text": ["<p>x</p>"], "target_prefix": ["the"]}, 'format "html" cannot be used with target_prefix'),
            ({"text": ["<p>x</p>"], "stream": True}, 'format "html" cannot be used with stream'),
            ({"text": ["<p>x</p>"], "format": "xml"}, "format must be \"text\" or \"html\", received 'xml'"),
        ):
            answer = post(running.url, {"format": "html", **extra})
            assert (answer.status_code, answer.json()) == (400, {"error": message})
    finally:
        running.close()
