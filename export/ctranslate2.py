"""Export a TransformerModel to CTranslate2: `python -m export.ctranslate2`.

The weights as a CTranslate2 encoder-decoder Transformer (`TransformerSpec`),
built with CTranslate2's own specification classes and saved with
`model_spec.save` (no hand-written binary format), then validated against
Keras (greedy float32 tokens must be identical).

What the export maps, and how:

- Architecture: post-LN (`pre_norm=False`) as the paper, or pre-LN with a
  final LayerNorm per stack (`normalize_first=True`); the feed-forward
  activation (ReLU, the paper's; GELU or SiLU, which CTranslate2 calls
  SWISH, for imported checkpoints: `ACTIVATIONS`); `num_heads`;
  `key_dim == value_dim != hidden_dim // num_heads` as the spec's `head_dim`.
  LayerNorm epsilon: `config.json`'s `layer_norm_epsilon` is set to the
  model's (both default to 1e-5, CTranslate2's default for LayerNorms with a
  bias), so nothing is approximated.
- Kernels: Keras `Dense` kernels are `[in, out]`, CTranslate2 linear weights
  `[out, in]` (transposed). Self-attention is one fused QKV projection,
  cross-attention a query projection and a fused KV projection.
- Embeddings: our one matrix (encoder input, decoder input and pre-softmax
  projection, section 3.4) is given to all three; CTranslate2 stores it once
  (`model_spec` aliases equal variables). CTranslate2 multiplies embeddings
  by sqrt(d_model) by default (`scale_embeddings`), as we do.
- Positions: CTranslate2's built-in sinusoid is another function (positions
  from 1, all sines then all cosines, frequencies 10000^(-i / (d/2 - 1))), so our table
  (`layers.position.sinusoidal_table` in the model's layout: interleaved
  sin/cos, or Marian's sines then cosines, from position 0) is written as
  the position-encoding weights, `max_sequence_length` rows; learned
  positions (Table 3 row E) likewise.
- Ids: the vocabulary is the tokenizer's pieces in id order
  (`tokenizer.pieces()`, `shared_vocabulary.json`; an imported Marian
  checkpoint's are its vocab.json in our order, with the added start piece),
  so CTranslate2's ids are ours; `config.json`
  names our unknown, start and end pieces, the decoder starts with our start
  id and stops at our end id, and `add_source_eos` makes CTranslate2 append
  the end id to the source: callers pass the pieces *without* the end piece
  and the encoder sees `pieces + [end]`, what our Keras model reads.
- Our search never generates the pad or start id; the pre-softmax projection
  gets a bias of `SUPPRESSED_LOGIT` on those two ids (elsewhere 0, or the
  model's logits bias: Marian's `final_logits_bias`) so that CTranslate2
  does not either, without options. Greedy tokens are unchanged;
  CTranslate2's log-probabilities are then normalised over the other ids
  (ours over all, before excluding them), a difference of
  log(1 - P(pad) - P(start)) per token: negligible for a trained model,
  which gives those ids almost no probability.
- Alignments: the decoder spec's `alignment_layer` and `alignment_heads`
  are our alignment rule's (`keras_transformer.documents.alignment`: the last layer,
  every head averaged; CTranslate2's default is the first head), so
  `translate_batch(..., return_attention=True)` gives the weights whose
  argmax is `translate_hypotheses(return_alignment=True)`'s alignment.

Not expressible, refused with a message: `attention_window` (restricted
self-attention; CTranslate2's `sliding_window` is a causal cache window, and
its encoder has none), `key_dim != value_dim` (CTranslate2 splits its fused
projections in equal parts) and activations other than ReLU, GELU and SiLU.

Search differences (say so where users see them): CTranslate2's length
penalty is `score / |Y'| ** alpha` with |Y'| the tokens without the end
token; ours is GNMT's `score / ((5 + |Y|) / 6) ** alpha` with |Y| counting
the end token. Greedy search gives the same tokens (checked at every
export); beam search with `length_penalty=0` mostly does, but CTranslate2
finishes a hypothesis only from its best `beam_size` candidates (ours from
the best `2 * beam_size`, as tensor2tensor) and at the maximum length keeps
unfinished hypotheses (ours forces the end id); with alpha > 0 the penalties
differ too. With a length penalty it stops a row once `beam_size *
patience` hypotheses ended (`patience=1` by default); ours stops when no
live beam can beat the best finished hypothesis, unless given the same
`patience` (`generation.generate(..., patience=1)`). Its `translate_batch` defaults are not ours either:
`beam_size=2`, `length_penalty=1`, `min_decoding_length=1` (ours allows an
empty output), `max_decoding_length=256` for the whole batch (ours: each
row's source length + 50) and `max_input_length=1024`.
`max_decoding_length = len(pieces) + 50` (without the end piece) gives our
maximum for a row; it is one number per call, so pass the longest row's, at
most `max_sequence_length - 2`: the position table has `max_sequence_length`
rows and CTranslate2 fails beyond it, as our model refuses longer inputs.
`translation_options()` gives the other settings.

Modules: `export/ctranslate2_spec.py` (the specification from the weights,
the files, the search options), `export/ctranslate2_validate.py` (the
validation); this one writes the export and is its command, and every name
of those two stays importable from here.

The directory holds CTranslate2's `model.bin`, `config.json` and
`shared_vocabulary.json`, the tokenizer's files (when the preset has one:
our `tokenizer.model`, or an imported checkpoint's `source.spm`,
`target.spm`, `vocab.json` and `marian_tokenizer.json`) and
`keras_transformer.json` (format version, ids, the search settings that
reproduce ours, the length-penalty difference, versions, model config, the
validation result). It is written next to its final place and renamed at
the end, so a failed export (conversion or validation) leaves nothing behind.

Example:

```
python -m export.ctranslate2 --preset path/to/preset --output exported/ct2
python -m export.ctranslate2 --preset path/to/preset --output exported/ct2-int8 --quantization int8
```

Serving (needs only `ctranslate2` and `sentencepiece`):

```python
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before importing ctranslate2
import ctranslate2, sentencepiece

# One intra-op thread per translator: OpenMP threads spin while waiting, and
# on a busy machine with as many threads as cores that made it 2.5-40x
# slower; scale with inter_threads (parallel batches) instead.
translator = ctranslate2.Translator("exported/ct2", device="cpu", intra_threads=1, inter_threads=1)
sp = sentencepiece.SentencePieceProcessor(model_file="exported/ct2/tokenizer.model")
pieces = sp.encode(["A sentence."], out_type=str)   # no end piece: CTranslate2 appends it
results = translator.translate_batch(
    pieces, beam_size=4, length_penalty=0.6,         # CTranslate2's penalty: score / len ** 0.6
    min_decoding_length=0, max_input_length=MAX_SEQUENCE_LENGTH,   # the preset's max_sequence_length
    max_decoding_length=min(max(map(len, pieces)) + 50, MAX_SEQUENCE_LENGTH - 2),
)
print(sp.decode(results[0].hypotheses[0]))
```

An imported Marian checkpoint's pieces come from `source.spm` (a leading
`>>xx<<` language code is one piece: `source_pieces`) and its outputs are
decoded by `MarianTokenizer.decode` (NumPy and SentencePiece only):

```python
from keras_transformer.tokenizers.marian import MarianTokenizer

tokenizer = MarianTokenizer.load("exported/ct2")
index = {piece: i for i, piece in enumerate(tokenizer.pieces())}
pieces = [[tokenizer.pieces()[i] for i in ids] for ids in tokenizer.encode(["A sentence."], add_end=False)]
results = translator.translate_batch(pieces, ...)   # the same options as above
print(tokenizer.decode([[index[piece] for piece in results[0].hypotheses[0]]]))
```

An imported NLLB-200 checkpoint's source starts with its language code and
every translation with the target's (CTranslate2's `target_prefix`, as
Hugging Face's `forced_bos_token_id`); validation translates the bundled
sentences from eng_Latn to deu_Latn (`export.exporter.VALIDATION_LANGUAGES`):

```python
from keras_transformer.tokenizers.nllb import NllbTokenizer

tokenizer = NllbTokenizer.load("exported/ct2").with_languages("eng_Latn", "fra_Latn")
pieces = [tokenizer.source_pieces("A sentence.")]     # ["eng_Latn", ...]: CTranslate2 appends </s>
results = translator.translate_batch(pieces, target_prefix=[["fra_Latn"]], ...)
print(tokenizer.decode([[tokenizer.id_of(piece) for piece in results[0].hypotheses[0]]]))
```
"""

import logging
import sys

from export import contract
from export.contract import UnsupportedModelError, ValidationError  # noqa: F401 - importable from here
# The specification and the validation have their own modules; their names
# stay importable from here (plain re-exports).
from export.ctranslate2_spec import (  # noqa: F401
    ACTIVATIONS, CT2_CONFIG_FILE, FORMAT_VERSION, HEAD_DIM_CTRANSLATE2, METADATA_FILE, MIN_CTRANSLATE2, MODEL_FILE,
    SOURCE_VOCABULARY_FILE, SUPPRESSED_LOGIT, TARGET_VOCABULARY_FILE, VOCABULARY_FILE, _import_ctranslate2,
    _set_cross_attention, _set_feedforward, _set_fused_linear, _set_layer_norm, _set_linear,
    _set_self_attention, _version_tuple, _what_it_is, activation, check_exportable, is_ctranslate2_export,
    max_decoding_length, model_spec, position_table, projection_bias, read_metadata, source_pieces, source_vocabulary,
    translation_options, vocabulary, vocabulary_files,
)
from export.ctranslate2_validate import (  # noqa: F401
    LOG_PROB_ATOL, VALIDATION_SENTENCES, _check_files, _ctranslate2_outputs, _keras_log_probs, _validate,
    torch_threads_kept, validate_ctranslate2,
)
from export.exporter import MAX_EXTRA_LENGTH, OVERWRITE_ARGUMENT, Exporter, check_sentences  # noqa: F401
from export.exporter import float32 as _numpy  # noqa: F401
from export.exporter import keras_outputs as _keras_outputs  # noqa: F401
from export.exporter import validation_sources as _validation_sources  # noqa: F401
from keras_transformer.presets import jsonable_config

# Named, not __name__, so that `python -m export.ctranslate2` logs under the same name.
logger = logging.getLogger("export.ctranslate2")

# ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES, plus None (the weights'
# own float32). Only float32 is validated token for token.
QUANTIZATIONS = (
    None, "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
)


def _metadata(model, tokens, quantization, validation=None):
    return {
        "format_version": FORMAT_VERSION,
        "engine": "ctranslate2",
        "quantization": quantization or "float32",
        "vocabulary_size": model.vocabulary_size,
        **{name: getattr(model, name) for name in contract.SPECIAL_IDS},
        "end_piece": tokens[model.end_id],
        # The file `load_tokenizer` recognises the tokenizer by.
        "tokenizer": contract.tokenizer_files(model.tokenizer)[-1] if model.tokenizer is not None else None,
        "tokenizer_files": list(contract.tokenizer_files(model.tokenizer)) if model.tokenizer is not None else [],
        "source_input": (
            "SentencePiece pieces without the end piece (CTranslate2 appends it: add_source_eos)"
            + (model.tokenizer.source_input if model.tokenizer is not None else "")
        ),
        "suppressed_ids": {"ids": [model.pad_id, model.start_id], "projection_bias": SUPPRESSED_LOGIT},
        "logits_bias": "added to the projection bias" if model.logits_bias else None,
        "layer_norm_epsilon": float(model.layer_norm_epsilon),
        "max_sequence_length": model.max_sequence_length,
        "translate_options": dict(
            translation_options(max_sequence_length=model.max_sequence_length),
            max_decoding_length=f"len(pieces) + {MAX_EXTRA_LENGTH}, at most {model.max_sequence_length - 2}",
        ),
        "length_penalty": (
            "CTranslate2 scores a hypothesis log P(Y|X) / |Y'| ** length_penalty (|Y'| without the end "
            "token); keras_transformer uses GNMT's log P(Y|X) / ((5 + |Y|) / 6) ** length_penalty (|Y| "
            "with the end token). Greedy search gives the same tokens. Beams mostly agree with "
            "length_penalty=0, but CTranslate2 finishes hypotheses only from its best beam_size candidates "
            "(ours from 2 * beam_size) and at the maximum length keeps unfinished ones (ours forces the end "
            "id); with length_penalty > 0 they may differ more."
        ),
        "versions": contract.versions("ctranslate2"),
        "model_config": jsonable_config(model.get_config()),
        "validation": validation,
    }


def _write_metadata(directory, metadata):
    contract.write_config(directory, metadata, METADATA_FILE)


def _load_model(preset):
    """The model to export (`Exporter.load_model`: dropout off, LoRA merged; any backend)."""
    return EXPORTER.load_model(preset)


EXPORTER = Exporter(
    "CTranslate2", "python -m export.ctranslate2", "a CTranslate2 model", is_ctranslate2_export,
    int8_instead="--quantization int8 (CTranslate2's int8)", languages=True,
)


def check_output(output, overwrite, preset=None, flag=OVERWRITE_ARGUMENT):
    """`utils.check_output_directory` for a CTranslate2 export: only an earlier CTranslate2 model is replaced."""
    return EXPORTER.check_output(output, overwrite, preset, flag=flag)


def export_ctranslate2(
    preset, output, quantization=None, overwrite=False, validation_sentences=VALIDATION_SENTENCES
):
    """Exports a TransformerModel as a CTranslate2 model directory and validates it.

    Runs on every Keras backend (only the weights are read; validation runs
    `model.generate`).

    Args:
        preset: a built-in preset name, a preset directory (from
            `save_to_preset`), a Marian checkpoint directory or `hf://`
            handle (imported by `TransformerModel.from_preset`), or a
            `TransformerModel`.
        output: directory to create.
        quantization: `None` (float32) or one of CTranslate2's weight types
            (`"int8"`, `"int8_float32"`, `"int8_float16"`, `"int16"`,
            `"float16"`, ...). Only float32 must give Keras' tokens; other
            types are loaded and their agreement is reported.
        overwrite: bool, replace an existing `output`.
        validation_sentences: int >= 1, sentences of the bundled test split
            (random ids for a model without a tokenizer) translated by both.

    Returns:
        `pathlib.Path` of the exported directory.

    Raises:
        FileExistsError: `output` exists and `overwrite` is False.
        ValueError: `output` is the preset's directory, or not an earlier
            CTranslate2 model (`check_output`).
        UnsupportedModelError: the model cannot be expressed in CTranslate2.
        export.validate.ValidationError: a file or id does not match, or
            (float32) log-probabilities or greedy tokens differ from Keras'.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be one of {QUANTIZATIONS}")
    check_sentences(validation_sentences)
    output = check_output(output, overwrite, preset)
    _import_ctranslate2()

    model = _load_model(preset)
    tokens = vocabulary(model)
    spec = model_spec(model, tokens, source_vocabulary(model, tokens))
    with EXPORTER.staged(output, overwrite, preset) as staging:
        logger.info("Writing the CTranslate2 model (%s)", quantization or "float32")
        spec.optimize(quantization=quantization)
        spec.save(str(staging))
        if model.tokenizer is not None:
            model.tokenizer.save(staging)
        _write_metadata(staging, _metadata(model, tokens, quantization))
        logger.info("Validating %s against the Keras model", output)
        report = validate_ctranslate2(staging, model, sentences=validation_sentences)
        _write_metadata(staging, _metadata(model, tokens, quantization, validation=report))
    return output


def main(argv=None):
    parser = EXPORTER.parser(
        "Export a TransformerModel as a CTranslate2 model and check its greedy tokens against Keras."
    )
    parser.add_argument(
        "--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
        help="CTranslate2 weight type (default: the weights' float32; only float32 is checked token for token)",
    )
    parser.add_argument(
        "--validation-sentences", type=int, default=VALIDATION_SENTENCES,
        help=f"test-split sentences translated by both engines (default {VALIDATION_SENTENCES})",
    )
    return EXPORTER.main(parser, argv, lambda args: export_ctranslate2(
        args.preset, args.output, quantization=args.quantization, overwrite=args.overwrite,
        validation_sentences=args.validation_sentences,
    ))


if __name__ == "__main__":
    sys.exit(main())
