"""What a `Translator` returns beside plain text: `Hypothesis` (n-best) and `TargetScore` (scoring)."""

from typing import NamedTuple

import numpy as np


class TargetScore(NamedTuple):
    """The score of one target given its source (`Translator.score`).

    Attributes:
        log_prob: float, log P(target | source): the sum of `token_log_probs`.
        token_log_probs: list of float, one per target token, the end token
            included.
        token_ids: list of int, the target's token ids (the end id last),
            which `token_log_probs` scores.
    """

    log_prob: float
    token_log_probs: list
    token_ids: list


class Hypothesis(NamedTuple):
    """One output of the search for a text (`Translator.translate_hypotheses`).

    Attributes:
        text: str, the translation.
        token_ids: list of int, its token ids (the end id last).
        log_prob: float, log P(token_ids | source) under the search's token
            rule: what `Translator.score` gives the same ids.
        score: float, the search's score: `log_prob` divided by the GNMT
            length penalty `length_penalty_factor(len(token_ids), alpha)`.
        alignment: None, or with `return_alignment=True` a list with, for
            each token of `token_ids` but the end id, the position of its
            source token in the source's ids (`keras_transformer.documents.alignment`).
        word_alignment: None, or with `return_alignment=True` a list of
            `alignment.WordAlignment(target, source)`, one per word of `text`:
            its `(start, end)` characters in `text` and those of the source
            words it aligns to in the source text.
    """

    text: str
    token_ids: list
    log_prob: float
    score: float
    alignment: list = None
    word_alignment: list = None


def row_hypotheses(tokenizer, found, row):
    """The `Hypothesis` list of one row of `generate_hypotheses`' output, unfilled slots left out."""
    sequences = found.sequences[row]  # [n, L]
    texts = tokenizer.decode(sequences)
    results = []
    for sequence, text, score, log_prob in zip(sequences, texts, found.scores[row], found.log_probs[row]):
        if not np.isfinite(score):
            continue
        ends = np.flatnonzero(sequence[1:] == tokenizer.end_id)
        token_ids = sequence[1: int(ends[0]) + 2].tolist() if len(ends) else sequence[1:].tolist()
        results.append(Hypothesis(text, token_ids, float(log_prob), float(score)))
    return results
