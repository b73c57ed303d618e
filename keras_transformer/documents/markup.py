"""HTML in, HTML out: what `Translator.translate(..., format="html")` translates.

The parser is the standard library's `html.parser.HTMLParser` (CPython's,
maintained and security-fixed with the interpreter; no dependency, so the
server's `[serve]` extra needs nothing more). It is a tokenizer that refuses
nothing but an unknown marked section (`<![foo[`: one line here); the tree is
built here (`_TreeBuilder`), without recursion, with the repairs a browser
makes most often: `<p>`, `<li>`, `<td>`, ... end where the next one starts,
an end tag closes the elements left open inside it, a stray end tag is
dropped, and what is open at the end is closed. It was chosen over lxml
(lxml 6.x, libxml2 2.14: writes entities anew, `&eacute;` as `&#233;`, and
wraps fragments, so "kept as they were" would not hold; and deeper than
about 255 levels it stops nesting without a word), html5lib (pure Python, no
release since 2020) and BeautifulSoup (a wrapper over one of these; lxml is
only installed here for sacrebleu): it reports each token where it starts in
the text, so start tags, entities, comments and untranslatable elements are
written back exactly as they were written.

What is translated: each *run* of text and inline elements (`INLINE`: `<b>`,
`<i>`, `<a>`, `<span>`, `<em>`, `<strong>`, ...) inside a block (`<p>`,
`<li>`, `<h1>`, `<td>`, `<title>`, a `<div>`'s own text, a fragment's top
level) is one translation input, with its whitespace collapsed as a browser
shows it (with `split_sentences`, cut into sentences like a text). A run ends
at a block, at an untranslatable element, at a void element (`<br>`, `<img>`)
and at a comment. Untranslatable, and written back unchanged: `<code>`,
`<pre>`, `<script>`, `<style>` and the rest of `UNTRANSLATABLE`, any element
with `translate="no"` or the class `notranslate`, everything inside them, every
attribute, and text that holds only whitespace.

How inline tags reach the translation (the word alignments of
`keras_transformer.documents.alignment`): a source word carries the inline elements
that enclose all of its characters; each target word takes those of every
source word it aligns to (none when it aligns to none), outermost first in
document order; consecutive target words with the same elements, and the
text between them, share one element; text between words with different
elements takes the elements they share. An element a translation splits in
two is written twice, with the same attributes. Characters that an entity
wrote in the source (`&nbsp;`, `&eacute;`) are written with that entity again;
`&`, `<` and `>` are always escaped.
"""

import dataclasses
import html
import html.parser
import re
from typing import NamedTuple

from keras_transformer.documents.alignment import WordAlignment

# Elements nested deeper than this are refused (a page nests a few dozen levels; browsers stop at 512).
MAX_DEPTH = 512
FORMATS = ("text", "html")
INLINE = frozenset(
    "a abbr acronym b bdi bdo big cite del dfn em font i ins label mark q rp rt ruby s small span strike strong "
    "sub sup time tt u".split()
)
UNTRANSLATABLE = frozenset("code kbd math pre samp script style svg template textarea var".split())
VOID = frozenset("area base br col embed hr img input keygen link meta param source track wbr".split())
# The implied end tags: an open element of the key's name ends where one of these starts (`_end_implied`).
_ENDS_P = frozenset(
    "address article aside blockquote details div dl fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 "
    "header hr main nav ol p pre section table ul".split()
)
_ENDED_BY = {
    "p": _ENDS_P, "li": {"li"}, "dt": {"dt", "dd"}, "dd": {"dt", "dd"}, "option": {"option", "optgroup"},
    "tr": {"tr", "tbody", "thead", "tfoot"}, "td": {"td", "th", "tr", "tbody", "tfoot"},
    "th": {"td", "th", "tr", "tbody", "tfoot"}, "thead": {"tbody", "tfoot"}, "tbody": {"tbody", "tfoot"},
}
_SPACE = " \t\n\r\f"
_ENTITY = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")
_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def check_format(format, target_prefix=None, **per_text):
    """Refuses a `format` other than "text" or "html", and "html" with options it cannot honour, in one line.

    Args:
        format: the value given.
        target_prefix: a prefix starts one input's translation; an HTML
            text is several inputs, so none is taken with "html".
        **per_text: other options given per text (`cancelled`, `finished`),
            None when not given.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} must be one of {', '.join(map(repr, FORMATS))}")
    if format == "html":
        for name, given in dict(per_text, target_prefix=target_prefix).items():
            if given is not None:
                raise ValueError(f"format='html' cannot be used with {name} (an HTML text is translated as "
                                 "several inputs, one per block)")


@dataclasses.dataclass(eq=False)
class _Element:
    tag: str
    start: str  # the start tag as written
    order: int  # document order: an element's ancestors have smaller ones
    opaque: bool = False  # untranslatable: written back as it was
    end: str = ""
    children: list = dataclasses.field(default_factory=list)
    flat: bool = False  # a translatable inline element holding only text and such elements, some of it not space


@dataclasses.dataclass(eq=False)
class _Text:
    raw: str  # as written
    text: str  # decoded


@dataclasses.dataclass(eq=False)
class _Markup:
    raw: str  # a comment, doctype or processing instruction, as written


@dataclasses.dataclass(eq=False)
class _Run:
    """Consecutive text and inline nodes translated as one input; `output` is their translation's HTML."""

    nodes: list
    output: str = None


class _TreeBuilder(html.parser.HTMLParser):
    """The tree of one document (`root`), its text nodes' raw form taken from where each token starts."""

    def __init__(self, document, name):
        super().__init__(convert_charrefs=True)
        self.document, self.name = document, name
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", document)]
        self.root = _Element(None, "", 0)
        self.open = [self.root]
        self.pending = None  # the last text node and where it starts: its raw ends where the next token starts
        self.count = 0

    def _position(self):
        line, column = self.getpos()
        return self.line_starts[line - 1] + column

    def _settle(self, end):
        """Gives the pending text node its raw form, `document[start:end]` when that decodes to its text."""
        if self.pending is not None:
            node, start = self.pending
            raw = self.document[start:end]
            # (script and style text is not decoded; "</>" and the like are read as nothing)
            node.raw = raw if node.text in (raw, html.unescape(raw)) else _escaped(node.text, {})
            self.pending = None

    def _add(self, node):
        self._settle(self._position())
        self.open[-1].children.append(node)

    def handle_starttag(self, tag, attrs):
        self._end_implied(tag)
        self.count += 1
        attributes = dict(attrs)
        parent = self.open[-1]
        opaque = (parent.opaque or tag in UNTRANSLATABLE or (attributes.get("translate") or "").lower() == "no"
                  or "notranslate" in (attributes.get("class") or "").split())
        element = _Element(tag, self.get_starttag_text(), self.count, opaque)
        self._add(element)
        if tag not in VOID:
            element.end = f"</{tag}>"
            self.open.append(element)
            if len(self.open) - 1 > MAX_DEPTH:
                line, _ = self.getpos()
                raise ValueError(f"{self.name} nests elements more than {MAX_DEPTH} deep (line {line}); the limit "
                                 f"is {MAX_DEPTH}")

    def _end_implied(self, tag):
        """Closes the element that `tag` ends (`<li>` an open `<li>`), with the inline elements and `<p>` in it."""
        for depth in range(len(self.open) - 1, 0, -1):
            element = self.open[depth]
            if tag in _ENDED_BY.get(element.tag, ()):
                while len(self.open) > depth:
                    self._close()
                return
            if element.tag not in INLINE and element.tag != "p":
                return

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:  # `<div/>` is a start tag in HTML: closed at once
            self._close()

    def handle_endtag(self, tag):
        self._settle(self._position())
        if any(element.tag == tag for element in self.open[1:]):  # else a stray end tag: dropped
            while self._close().tag != tag:
                pass

    def _close(self):
        element = self.open.pop()
        element.flat = (element.tag in INLINE and not element.opaque and all(
            isinstance(child, _Text) or child.flat for child in element.children
        ) and any(_has_text(child) for child in element.children))
        return element

    def handle_data(self, data):
        node = _Text("", data)
        self._add(node)
        self.pending = (node, self._position())

    def handle_comment(self, data):
        self._add(_Markup(f"<!--{data}-->"))

    def handle_decl(self, decl):
        self._add(_Markup(f"<!{decl}>"))

    def handle_pi(self, data):
        self._add(_Markup(f"<?{data}>"))

    def unknown_decl(self, data):
        self._add(_Markup(f"<![{data}]>"))

    def finish(self):
        self.close()
        self._settle(len(self.document))
        while len(self.open) > 1:
            self._close()
        return self.root


def _has_text(node):
    return (not _is_space(node.text)) if isinstance(node, _Text) else node.flat


def _is_space(text):
    return not text.strip(_SPACE)


def _escaped(text, entities):
    """`text` for HTML: characters an entity wrote written with it again, `& < >` escaped."""
    return "".join(entities.get(c) or _ESCAPES.get(c, c) for c in text)


def parse(document, name="text"):
    """The tree of `document` (see the module's repairs), or a one-line `ValueError` naming `name`."""
    builder = _TreeBuilder(document, name)
    try:
        builder.feed(document)
        return builder.finish()
    except AssertionError as error:  # html.parser's one refusal: an unknown marked section such as "<![foo[" ...
        raise ValueError(f"{name} is not HTML that can be read: {error}") from None


class Translated(NamedTuple):
    """A translation and its word alignment (a `Hypothesis` has both); spans index the unit and `text`."""

    text: str
    word_alignment: list = None


@dataclasses.dataclass(eq=False)
class _Unit:
    """A run's text as translated (whitespace collapsed), each character's inline elements, and how to write it."""

    text: str
    tags: list  # per character of `text`, a tuple of `_Element`, outermost first
    entities: dict  # character -> the entity that wrote it
    lead: str  # the whitespace before `text` and after it, written as it was
    trail: str


class Page:
    """One HTML text: `units` (str) to translate and `render(translations)` to write it back translated.

    Args:
        document: str, a fragment or a whole document.
        name: what errors call it, e.g. "texts[0]".

    Raises:
        ValueError: in one line naming `name` (elements nested deeper
            than `MAX_DEPTH`, a marked section the parser cannot read).
    """

    def __init__(self, document, name="text"):
        self.root = parse(document, name)
        self.runs = _collect_runs(self.root)
        self._units = [_unit(run) for run in self.runs]
        self.units = [unit.text for unit in self._units]

    def render(self, translations):
        """The document with each unit replaced by its translation (a `Translated` or `Hypothesis`, or None)."""
        if len(translations) != len(self.runs):
            raise ValueError(f"{len(translations)} translations for {len(self.runs)} units")
        for run, unit, found in zip(self.runs, self._units, translations):
            run.output = unit.lead + (_render(unit, found) if found is not None else "") + unit.trail
        return _serialize(self.root)


def translate_html(texts, translate, split=None, name="texts"):
    """`texts` (HTML) translated: every unit of every text in one call of `translate`, tags carried by alignment.

    Args:
        texts: list of str.
        translate: callable(list of str) -> list with, per str, a
            `Hypothesis` (or `Translated`) with its `word_alignment`, or None.
        split: None, or callable(list of str) -> `documents.Split`: the
            units are cut into sentences (`Translator.split_texts`).
        name: what errors call `texts`.

    Example:
    >>> def copy(units):  # a translation that copies its input, word for word
    ...     return [Translated(u, [WordAlignment(s, (s,)) for s in _word_spans(u)]) for u in units]
    >>> translate_html(["<p>Hello <b>big</b> world</p>"], copy)
    ['<p>Hello <b>big</b> world</p>']
    """
    pages = [Page(text, f"{name}[{i}]") for i, text in enumerate(texts)]
    units = [unit for page in pages for unit in page.units]
    if split is None:
        found = list(translate(units)) if units else []
    else:
        sentences = split(units)
        found = joined(sentences, list(translate(sentences.units)) if sentences.units else [])
    return render_pages(pages, found)


def render_pages(pages, translations):
    """Each `Page` rendered with its part of `translations` (one per unit of all pages, in order)."""
    results, start = [], 0
    for page in pages:
        results.append(page.render(translations[start:start + len(page.units)]))
        start += len(page.units)
    return results


def joined(split, translations):
    """Per text of `split` (`documents.Split`), its sentences' `translations` joined into one `Translated`.

    The word alignments' spans are moved from each sentence to the text.
    """
    results = []
    for pieces in split.pieces:
        text, words, source_at, target_at = [], [], 0, 0
        for piece in pieces:
            if isinstance(piece, str):
                text.append(piece)
                source_at, target_at = source_at + len(piece), target_at + len(piece)
                continue
            found = translations[piece]
            for word in (found.word_alignment or []) if found is not None else []:
                words.append(WordAlignment((word.target[0] + target_at, word.target[1] + target_at),
                                           tuple((s + source_at, e + source_at) for s, e in word.source)))
            translation = found.text if found is not None else ""
            text.append(translation)
            source_at, target_at = source_at + len(split.units[piece]), target_at + len(translation)
        results.append(Translated("".join(text), words))
    return results


def _collect_runs(root):
    """The runs of the tree in document order, each put in place of its nodes among its parent's children."""
    stack = [root]
    while stack:
        element = stack.pop()
        children, group = [], []
        for child in [*element.children, None]:
            if isinstance(child, _Text) or (isinstance(child, _Element) and child.flat):
                group.append(child)
                continue
            if any(_has_text(node) for node in group):
                children.append(_Run(group))
            else:
                children.extend(group)
            group = []
            if child is not None:
                children.append(child)
                if isinstance(child, _Element) and not child.opaque:
                    stack.append(child)
        element.children = children
    return [node for node in _walk(root) if isinstance(node, _Run)]


def _unit(run):
    """The `_Unit` of a run: its characters in order with the elements around each, whitespace collapsed."""
    characters, entities, stack = [], {}, [(node, ()) for node in reversed(run.nodes)]
    while stack:
        node, outer = stack.pop()
        if isinstance(node, _Text):
            for match in _ENTITY.finditer(node.raw):
                decoded = html.unescape(match.group())
                if len(decoded) == 1 and not (decoded.isascii() and (decoded.isalnum() or decoded in _SPACE)):
                    entities[decoded] = match.group()
            characters.extend((c, outer) for c in node.text)
        else:
            stack.extend((child, (*outer, node)) for child in reversed(node.children))
    first = next(i for i, (c, _) in enumerate(characters) if c not in _SPACE)
    last = max(i for i, (c, _) in enumerate(characters) if c not in _SPACE)
    text, tags = [], []
    for c, outer in characters[first:last + 1]:
        if c in _SPACE:
            if text[-1] == " ":
                continue
            c = " "
        text.append(c)
        tags.append(outer)
    lead, trail = (("".join(c for c, _ in part)) for part in (characters[:first], characters[last + 1:]))
    return _Unit("".join(text), tags, entities, lead, trail)


def _render(unit, found):
    """The HTML of a unit's translation: each word inside the inline elements of its aligned source words."""
    target, segments, position, previous = found.text, [], 0, ()
    for word in sorted(found.word_alignment or [], key=lambda w: w.target):
        start, end = word.target
        if start < position or not 0 <= start < end <= len(target):
            continue
        current = _word_tags(unit, word.source)
        segments.append((target[position:start], _shared(previous, current)))
        segments.append((target[start:end], current))
        position, previous = end, current
    segments.append((target[position:], ()))
    out, open_ = [], ()
    for text, tags in segments:
        if not text:
            continue
        kept = len(_shared(open_, tags))
        out.extend(element.end for element in reversed(open_[kept:]))
        out.extend(element.start for element in tags[kept:])
        out.append(_escaped(text, unit.entities))
        open_ = tags
    out.extend(element.end for element in reversed(open_))
    return "".join(out)


def _word_tags(unit, spans):
    """The elements that enclose all characters of any of the source words `spans`, outermost first."""
    found = set()
    for start, end in spans:
        if 0 <= start < end <= len(unit.tags):
            found |= set.intersection(*(set(unit.tags[i]) for i in range(start, end)))
    return tuple(sorted(found, key=lambda element: element.order))


def _shared(a, b):
    """The longest common start of two tuples of elements."""
    size = 0
    while size < min(len(a), len(b)) and a[size] is b[size]:
        size += 1
    return a[:size]


def _walk(root):
    """The tree's nodes in document order, each element's end tag (a str) after its children (no recursion)."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _Element):
            stack.append(node.end)
            stack.extend(reversed(node.children))


def _serialize(root):
    """The tree written back: tags and markup as written, runs as translated."""
    out = []
    for node in _walk(root):
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Element):
            out.append(node.start)
        else:
            out.append(node.output if isinstance(node, _Run) else node.raw)
    return "".join(out)


def _word_spans(text):
    """`(start, end)` of each run of non-space characters of `text`."""
    return [match.span() for match in re.finditer(r"\S+", text)]
