"""Word alignments of a `Translator`'s hypotheses (`translate_hypotheses(return_alignment=True)`).

The rule itself is `keras_transformer.documents.alignment`'s; here it is applied to a batch of hypotheses.
"""

from keras_transformer.documents.alignment import hard_alignment, word_alignment
from keras_transformer.translation.batching import padded


def check_alignment(model, return_alignment):
    """Refuses a `return_alignment` other than a bool, or True for a model that gives no attention weights."""
    if not isinstance(return_alignment, bool):
        raise ValueError(f"return_alignment={return_alignment!r} must be True or False")
    if not return_alignment:
        return
    if not callable(getattr(model, "alignment_attention", None)):
        raise ValueError(
            f"return_alignment=True needs the model's cross-attention weights (alignment_attention), which "
            f"{type(model).__name__} does not give; use a TransformerModel or an ONNX export "
            "(OnnxTranslator), or leave return_alignment out"
        )
    check = getattr(model, "check_alignment", None)  # optional: a model that can refuse before searching
    if callable(check):
        check()


def aligned_hypotheses(model, tokenizer, target_pieces, hypotheses, texts, sources):
    """`hypotheses` (a list of `Hypothesis` lists, one per text) with `alignment` and `word_alignment` set.

    Every hypothesis of the batch is decoded once more, teacher forced,
    in one call of the model's `alignment_attention`; `sources` are the
    texts' source ids; `target_pieces` the tokenizer's `pieces()`.
    """
    rows = [(i, hypothesis) for i, found in enumerate(hypotheses) for hypothesis in found]
    if not rows:
        return hypotheses
    end_id, pieces = tokenizer.end_id, target_pieces
    attention = model.alignment_attention(
        padded([sources[i] for i, _ in rows]),
        padded([[tokenizer.start_id, *hypothesis.token_ids] for _, hypothesis in rows]),
    )  # [R, T, S]
    aligned = [[] for _ in hypotheses]
    source_pieces = [tokenizer.source_pieces(text) for text in texts]
    for row, (i, hypothesis) in enumerate(rows):
        tokens = hypothesis.token_ids[:-1] if hypothesis.token_ids[-1:] == [end_id] else hypothesis.token_ids
        alignment = hard_alignment(attention[row], len(sources[i]), len(tokens))
        words = word_alignment(alignment, source_pieces[i], texts[i], [pieces[t] for t in tokens],
                               hypothesis.text)
        words = [word for word in words if word.target[0] < word.target[1]]  # pieces with no text (a language code)
        aligned[i].append(hypothesis._replace(alignment=alignment, word_alignment=words))
    return aligned
