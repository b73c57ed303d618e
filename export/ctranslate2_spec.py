"""The CTranslate2 model of a TransformerModel: its specification, its files, the options that reproduce our search.

`model_spec` builds CTranslate2's `TransformerSpec` from the weights (with
CTranslate2's own specification classes: no hand-written binary format);
`vocabulary` gives the tokens in id order; `translation_options` and
`max_decoding_length` are the `translate_batch` settings closest to our
`generate`; `read_metadata` and `is_ctranslate2_export` recognise an
exported directory. What is mapped, and how, is in `export/ctranslate2.py`'s
docstring; that module writes and validates the export and keeps every name
of this one importable.
"""

import json
import logging
import os
import pathlib

import numpy as np

from export import contract
from export.contract import UnsupportedModelError
from export.exporter import MAX_EXTRA_LENGTH, float32
from keras_transformer.documents.alignment import ALIGNMENT_LAYER

logger = logging.getLogger("export.ctranslate2")

FORMAT_VERSION = 1
METADATA_FILE = "keras_transformer.json"
MODEL_FILE = "model.bin"
CT2_CONFIG_FILE = "config.json"
VOCABULARY_FILE = "shared_vocabulary.json"
# A model whose encoder has a table of its own (`source_vocabulary_size`) and two vocabularies: CTranslate2's names.
SOURCE_VOCABULARY_FILE, TARGET_VOCABULARY_FILE = "source_vocabulary.json", "target_vocabulary.json"
# Output bias of the pad and start ids: exp(-1e4) is 0 in every float type,
# and -1e4 is finite in float16 (which -1e9 is not).
SUPPRESSED_LOGIT = -1e4
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
    if getattr(model.tokenizer, "legacy_behaviour", False):
        raise UnsupportedModelError(
            "an NLLB tokenizer with legacy_behaviour=True (sources as 'tokens </s> [language]') cannot be exported "
            "to CTranslate2, which appends </s> after the source itself; export it to ONNX (python -m export.onnx)"
        )
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


def _set_linear(spec, dense):
    """A Keras `Dense` (kernel `[in, out]`) as a CTranslate2 linear (weight `[out, in]`)."""
    spec.weight = np.ascontiguousarray(float32(dense.kernel).T)
    spec.bias = float32(dense.bias)


def _set_fused_linear(spec, denses):
    """Several `Dense` of the same input as one projection: outputs concatenated."""
    spec.weight = np.concatenate([float32(dense.kernel).T for dense in denses], axis=0)
    spec.bias = np.concatenate([float32(dense.bias) for dense in denses], axis=0)


def _set_layer_norm(spec, norm):
    spec.gamma = float32(norm.gamma)
    spec.beta = float32(norm.beta)


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
        return float32(position_layer.position_embeddings)
    from keras_transformer.layers.position import sinusoidal_table

    # The layer's own layout: interleaved (the paper's) or halves (Marian's).
    positions = np.arange(model.max_sequence_length)
    return float32(sinusoidal_table(positions, model.hidden_dim, layout=position_layer.layout))


def projection_bias(model):
    """`[V]` float32, the pre-softmax projection's bias: the model's logits bias (if any), the pad and start ids
    at `SUPPRESSED_LOGIT`."""
    if model.logits_bias:
        bias = float32(model.logits_bias_weight).copy()
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
    from keras_transformer.token_ids import FIRST_ORDINARY_ID

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
    # `return_attention` gives the alignment rule's attention (`keras_transformer.documents.alignment`): one layer's
    # cross-attention averaged over all its heads (CTranslate2's default averages the first head only).
    decoder = transformer_spec.TransformerDecoderSpec(
        len(model.decoder_layers), alignment_layer=ALIGNMENT_LAYER, alignment_heads=model.num_heads, **layers
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    embeddings = float32(model.token_embedding.embeddings)  # [V, D]
    # Our embeddings are multiplied by sqrt(d_model) (section 3.4), CTranslate2's by default.
    encoder.scale_embeddings = True
    decoder.scale_embeddings = True
    # The encoder's own table where the model has one (`source_vocabulary_size`), else the shared matrix.
    source_table = model.source_token_embedding
    encoder.embeddings[0].weight = embeddings if source_table is None else float32(source_table.embeddings)
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
# Search options
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


# ---------------------------------------------------------------------- #
# An exported directory
# ---------------------------------------------------------------------- #
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


def is_ctranslate2_export(directory):
    """Whether a directory is a CTranslate2 model: ours (`METADATA_FILE`) or another converter's (model and config)."""
    directory = pathlib.Path(directory)
    theirs = (directory / MODEL_FILE).is_file() and (directory / CT2_CONFIG_FILE).is_file()
    return (directory / METADATA_FILE).is_file() or theirs
