"""Documents into sentences and back: what `Translator.translate(..., split_sentences=True)` translates.

A text is cut into lines (at "\\n" only: `str.splitlines` would also cut
at form feeds, U+0085 and U+2028), each line into sentences by `sentencex`
(rule-based, with abbreviation lists for about 250 languages, no model to
download, a few hundred kilobytes), and each sentence is stripped of the
whitespace around it. Only those stripped sentences are translated; every
other character (indentation, the spaces between sentences, newlines,
paragraph breaks) is written back as it was, around the translations.

A sentence longer than the model's source limit is cut rather than
truncated, by one rule (`cut_to_fit`): at the last clause boundary (`,`
`;` `:` or a dash, followed by whitespace) whose left part fits, else at
the last whitespace whose left part fits, else at the longest prefix that
fits; then the rest is cut the same way. The parts are translated as
sentences and joined with the whitespace found at each cut.
"""

import dataclasses
import re

import sentencex

_CLAUSE_END = re.compile(r"[,;:\u2013\u2014](?=\s)|\s[-\u2013\u2014](?=\s)")
_WHITESPACE = re.compile(r"\s+")
_CORE = re.compile(r"\S(?:.*\S)?", re.DOTALL)  # from the first to the last non-space character
GENERIC_LANGUAGE = "en"
"""The rules `split_sentences=True` uses (sentencex's English: `.` `!` `?` and the like, with English
abbreviations); pass a language code (`split_sentences="de"`) for another language's abbreviations."""


@dataclasses.dataclass(frozen=True)
class Split:
    """The translatable units of some texts and how to put the texts back together.

    Attributes:
        units: list of str, the sentences (or parts of sentences) to
            translate, in order, no surrounding whitespace.
        pieces: per text, a list of str (kept as they are) and int (the
            index of a unit whose translation goes there).
    """

    units: list
    pieces: list

    def join(self, translations):
        """The texts with each unit replaced by its translation (`translations[i]` for `units[i]`)."""
        if len(translations) != len(self.units):
            raise ValueError(f"{len(translations)} translations for {len(self.units)} sentences")
        return ["".join(translations[p] if isinstance(p, int) else p for p in pieces) for pieces in self.pieces]


def sentence_spans(text, language=GENERIC_LANGUAGE):
    """`[(start, end)]`: where `text`'s sentences are, each without the whitespace around it.

    Lines (cut at "\\n") are never joined into one sentence.

    Example:
    >>> text = "  Open the deck. Click OK!\\n\\nNext."
    >>> [text[s:e] for s, e in sentence_spans(text)]
    ['Open the deck.', 'Click OK!', 'Next.']
    """
    spans, line_start = [], 0
    for line in text.split("\n"):
        offset = line_start
        for segment in sentencex.segment(language, line) if line.strip() else ():
            core = _CORE.search(segment)
            if core is not None:
                spans.append((offset + core.start(), offset + core.end()))
            offset += len(segment)
        line_start += len(line) + 1
    return spans


def cut_to_fit(sentence, fits):
    """`[(start, end)]`: `sentence` cut into parts for which `fits(part)` is true (see the module's rule).

    Args:
        sentence: str without surrounding whitespace.
        fits: callable(str) -> bool, e.g. "at most the model's source
            length in tokens".

    Example:
    >>> cut_to_fit("one two, three four", lambda part: len(part) <= 10)
    [(0, 8), (9, 19)]
    """
    parts, start = [], 0
    while start < len(sentence):
        rest = sentence[start:]
        if fits(rest):
            parts.append((start, len(sentence)))
            break
        end = (_last_fitting([m.end() for m in _CLAUSE_END.finditer(rest)], rest, fits)
               or _last_fitting([m.start() for m in _WHITESPACE.finditer(rest)], rest, fits)
               or _longest_fitting_prefix(rest, fits))
        parts.append((start, start + end))
        following = _WHITESPACE.match(rest, end)
        start += following.end() if following else end
    return parts


def _last_fitting(cuts, text, fits):
    """The largest cut `c` in `cuts` (0 < c < len(text)) with `fits(text[:c].rstrip())`, or None."""
    for cut in sorted({c for c in cuts if 0 < c < len(text)}, reverse=True):
        if text[:cut].strip() and fits(text[:cut].rstrip()):
            return len(text[:cut].rstrip())
    return None


def _longest_fitting_prefix(text, fits):
    """The length of the longest prefix that fits (at least one character), by bisection."""
    low, high = 1, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(text[:middle]):
            low = middle
        else:
            high = middle - 1
    return low


def split_texts(texts, language=GENERIC_LANGUAGE, fits=None):
    """`Split` of `texts` into sentences (`sentence_spans`), each cut to fit (`cut_to_fit`) when `fits` is given.

    Example:
    >>> split = split_texts(["Hi. Bye.", "", "  Yes!\\n"])
    >>> split.units
    ['Hi.', 'Bye.', 'Yes!']
    >>> split.join([u.upper() for u in split.units])
    ['HI. BYE.', '', '  YES!\\n']
    """
    units, all_pieces = [], []
    for text in texts:
        pieces, position = [], 0
        for start, end in sentence_spans(text, language):
            for part_start, part_end in cut_to_fit(text[start:end], fits) if fits else [(0, end - start)]:
                pieces.append(text[position:start + part_start])
                pieces.append(len(units))
                units.append(text[start + part_start:start + part_end])
                position = start + part_end
        pieces.append(text[position:])
        all_pieces.append([p for p in pieces if p != ""])
    return Split(units, all_pieces)
