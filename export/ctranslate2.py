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
from keras_transformer.marian_tokenizer import MarianTokenizer

tokenizer = MarianTokenizer.load("exported/ct2")
index = {piece: i for i, piece in enumerate(tokenizer.pieces())}
pieces = [[tokenizer.pieces()[i] for i in ids] for ids in tokenizer.encode(["A sentence."], add_end=False)]
results = translator.translate_batch(pieces, ...)   # the same options as above
print(tokenizer.decode([[index[piece] for piece in results[0].hypotheses[0]]]))
```
"""

import argparse
import contextlib
import json
import logging
import os
import pathlib
import sys

import numpy as np

from export import contract
from export.contract import UnsupportedModelError, ValidationError
from keras_transformer.presets import jsonable_config
from keras_transformer.quantization import refuse_quantized
from keras_transformer.tokenizer import FIRST_ORDINARY_ID
from keras_transformer.utils import atomic_directory, check_output_directory

# Named, not __name__, so that `python -m export.ctranslate2` logs under the same name.
logger = logging.getLogger("export.ctranslate2")

FORMAT_VERSION = 1
METADATA_FILE = "keras_transformer.json"
MODEL_FILE = "model.bin"
CT2_CONFIG_FILE = "config.json"
VOCABULARY_FILE = "shared_vocabulary.json"
# A model whose encoder has a table of its own (`source_vocabulary_size`) and two vocabularies: CTranslate2's names.
SOURCE_VOCABULARY_FILE, TARGET_VOCABULARY_FILE = "source_vocabulary.json", "target_vocabulary.json"
# ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES, plus None (the weights'
# own float32). Only float32 is validated token for token.
QUANTIZATIONS = (
    None, "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
)
# Output bias of the pad and start ids: exp(-1e4) is 0 in every float type,
# and -1e4 is finite in float16 (which -1e9 is not).
SUPPRESSED_LOGIT = -1e4
MAX_EXTRA_LENGTH = 50  # the paper's maximum output length: source length + 50
VALIDATION_SENTENCES = 32
# Largest difference of a token's log-probability, CTranslate2 float32 vs Keras.
LOG_PROB_ATOL = 1e-3
MIN_CTRANSLATE2 = "4.5"
HEAD_DIM_CTRANSLATE2 = "4.6.3"  # the first whose encoder spec takes head_dim
# The feed-forward activations (Keras names) -> `ctranslate2.specs.common_spec.Activation`
# (Keras' "gelu" is the exact, erf one: CTranslate2's GELU, not GELUTanh).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH"}


def _import_ctranslate2():
    # OpenMP reads its wait policy when its runtime starts: PASSIVE (unless
    # the caller chose) so that idle CTranslate2 threads sleep rather than
    # spin on a busy machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import ctranslate2
    except ImportError as error:
        raise ImportError(
            f"CTranslate2 export needs ctranslate2>={MIN_CTRANSLATE2}: pip install 'keras-aiayn[ctranslate2]'"
        ) from error
    return ctranslate2


def _version_tuple(version):
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


# ---------------------------------------------------------------------- #
# Weights -> CTranslate2 specification
# ---------------------------------------------------------------------- #
def check_exportable(model):
    """Raises `UnsupportedModelError` if CTranslate2 cannot compute what `model` computes."""
    if model.attention_window is not None:
        raise UnsupportedModelError(
            f"attention_window={model.attention_window} (restricted self-attention, paper Table 1) "
            "cannot be expressed in CTranslate2: its sliding_window keeps the last tokens of the "
            "decoder cache, not a neighbourhood of each query, and its encoder has none"
        )
    if model.head_key_dim != model.head_value_dim:
        raise UnsupportedModelError(
            f"key_dim={model.head_key_dim} != value_dim={model.head_value_dim} cannot be expressed in "
            "CTranslate2: it splits its fused attention projections into equal query/key/value parts"
        )
    activation(model)


def activation(model):
    """The name in `common_spec.Activation` of the feed-forward activation all of `model`'s layers use."""
    return contract.feed_forward_activation(model, ACTIVATIONS, "a CTranslate2 Transformer")


def _numpy(variable):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(variable), dtype=np.float32)


def _set_linear(spec, dense):
    """A Keras `Dense` (kernel `[in, out]`) as a CTranslate2 linear (weight `[out, in]`)."""
    spec.weight = np.ascontiguousarray(_numpy(dense.kernel).T)
    spec.bias = _numpy(dense.bias)


def _set_fused_linear(spec, denses):
    """Several `Dense` of the same input as one projection: outputs concatenated."""
    spec.weight = np.concatenate([_numpy(dense.kernel).T for dense in denses], axis=0)
    spec.bias = np.concatenate([_numpy(dense.bias) for dense in denses], axis=0)


def _set_layer_norm(spec, norm):
    spec.gamma = _numpy(norm.gamma)
    spec.beta = _numpy(norm.beta)


def _set_self_attention(spec, attention, norm):
    _set_fused_linear(spec.linear[0], [attention.query_dense, attention.key_dense, attention.value_dense])
    _set_linear(spec.linear[1], attention.output_dense)
    _set_layer_norm(spec.layer_norm, norm)


def _set_cross_attention(spec, attention, norm):
    _set_linear(spec.linear[0], attention.query_dense)
    _set_fused_linear(spec.linear[1], [attention.key_dense, attention.value_dense])
    _set_linear(spec.linear[2], attention.output_dense)
    _set_layer_norm(spec.layer_norm, norm)


def _set_feedforward(spec, layer):
    _set_linear(spec.linear_0, layer.feedforward_intermediate)
    _set_linear(spec.linear_1, layer.feedforward_output)
    _set_layer_norm(spec.layer_norm, layer.feedforward_norm)


def position_table(model, position_layer):
    """`[max_sequence_length, D]` float32: what `position_layer` adds at positions 0, 1, ..."""
    if model.position_encoding == "learned":
        return _numpy(position_layer.position_embeddings)
    from keras_transformer.layers.position import sinusoidal_table

    # The layer's own layout: interleaved (the paper's) or halves (Marian's).
    positions = np.arange(model.max_sequence_length)
    return _numpy(sinusoidal_table(positions, model.hidden_dim, layout=position_layer.layout))


def projection_bias(model):
    """`[V]` float32, the pre-softmax projection's bias: the model's logits bias (if any), the pad and start ids
    at `SUPPRESSED_LOGIT`."""
    if model.logits_bias:
        bias = _numpy(model.logits_bias_weight).copy()
    else:
        bias = np.zeros((model.vocabulary_size,), np.float32)
    bias[[model.pad_id, model.start_id]] = SUPPRESSED_LOGIT
    return bias


def source_pieces(tokenizer, text):
    """The pieces a serving process gives CTranslate2 for `text`, with SentencePiece alone.

    Our `Tokenizer`: its SentencePiece model's pieces. A `MarianTokenizer`:
    a leading `>>xx<<` as one piece, then `source.spm`'s pieces of the rest
    (a piece CTranslate2's vocabulary lacks is its unk, as in
    `MarianTokenizer.encode`). No end piece: CTranslate2 appends it.
    The tokenizer's own `source_pieces`.
    """
    return tokenizer.source_pieces(text)


def vocabulary(model):
    """The target and source tokens in id order: the tokenizer's pieces.

    A model without a tokenizer (a built-in preset) gets placeholders:
    `<pad>`, `<unk>`, `<s>`, `</s>` at our special ids and `<i>` for id i.
    """
    size = model.vocabulary_size
    tokenizer = model.tokenizer
    if tokenizer is None:
        special = {model.pad_id: "<pad>", model.unk_id: "<unk>", model.start_id: "<s>", model.end_id: "</s>"}
        return [special.get(i, f"<{i}>") for i in range(size)]
    if tokenizer.vocabulary_size != size:
        raise ValueError(
            f"The tokenizer has {tokenizer.vocabulary_size} pieces but the model vocabulary_size={size}"
        )
    for name in contract.SPECIAL_IDS:
        if getattr(tokenizer, name) != getattr(model, name):
            raise ValueError(
                f"The tokenizer has {name}={getattr(tokenizer, name)}, the model {getattr(model, name)}"
            )
    pieces = tokenizer.pieces()
    if len(set(pieces)) != size:
        raise ValueError("The tokenizer's pieces are not unique; CTranslate2 maps tokens to ids by their text")
    return pieces


def source_vocabulary(model, tokens):
    """The source tokens in id order: `tokens`, unless the encoder has a table (and vocabulary) of its own."""
    if model.source_vocabulary_size is None:
        return tokens
    tokenizer = model.tokenizer
    if tokenizer is None:
        ordinary = range(FIRST_ORDINARY_ID, model.source_vocabulary_size)
        return vocabulary(model)[:FIRST_ORDINARY_ID] + [f"<{i}>" for i in ordinary]
    source = tokenizer.source_vocabulary() if hasattr(tokenizer, "source_vocabulary") else tokenizer.pieces()
    if len(source) != model.source_vocabulary_size or len(set(source)) != len(source):
        raise ValueError(f"The tokenizer has {len(source)} source pieces (unique: {len(set(source))}) but the model "
                         f"source_vocabulary_size={model.source_vocabulary_size}")
    return source


def vocabulary_files(tokens, source_tokens):
    """`(source file, target file)`: where CTranslate2 writes the vocabularies (one shared file when equal)."""
    if source_tokens == tokens:
        return VOCABULARY_FILE, VOCABULARY_FILE
    return SOURCE_VOCABULARY_FILE, TARGET_VOCABULARY_FILE


def model_spec(model, tokens, source_tokens=None):
    """The CTranslate2 `TransformerSpec` of `model`, with `tokens` as its shared vocabulary.

    Args:
        model: a `TransformerModel` (any backend; only its weights are read).
        tokens: list of `vocabulary_size` str, the token of each id.
        source_tokens: the encoder's tokens (`source_vocabulary`) where the
            model has a source table of its own; None: `tokens`.

    Returns:
        A `ctranslate2.specs.TransformerSpec`, validated, not yet optimised
        (quantised) or saved.
    """
    ctranslate2 = _import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    check_exportable(model)
    pre_norm = bool(model.normalize_first)
    layers = dict(
        num_heads=model.num_heads, pre_norm=pre_norm, activation=getattr(common_spec.Activation, activation(model))
    )
    # CTranslate2's per-head size defaults to hidden_dim / num_heads; head_dim sets any other.
    if model.head_key_dim * model.num_heads != model.hidden_dim:
        if _version_tuple(ctranslate2.__version__) < _version_tuple(HEAD_DIM_CTRANSLATE2):
            raise UnsupportedModelError(
                f"key_dim={model.head_key_dim} != hidden_dim / num_heads needs ctranslate2>={HEAD_DIM_CTRANSLATE2} "
                f"(head_dim in its encoder spec); installed: {ctranslate2.__version__}"
            )
        layers["head_dim"] = model.head_key_dim
    encoder = transformer_spec.TransformerEncoderSpec(len(model.encoder_layers), **layers)
    decoder = transformer_spec.TransformerDecoderSpec(len(model.decoder_layers), **layers)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    embeddings = _numpy(model.token_embedding.embeddings)  # [V, D]
    # Our embeddings are multiplied by sqrt(d_model) (section 3.4), CTranslate2's by default.
    encoder.scale_embeddings = True
    decoder.scale_embeddings = True
    # The encoder's own table where the model has one (`source_vocabulary_size`), else the shared matrix.
    source_table = model.source_token_embedding
    encoder.embeddings[0].weight = embeddings if source_table is None else _numpy(source_table.embeddings)
    encoder.position_encodings.encodings = position_table(model, model.encoder_position)
    for layer_spec, layer in zip(encoder.layer, model.encoder_layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm)
        _set_feedforward(layer_spec.ffn, layer)

    decoder.embeddings.weight = embeddings
    decoder.position_encodings.encodings = position_table(model, model.decoder_position)
    for layer_spec, layer in zip(decoder.layer, model.decoder_layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm)
        _set_cross_attention(layer_spec.attention, layer.cross_attention, layer.cross_attention_norm)
        _set_feedforward(layer_spec.ffn, layer)
    # The pre-softmax projection shares the embedding matrix (aliased when saved).
    decoder.projection.weight = embeddings
    decoder.projection.bias = projection_bias(model)
    if pre_norm:
        _set_layer_norm(encoder.layer_norm, model.encoder_final_norm)
        _set_layer_norm(decoder.layer_norm, model.decoder_final_norm)

    config = spec.config
    config.layer_norm_epsilon = float(model.layer_norm_epsilon)
    config.unk_token = tokens[model.unk_id]
    config.bos_token = tokens[model.start_id]
    config.eos_token = tokens[model.end_id]
    config.decoder_start_token = tokens[model.start_id]
    config.add_source_bos = False
    config.add_source_eos = True  # callers pass pieces; CTranslate2 appends the end piece
    spec.register_source_vocabulary(tokens if source_tokens is None else source_tokens)
    spec.register_target_vocabulary(tokens)
    spec.validate()
    logger.debug("CTranslate2 %s spec built", ctranslate2.__version__)
    return spec


# ---------------------------------------------------------------------- #
# Export
# ---------------------------------------------------------------------- #
def translation_options(beam_size=4, length_penalty=0.6, max_sequence_length=None, patience=None):
    """`translate_batch` keyword arguments closest to our `generate` (besides `max_decoding_length`).

    `length_penalty` is passed through, but CTranslate2 divides by
    `|Y'| ** alpha`, not GNMT's `((5 + |Y|) / 6) ** alpha`: identical tokens
    for greedy search and for alpha = 0 only. With `max_sequence_length`,
    longer sources are cut to it (the end id kept last; CTranslate2 counts
    the appended end id), which keeps them inside the position table; our
    model refuses them instead. `patience`: passed on when given (our
    `patience`, the same rule); None leaves CTranslate2's default, 1: it
    has no exact search.
    """
    return {
        "beam_size": beam_size,
        "length_penalty": length_penalty,
        "min_decoding_length": 0,  # ours allows an empty output (the end id first); CTranslate2's default is 1
        "max_input_length": max_sequence_length or 0,  # 0: no truncation (CTranslate2's default is 1024)
        "return_end_token": False,
        **({"patience": patience} if patience is not None else {}),
    }


def max_decoding_length(num_pieces, max_sequence_length, max_extra_length=MAX_EXTRA_LENGTH):
    """CTranslate2's `max_decoding_length` that reproduces our maximum output length.

    Ours: at most `n + max_extra_length` generated ids counting the end id,
    n = pieces + 1 (the end id), capped at `max_sequence_length - 1`.
    CTranslate2 counts tokens without the end token, so one fewer.
    """
    return max(min(num_pieces + 1 + max_extra_length, max_sequence_length - 1) - 1, 1)


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
            + (": source.spm's, after a leading >>xx<< piece" if _is_marian(model.tokenizer) else "")
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


def read_metadata(directory):
    """`keras_transformer.json` of an exported directory, checked for its format version.

    Raises:
        FileNotFoundError: the directory has no metadata (not our export).
        ValueError: another format version ("export again").
    """
    path = pathlib.Path(directory) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {METADATA_FILE}; {_what_it_is(directory)}")
    metadata = json.loads(path.read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version={metadata.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION}: export again with python -m export.ctranslate2"
        )
    return metadata


def _what_it_is(directory):
    """What to do with a directory that is not a CTranslate2 export of ours (ONNX export, preset, other)."""
    from keras_transformer.presets import is_preset_directory

    if contract.is_export_of(contract.ONNX)(directory):
        return "it is an ONNX export (python -m export.onnx): serve it with the onnxruntime engine (the default)"
    if is_preset_directory(directory):
        return (
            f"it is a Keras preset directory: export it first: "
            f"python -m export.ctranslate2 --preset {directory} --output CT2_DIR"
        )
    return "export the model with python -m export.ctranslate2"


def _is_marian(tokenizer):
    return tokenizer is not None and tokenizer.format == "marian"


def _load_model(preset):
    from keras_transformer.lora import merged_model
    from keras_transformer.model import TransformerModel

    if isinstance(preset, TransformerModel):
        model = merged_model(preset)  # LoRA adapters merged into the kernels
    else:
        model = TransformerModel.from_preset(preset, dropout=0.0)
    contract.check_exportable(model, "CTranslate2")
    return model


def is_ctranslate2_export(directory):
    """Whether a directory is a CTranslate2 model: ours (`METADATA_FILE`) or another converter's (model and config)."""
    directory = pathlib.Path(directory)
    theirs = (directory / MODEL_FILE).is_file() and (directory / CT2_CONFIG_FILE).is_file()
    return (directory / METADATA_FILE).is_file() or theirs


def check_output(output, overwrite, preset=None, flag="overwrite=True (--overwrite)"):
    """`utils.check_output_directory` for a CTranslate2 export: only an earlier CTranslate2 model is replaced."""
    return check_output_directory(
        output, overwrite, is_ctranslate2_export, "a CTranslate2 model (python -m export.ctranslate2)",
        source=preset, flag=flag,
    )


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
    if isinstance(validation_sentences, bool) or not isinstance(validation_sentences, int) or validation_sentences < 1:
        raise ValueError(f"validation_sentences={validation_sentences!r} must be an integer >= 1")
    output = check_output(output, overwrite, preset)
    _import_ctranslate2()

    model = _load_model(preset)
    refuse_quantized(model, "python -m export.ctranslate2", "--quantization int8 (CTranslate2's int8)")
    tokens = vocabulary(model)
    spec = model_spec(model, tokens, source_vocabulary(model, tokens))
    with atomic_directory(output) as staging:
        logger.info("Writing the CTranslate2 model (%s)", quantization or "float32")
        spec.optimize(quantization=quantization)
        spec.save(str(staging))
        if model.tokenizer is not None:
            model.tokenizer.save(staging)
        _write_metadata(staging, _metadata(model, tokens, quantization))
        logger.info("Validating %s against the Keras model", output)
        report = validate_ctranslate2(staging, model, sentences=validation_sentences)
        _write_metadata(staging, _metadata(model, tokens, quantization, validation=report))
    logger.info("Exported %s", output)
    return output


# ---------------------------------------------------------------------- #
# Validation
# ---------------------------------------------------------------------- #
def _validation_sources(model, count, seed=0):
    """`(texts or None, piece ids without the end id)` of `count` sources.

    With a tokenizer: sentences spread evenly over the bundled test split
    (for a multilingual Marian vocabulary, each led by one of its `>>xx<<`
    target-language codes in turn, as its tokenizer requires); without:
    random ordinary ids (`[FIRST_ORDINARY_ID, V)`) of lengths 1-24.
    """
    limit = model.max_sequence_length - 1  # room for the end id
    if model.tokenizer is not None:
        from keras_transformer.datasets import load_bundled

        english, _ = load_bundled("test")
        picks = np.linspace(0, len(english) - 1, min(count, len(english))).round().astype(int)
        texts = [english[i] for i in picks]
        codes = model.tokenizer.language_codes
        if codes:
            texts = [f"{codes[i % len(codes)]} {text}" for i, text in enumerate(texts)]
        ids = [row[:limit] for row in model.tokenizer.encode(texts, add_end=False)]
        return texts, ids
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, min(24, limit) + 1, size=count)
    size = getattr(model, "encoder_vocabulary_size", model.vocabulary_size)  # a source table of its own, or the shared
    return None, [rng.integers(FIRST_ORDINARY_ID, size, size=n).tolist() for n in lengths]


def _keras_outputs(model, ids, beam_size, length_penalty):
    """Our `generate`: generated ids without start and end, per row."""
    batch = np.zeros((len(ids), max(len(row) for row in ids) + 1), np.int32)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
        batch[i, len(row)] = model.end_id
    generated = model.generate(
        batch, beam_size=beam_size, length_penalty=length_penalty, max_extra_length=MAX_EXTRA_LENGTH
    )
    outputs = []
    for row in generated.tolist():
        row = row[1:]
        outputs.append(row[: row.index(model.end_id)] if model.end_id in row else row)
    return outputs


def _ctranslate2_outputs(translator, tokens, ids, max_sequence_length, beam_size, length_penalty,
                         source_tokens=None):
    """CTranslate2's tokens as ids, per row; rows of equal length share a call (one maximum length each)."""
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
    if isinstance(sentences, bool) or not isinstance(sentences, int) or sentences < 1:
        raise ValueError(f"sentences={sentences!r} must be an integer >= 1")
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
    texts, ids = _validation_sources(model, sentences)
    if model.tokenizer is not None:
        index = {token: i for i, token in enumerate(source_tokens)}
        for text, row in zip(texts, ids):
            pieces = source_pieces(model.tokenizer, text)[: len(row)]
            mapped = [index.get(piece, model.unk_id) for piece in pieces]
            if mapped != row:
                raise ValidationError(f"The pieces of {text!r} map to ids {mapped}; the tokenizer gives {row}")

    def describe(row):
        return repr(texts[row]) if texts is not None else f"ids {ids[row]}"

    translator = ctranslate2.Translator(str(directory), device="cpu", intra_threads=1, inter_threads=1)
    keras_outputs = _keras_outputs(model, ids, beam_size, length_penalty)

    # Values: both engines' log-probabilities of the same (Keras') outputs.
    scored = translator.score_batch(
        [[source_tokens[i] for i in row] for row in ids], [[tokens[i] for i in row] for row in keras_outputs],
        max_input_length=0,
    )
    expected = _keras_log_probs(model, ids, keras_outputs)
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
                                       source_tokens)
    identical = sum(a == b for a, b in zip(keras_outputs, ct2_outputs))
    first_difference = None
    for row, (ours, theirs) in enumerate(zip(keras_outputs, ct2_outputs)):
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


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.ctranslate2",
        description="Export a TransformerModel as a CTranslate2 model and check its greedy tokens against Keras.",
    )
    parser.add_argument("--preset", required=True,
                        help="built-in preset name, preset directory, Marian checkpoint directory or hf://org/name")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument(
        "--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
        help="CTranslate2 weight type (default: the weights' float32; only float32 is checked token for token)",
    )
    parser.add_argument(
        "--validation-sentences", type=int, default=VALIDATION_SENTENCES,
        help=f"test-split sentences translated by both engines (default {VALIDATION_SENTENCES})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("export").setLevel(logging.INFO)
    try:
        check_output(args.output, args.overwrite, args.preset, flag="--overwrite")
    except (FileExistsError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    try:
        export_ctranslate2(
            args.preset, args.output, quantization=args.quantization, overwrite=args.overwrite,
            validation_sentences=args.validation_sentences,
        )
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
