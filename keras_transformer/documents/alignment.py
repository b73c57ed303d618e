"""Word alignments from cross-attention: which source token each target token came from.

The rule (fairseq's and CTranslate2's): for each target token, the source
token of largest weight in the cross-attention of one decoder layer,
averaged over that layer's heads. Here the layer is the last
(`ALIGNMENT_LAYER`), all its heads are averaged, and the source's end token
is left out of the argmax (as fairseq's `extract_hard_alignment`); the
CTranslate2 export sets `alignment_layer` and `alignment_heads` so that its
`return_attention` averages the same heads of the same layer.

The attention is the decoder's own for the tokens it was given: a model's
`alignment_attention(encoder_token_ids, decoder_token_ids)` (the decoding
protocol's optional method: `TransformerModel`, and `OnnxSeq2Seq` with an
export that has the fused decoder step) decodes a finished hypothesis once
more, teacher forced, and returns each position's head-averaged weights.
The decoder is causal, so these are the weights the search computed for the
hypothesis at each of its steps, along its own beam history, without the
search carrying any attention (its speed is unchanged).

NumPy only: the ONNX Runtime server imports it.
"""

from typing import NamedTuple

import numpy as np

# The decoder layer whose cross-attention aligns (Python indexing: -1 is the last).
ALIGNMENT_LAYER = -1
# SentencePiece's word-start mark: a piece that begins with it begins a word.
WORD_START = "\u2581"
# subword-nmt's word-end mark (FSMT's BPE): a piece that ends with it ends a word.
WORD_END = "</w>"


class WordAlignment(NamedTuple):
    """One target word and the source words aligned to it (`Hypothesis.word_alignment`).

    Attributes:
        target: `(start, end)`, the word's characters in the translation, `text[start:end]`.
        source: tuple of `(start, end)`, the aligned words' characters in the
            source text, in source order (empty when every piece of the word
            aligns to a source piece outside the text).
    """

    target: tuple
    source: tuple


def hard_alignment(attention, source_length, target_length):
    """The source position each target token aligns to: the argmax of its attention row.

    Args:
        attention: float `[T, S]`, row t the weights of decoder position t
            (which predicted target token t + 1; position 0 holds the start id).
        source_length: the source's ids, its end id included; the end id
            (the last) is left out of the argmax unless it is all there is.
        target_length: the target's tokens, the end id excluded.

    Returns:
        list of `target_length` ints in `0 .. source_length - 2`.
    """
    readable = max(int(source_length) - 1, 1)
    return np.argmax(np.asarray(attention)[:target_length, :readable], axis=-1).tolist()


def word_spans(pieces, text):
    """The words of `pieces` as character spans of `text`, and the word of each piece.

    A piece that starts with "▁" (SentencePiece), the first piece, and a
    piece after one that ends with "</w>" (subword-nmt's BPE) start a word.
    Each piece is found in `text` after the previous one (leading whitespace
    and the marks skipped); a piece not found there (a special piece, or text
    the tokenizer normalized) spans no characters, at the place it was looked for.

    Returns:
        `(spans, word_of_piece)`: a list of `(start, end)` per word, and a
        list with the index into `spans` of each piece.

    Example:
    >>> word_spans(["▁The", "▁c", "ats"], "The cats")
    ([(0, 3), (4, 8)], [0, 1, 1])
    """
    spans, word_of_piece, cursor, word_ended = [], [], 0, True
    for piece in pieces:
        starts_word, word_ended = word_ended or piece.startswith(WORD_START), piece.endswith(WORD_END)
        surface = piece.removesuffix(WORD_END).replace(WORD_START, " ").strip()
        while cursor < len(text) and text[cursor].isspace() and surface:
            cursor += 1
        found = text.find(surface, cursor) if surface else -1
        start = found if found >= 0 and not text[cursor:found].strip() else cursor
        end = start + len(surface) if start == found else start
        if starts_word:
            spans.append((start, end))
        else:  # a word that spans nothing yet (a lone "▁") starts at its first found piece
            first, last = spans[-1]
            spans[-1] = (start, end) if first == last else (first, max(last, end))
        word_of_piece.append(len(spans) - 1)
        cursor = end
    return spans, word_of_piece


def word_alignment(alignment, source_pieces, source_text, target_pieces, target_text):
    """Per target word, the source words its pieces align to, as character spans (`WordAlignment`).

    Args:
        alignment: per target piece, its source piece's position (`hard_alignment`).
        source_pieces, target_pieces: the pieces of each text, in order (no
            start or end pieces).
        source_text, target_text: the texts the spans index.

    Returns:
        list of `WordAlignment`, one per target word, in order.

    Example:
    >>> word_alignment([1, 0], ["▁a", "▁b"], "a b", ["▁B", "▁A"], "B A")
    [WordAlignment(target=(0, 1), source=((2, 3),)), WordAlignment(target=(2, 3), source=((0, 1),))]
    """
    source_spans, source_word = word_spans(source_pieces, source_text)
    target_spans, target_word = word_spans(target_pieces, target_text)
    aligned = [set() for _ in target_spans]
    for target, source in zip(target_word, alignment):
        if source < len(source_word):
            aligned[target].add(source_word[source])
    return [WordAlignment(span, tuple(source_spans[w] for w in sorted(words)))
            for span, words in zip(target_spans, aligned)]


def mean_heads(weights):
    """`[B, N, T, S]` attention weights -> float32 `[B, T, S]`, averaged over the heads."""
    return np.asarray(weights, np.float32).mean(axis=1)
