"""Validation of a CTranslate2 export: its files and ids, then its values and tokens against Keras'.

`validate_ctranslate2` is `export_ctranslate2`'s last step (and callable on
any exported directory): the order of optimum's validation, with the
sample of `export.exporter.validation_sources`.
"""

import contextlib
import json
import logging
import pathlib
import sys

import numpy as np

from export import contract
from export.contract import ValidationError
from export.ctranslate2_spec import (
    CT2_CONFIG_FILE, METADATA_FILE, MODEL_FILE, _import_ctranslate2, max_decoding_length, read_metadata,
    source_pieces, source_vocabulary, translation_options, vocabulary, vocabulary_files,
)
from export.exporter import check_sentences, keras_outputs, validation_sources, validation_tokenizer
from keras_transformer.translator import forced_prefix

logger = logging.getLogger("export.ctranslate2")

VALIDATION_SENTENCES = 32
# Largest difference of a token's log-probability, CTranslate2 float32 vs Keras.
LOG_PROB_ATOL = 1e-3


def _ctranslate2_outputs(translator, tokens, ids, max_sequence_length, beam_size, length_penalty,
                         source_tokens=None, prefix=None):
    """CTranslate2's tokens as ids, per row; rows of equal length share a call (one maximum length each).

    `prefix`: None or the ids every output starts with (CTranslate2's `target_prefix`).
    """
    index = {token: i for i, token in enumerate(tokens)}
    source_tokens = tokens if source_tokens is None else source_tokens
    outputs = [None] * len(ids)
    by_length = {}
    for row, source in enumerate(ids):
        by_length.setdefault(len(source), []).append(row)
    options = translation_options(beam_size, length_penalty, max_sequence_length)
    for length, rows in sorted(by_length.items()):
        results = translator.translate_batch(
            [[source_tokens[i] for i in ids[row]] for row in rows],
            target_prefix=None if prefix is None else [[tokens[i] for i in prefix]] * len(rows),
            max_decoding_length=max_decoding_length(length, max_sequence_length),
            **options,
        )
        for row, result in zip(rows, results):
            outputs[row] = [index[token] for token in result.hypotheses[0]]
    return outputs


def _check_files(directory, model, tokens, source_tokens=None):
    """Names and contents CTranslate2 and our metadata must agree on."""
    directory = pathlib.Path(directory)
    metadata = read_metadata(directory)
    expected = {"vocabulary_size": model.vocabulary_size}
    expected.update({name: getattr(model, name) for name in contract.SPECIAL_IDS})
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise ValidationError(f"{METADATA_FILE} has {key}={metadata.get(key)!r}; the model has {value!r}")
    tokenizer_files = contract.tokenizer_files(model.tokenizer) if model.tokenizer is not None else ()
    source_tokens = tokens if source_tokens is None else source_tokens
    files = vocabulary_files(tokens, source_tokens)
    for name in (MODEL_FILE, CT2_CONFIG_FILE, *sorted(set(files)), *tokenizer_files):
        if not (directory / name).is_file():
            raise ValidationError(f"{directory} has no {name}")
    for name, expected in zip(files, (source_tokens, tokens)):
        written = json.loads((directory / name).read_text(encoding="utf-8"))
        if written != expected:
            first = next((i for i, (a, b) in enumerate(zip(written, expected)) if a != b),
                         min(len(written), len(expected)))
            raise ValidationError(f"{name} differs from the tokenizer's pieces at id {first}")
    config = json.loads((directory / CT2_CONFIG_FILE).read_text())
    ct2_expected = {
        "unk_token": tokens[model.unk_id], "bos_token": tokens[model.start_id], "eos_token": tokens[model.end_id],
        "decoder_start_token": tokens[model.start_id], "add_source_eos": True, "add_source_bos": False,
        "layer_norm_epsilon": float(model.layer_norm_epsilon),
    }
    for key, value in ct2_expected.items():
        if config.get(key) != value:
            raise ValidationError(f"CTranslate2 {CT2_CONFIG_FILE} has {key}={config.get(key)!r}; expected {value!r}")
    return metadata


def _keras_log_probs(model, ids, outputs):
    """Teacher-forced log-probabilities of `outputs + [end]` under the Keras model, per row.

    Normalised over the ids the search may generate (not the pad and start
    ids), as CTranslate2 normalises with their suppressed logits.
    """
    from keras import ops

    sources = np.zeros((len(ids), max(len(row) for row in ids) + 1), np.int32)
    targets = np.zeros((len(ids), max(len(row) for row in outputs) + 1), np.int32)
    for i, (source, output) in enumerate(zip(ids, outputs)):
        sources[i, : len(source) + 1] = list(source) + [model.end_id]
        targets[i, : len(output) + 1] = [model.start_id] + list(output)
    logits = np.asarray(
        ops.convert_to_numpy(model({"encoder_token_ids": sources, "decoder_token_ids": targets})), np.float64
    )  # [B, T, V]
    logits[..., [model.pad_id, model.start_id]] = -np.inf
    log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return [
        [float(log_probs[i, t, token]) for t, token in enumerate(list(output) + [model.end_id])]
        for i, output in enumerate(outputs)
    ]


def validate_ctranslate2(
    directory, model, sentences=VALIDATION_SENTENCES, beam_size=1, length_penalty=0.0, atol=LOG_PROB_ATOL
):
    """Translates sample sentences with CTranslate2 and with Keras; compares tokens and log-probabilities.

    Its own step, in the order of optimum's validation: the files and ids
    (vocabulary, special tokens, what the encoder receives), then values
    (CTranslate2's `score_batch` log-probabilities of Keras' outputs against
    Keras' own, teacher-forced), then the searches' tokens. A float32 export
    must be within `atol` and, for greedy search, give the same tokens for
    every sentence; a quantized one is checked for loading and translating,
    and its agreement is reported (it differs by design).

    Args:
        directory: the exported directory (or its staging copy).
        model: the `TransformerModel` that was exported.
        sentences: int >= 1, how many sources (see `_validation_sources`).
        beam_size: 1 (greedy, the export's check) or more. Beams are compared
            and reported, not required to be equal: besides the length
            penalty (use `length_penalty=0`), CTranslate2 finishes a
            hypothesis only from its best `beam_size` candidates (ours from
            the best `2 * beam_size`) and at the maximum length keeps
            unfinished hypotheses (ours forces the end id).
        length_penalty: alpha on both sides.
        atol: float, largest log-probability difference allowed (float32).

    Returns:
        dict: `search`, `beam_size`, `length_penalty`, `sentences`,
        `identical`, `exact` (whether equality was required),
        `first_difference` (None or a description) and
        `largest_log_prob_difference`.

    Raises:
        export.validate.ValidationError: a file, name or id does not match,
            or (float32) log-probabilities differ beyond `atol` or greedy
            tokens differ; the message names the first differing sentence.
    """
    check_sentences(sentences, "sentences")
    with torch_threads_kept():
        return _validate(directory, model, sentences, beam_size, length_penalty, atol)


@contextlib.contextmanager
def torch_threads_kept():
    """Restores PyTorch's thread count after CTranslate2 has run in this process.

    A CTranslate2 `Translator` sets the OpenMP thread count of the whole
    process (its `intra_threads`), which PyTorch reads as its own: after an
    export's validation (one thread), PyTorch trained on one thread instead
    of two on this machine, with other numbers.
    """
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if before is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _validate(directory, model, sentences, beam_size, length_penalty, atol):
    """`validate_ctranslate2`'s work, its arguments checked."""
    ctranslate2 = _import_ctranslate2()
    directory = pathlib.Path(directory)
    tokens = vocabulary(model)
    source_tokens = source_vocabulary(model, tokens)
    metadata = _check_files(directory, model, tokens, source_tokens)
    float32 = metadata["quantization"] == "float32"
    exact = float32 and beam_size == 1
    # What the encoder receives: CTranslate2 maps each piece by its line in the
    # vocabulary and appends the end piece; ours is the tokenizer's ids + end.
    texts, ids = validation_sources(model, sentences)
    tokenizer = validation_tokenizer(model)  # a multilingual model's: bound to a language pair
    prefix = forced_prefix(tokenizer)
    if tokenizer is not None:
        index = {token: i for i, token in enumerate(source_tokens)}
        for text, row in zip(texts, ids):
            pieces = source_pieces(tokenizer, text)[: len(row)]
            mapped = [index.get(piece, model.unk_id) for piece in pieces]
            if mapped != row:
                raise ValidationError(f"The pieces of {text!r} map to ids {mapped}; the tokenizer gives {row}")

    def describe(row):
        return repr(texts[row]) if texts is not None else f"ids {ids[row]}"

    translator = ctranslate2.Translator(str(directory), device="cpu", intra_threads=1, inter_threads=1)
    keras_tokens = keras_outputs(model, ids, beam_size, length_penalty, prefix=prefix)

    # Values: both engines' log-probabilities of the same (Keras') outputs.
    scored = translator.score_batch(
        [[source_tokens[i] for i in row] for row in ids], [[tokens[i] for i in row] for row in keras_tokens],
        max_input_length=0,
    )
    expected = _keras_log_probs(model, ids, keras_tokens)
    largest, worst_row = 0.0, 0
    for row, (result, reference) in enumerate(zip(scored, expected)):
        actual = np.asarray(result.log_probs, np.float64)
        if actual.shape != (len(reference),):
            raise ValidationError(
                f"CTranslate2 scored {actual.shape[0]} tokens of sentence {row}; expected {len(reference)}"
            )
        difference = float(np.max(np.abs(actual - reference)))
        if not difference <= largest:  # NaN counts as the largest
            largest, worst_row = difference, row
    if float32 and not largest <= atol:
        raise ValidationError(
            f"CTranslate2 (float32) log-probabilities differ from Keras by {largest:.3g} > atol={atol:g} "
            f"on sentence {worst_row} ({describe(worst_row)})"
        )

    ct2_outputs = _ctranslate2_outputs(translator, tokens, ids, model.max_sequence_length, beam_size, length_penalty,
                                       source_tokens, prefix)
    identical = sum(a == b for a, b in zip(keras_tokens, ct2_outputs))
    first_difference = None
    for row, (ours, theirs) in enumerate(zip(keras_tokens, ct2_outputs)):
        if ours != theirs:
            position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            first_difference = (
                f"sentence {row} ({describe(row)}) differs at output position {position}: "
                f"Keras {ours[:position + 3]}..., CTranslate2 {theirs[:position + 3]}... "
                f"(lengths {len(ours)} and {len(theirs)})"
            )
            break
    search = "greedy" if beam_size == 1 else "beam"
    report = {
        "search": search,
        "beam_size": beam_size,
        "length_penalty": length_penalty,
        "sentences": len(ids),
        "identical": identical,
        "exact": exact,
        "first_difference": first_difference,
        "largest_log_prob_difference": largest,
    }
    if exact and first_difference is not None:
        raise ValidationError(
            f"CTranslate2 ({search}, float32) differs from Keras on {len(ids) - identical} of {len(ids)} "
            f"sentences; first: {first_difference}"
        )
    logger.info(
        "CTranslate2 %s (%s) gives Keras' tokens on %d of %d sentences; largest log-probability "
        "difference %.1e", search, metadata["quantization"], identical, len(ids), largest,
    )
    return report
