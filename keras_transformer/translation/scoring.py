"""`Translator.score`'s work: each target's log-probability given its source, teacher forced, in batches."""

from keras_transformer.search.scoring import score_targets
from keras_transformer.translation.batching import check_batch_limits, check_texts, length_batches, padded, progress_bar
from keras_transformer.translation.results import TargetScore


def score_pairs(translator, sources, targets, batch_size=None, max_batch_tokens=None, progress=False):
    """`Translator.score` of a translator already bound to its languages (see there for the arguments)."""
    sources, targets = check_texts(sources, "sources"), check_texts(targets, "targets")
    if len(sources) != len(targets):
        raise ValueError(
            f"sources has {len(sources)} texts but targets has {len(targets)}; score needs one target per source"
        )
    for i, text in enumerate(sources):
        if not text.strip():
            raise ValueError(
                f"sources[{i}] is empty; score needs a non-empty source text (an empty target is allowed)"
            )
    check_batch_limits(batch_size, max_batch_tokens)
    source_ids = translator.encode(sources)
    target_ids = translator.tokenizer.encode(targets, add_start=True, add_end=True, target=True)
    limit = getattr(translator.model, "max_sequence_length", None)
    for i, ids in enumerate(target_ids):
        if limit is not None and len(ids) - 1 > limit:
            raise ValueError(
                f"targets[{i}] has {len(ids) - 1} tokens (the end token included); the model scores at most "
                f"max_sequence_length={limit}"
            )
    results = [None] * len(sources)
    lengths = [max(len(s), len(t) - 1) for s, t in zip(source_ids, target_ids)]
    with progress_bar(progress, total=len(sources), desc="Scoring", unit=" pairs") as bar:
        for batch in length_batches(lengths, batch_size, max_batch_tokens):
            log_probs, token_log_probs = score_targets(
                translator.model, padded([source_ids[i] for i in batch]), padded([target_ids[i] for i in batch])
            )
            for row, i in enumerate(batch):
                count = len(target_ids[i]) - 1
                results[i] = TargetScore(
                    float(log_probs[row]), token_log_probs[row, :count].tolist(), list(target_ids[i][1:])
                )
            bar.update(len(batch))
    return results
