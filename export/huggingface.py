"""Export a TransformerModel as a Hugging Face checkpoint: `python -m export.huggingface`.

The directory is what `MarianMTModel.save_pretrained` and
`MarianTokenizer.save_pretrained` write (`config.json`,
`generation_config.json`, `model.safetensors`; `source.spm`, `target.spm`,
`vocab.json`, `tokenizer_config.json`) and a model card (`README.md`), so
`transformers` loads it with `MarianMTModel.from_pretrained(DIR)` and
`MarianTokenizer.from_pretrained(DIR)`, and `huggingface-cli upload`
publishes it. The tensors are written with `safetensors` and NumPy alone:
exporting needs neither PyTorch nor `transformers`; validating does.

Marian (Hugging Face's `MarianMTModel`) is the paper's architecture with a
few more options, and every post-LN, sinusoidal `TransformerModel` is one
exactly:

| `TransformerModel`                         | Marian (`config.json`)                 |
|--------------------------------------------|----------------------------------------|
| `activation` relu / gelu / silu            | `activation_function` relu / gelu / swish |
| embeddings times sqrt(d_model), one matrix | `scale_embedding`, tied `model.shared` |
| `logits_bias` (or none: zeros)             | `final_logits_bias`                    |
| `source_vocabulary_size` (two tables)      | `share_encoder_decoder_embeddings: false`, `decoder_vocab_size`, `target_vocab.json` |
| `layer_norm_epsilon=1e-5`                  | PyTorch's LayerNorm default            |
| `position_encoding="sinusoidal_halves"`    | its own table (sin \\| cos halves)     |
| `position_encoding="sinusoidal"` (paper)   | the same, features permuted (below)    |

Positions: the paper's table interleaves sines and cosines (feature 2i the
sine, 2i + 1 the cosine of one frequency); Marian's puts the sines in the
first half and the cosines in the second, with the same frequencies. So
Marian's table is ours with its features permuted: `halves[:, k] =
interleaved[:, P[k]]` with `P = [0, 2, 4, ..., 1, 3, 5, ...]`
(`feature_permutation`). Every operation on the residual stream is
equivariant to a permutation of its features (sums, LayerNorm with gamma and
beta permuted alike, the embedding scale), and every projection that reads
the stream (queries, keys and values, also the cross-attention's keys and
values reading the encoder's output; the first feed-forward layer; the
output projection, which is the embedding matrix) or writes it (each
attention's output projection, the second feed-forward layer) can take the
permuted stream by permuting its input rows or its output columns and
bias. The permuted model computes the same logits, which the export's
validation (and tests/test_export_huggingface.py) checks against
`transformers` itself.

Ids: an imported Marian checkpoint (a `MarianTokenizer`) goes back out with
its own ids and files (`vocab.json`, `source.spm`, `target.spm`): each row
of the embeddings and of the logits bias returns to its Marian id, and the
added start piece's row (equal to `<pad>`'s in an imported model) becomes
`<pad>`'s, from which Marian's decoder starts; our pad id's own row is
dropped (Marian never reads it: padding is masked and `<pad>` is never
generated). A model with our shared SentencePiece `Tokenizer` keeps our ids:
`vocab.json` maps each piece to its id, `source.spm` and `target.spm` are
both `tokenizer.model`, and `config.json` says pad 0, start 2
(`decoder_start_token_id`), end 3, so `MarianTokenizer` gives our ids. A
model without a tokenizer gets the model files alone (ids as ours).

Our search never generates the pad or start id; `generation_config.json`
says so to `generate` (`bad_words_ids`), so greedy `generate` gives our
greedy tokens. Beam search does not match ours: `generate` scores
hypotheses `log P / |Y| ** length_penalty`, ours with GNMT's penalty.

Not expressible, refused in one line naming the option: pre-LN
(`normalize_first=True`), learned positions, a restricted attention window,
per-head key or value sizes other than `hidden_dim / num_heads`, a
LayerNorm epsilon other than 1e-5, and mixed feed-forward activations.

Example:

```
python -m export.huggingface --preset path/to/preset --output exported/hf
```

```python
from transformers import MarianMTModel, MarianTokenizer

model = MarianMTModel.from_pretrained("exported/hf")
tokenizer = MarianTokenizer.from_pretrained("exported/hf")
batch = tokenizer(["A sentence."], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**batch, num_beams=1), skip_special_tokens=True))
```
"""

import json
import logging
import math
import os
import pathlib
import sys
import warnings

import numpy as np

from export import contract
from export.contract import UnsupportedModelError, ValidationError
from export.exporter import (
    MAX_EXTRA_LENGTH, OVERWRITE_ARGUMENT, Exporter, check_sentences, keras_outputs, validation_sources,
)
from export.exporter import float32 as _numpy
# The model card has its own module; its names stay importable from here (plain re-exports).
from export.huggingface_card import _languages, model_card  # noqa: F401

# Named, not __name__, so that `python -m export.huggingface` logs under the same name.
logger = logging.getLogger("export.huggingface")

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MODEL_CARD_FILE = "README.md"
# Ours, beside Hugging Face's files: the export's own record (ids, versions, the validation result).
METADATA_FILE = "keras_transformer.json"
# `TransformerModel.activation` -> Marian's `activation_function` (transformers' ACT2FN names;
# Keras' "gelu" is the exact, erf one, as transformers' "gelu").
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "swish"}
MARIAN_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default; Marian's config has no field for it
VALIDATION_SENTENCES = 8
LOGITS_ATOL = 1e-4


# ---------------------------------------------------------------------- #
# What Marian can express
# ---------------------------------------------------------------------- #
def check_exportable(model):
    """Raises `UnsupportedModelError`, in one line naming the option, if Marian cannot compute what `model` does."""
    def refuse(option, why):
        raise UnsupportedModelError(f"{option} cannot be exported as a Marian checkpoint: {why}")

    if model.normalize_first:
        refuse("normalize_first=True (pre-LN)", "MarianMTModel normalizes after each sub-layer (post-LN)")
    if model.position_encoding not in ("sinusoidal", "sinusoidal_halves"):
        refuse(f"position_encoding={model.position_encoding!r}", "MarianMTModel's positions are fixed sinusoids")
    if model.attention_window is not None:
        refuse(f"attention_window={model.attention_window}", "MarianMTModel's self-attention sees every position")
    head_dim = model.hidden_dim // model.num_heads
    if model.head_key_dim != head_dim or model.head_value_dim != head_dim:
        refuse(
            f"key_dim={model.head_key_dim}, value_dim={model.head_value_dim}",
            f"MarianMTModel's heads have hidden_dim / num_heads = {model.hidden_dim} / {model.num_heads} features "
            "each, for queries, keys and values alike",
        )
    if not math.isclose(float(model.layer_norm_epsilon), MARIAN_LAYER_NORM_EPSILON, rel_tol=1e-9, abs_tol=0.0):
        refuse(f"layer_norm_epsilon={model.layer_norm_epsilon}",
               f"MarianMTModel's LayerNorms use PyTorch's default, {MARIAN_LAYER_NORM_EPSILON}")
    activation_function(model)


def activation_function(model):
    """Marian's `activation_function` for the one feed-forward activation all of `model`'s layers use."""
    return contract.feed_forward_activation(model, ACTIVATIONS, "a Marian checkpoint")


def feature_permutation(model):
    """`[D]` int: Marian's feature k is our feature `P[k]` (the identity for Marian's own layout).

    The paper's table has the sine of frequency i at feature 2i and its
    cosine at 2i + 1; Marian's has them at i and D/2 + i.
    """
    if model.position_encoding == "sinusoidal_halves":
        return np.arange(model.hidden_dim)
    return np.concatenate([np.arange(0, model.hidden_dim, 2), np.arange(1, model.hidden_dim, 2)])


# ---------------------------------------------------------------------- #
# Ids
# ---------------------------------------------------------------------- #
def _is_marian(tokenizer):
    """Whether the tokenizer renumbers a Marian vocabulary (an imported checkpoint's: its ids are not its
    SentencePiece model's; an NLLB tokenizer, the other kind, is refused before, by `check_exportable`)."""
    return tokenizer is not None and not tokenizer.sentencepiece_ids


class IdMap:
    """Our ids and the checkpoint's.

    Attributes:
        to_hf: `[V]` int, the checkpoint's id of each of our ids.
        rows: `[V_hf]` int, the id of ours whose embedding row (and logits
            bias, and logit) each checkpoint id takes.
        pad, end, start: the checkpoint's special ids.
        vocab: dict piece -> checkpoint id (`vocab.json`), or None (no tokenizer).
        pieces: dict of the special pieces (`pad_token`, `unk_token`, `eos_token`), or None.
    """

    def __init__(self, model, source=False):
        tokenizer = model.tokenizer
        # `source`: the encoder's ids, where the model has a table of its own for them (`source_vocabulary_size`).
        size = model.encoder_vocabulary_size if source else model.vocabulary_size
        pieces = None if tokenizer is None else tokenizer.vocabulary_size
        if source and getattr(tokenizer, "source_vocabulary_size", None):
            pieces = tokenizer.source_vocabulary_size
        if tokenizer is not None and pieces != size:
            raise ValueError(
                f"The tokenizer has {pieces} {'source ' if source else ''}pieces, the model "
                f"{'source_' if source else ''}vocabulary_size={size}"
            )
        if _is_marian(tokenizer):
            target_vocab = getattr(tokenizer, "target_vocab", None)
            vocab = tokenizer.vocab if source or target_vocab is None else target_vocab
            self.to_hf = np.asarray(tokenizer.source_marian_ids if source else tokenizer.marian_ids, np.int64)
            self.rows = np.empty(len(vocab), np.int64)
            # Where two of our ids share a Marian id (our pad and the added start piece share <pad>'s),
            # the start id's row wins: Marian's decoder starts from it; it never reads our pad's.
            for ours in sorted(range(size), key=lambda i: i == model.start_id):
                self.rows[self.to_hf[ours]] = ours
            self.vocab = vocab
            self.pieces = {"pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                           "eos_token": tokenizer.end_token}
        else:
            self.to_hf = np.arange(size)
            self.rows = np.arange(size)
            self.vocab = self.pieces = None
            if tokenizer is not None:
                pieces = tokenizer.pieces()
                if len(set(pieces)) != len(pieces):
                    raise ValueError("The tokenizer's pieces are not unique: vocab.json maps pieces to ids")
                self.vocab = {piece: i for i, piece in enumerate(pieces)}
                self.pieces = {"pad_token": pieces[model.pad_id], "unk_token": pieces[model.unk_id],
                               "eos_token": pieces[model.end_id]}
        self.pad, self.end, self.start = (int(self.to_hf[i]) for i in (model.pad_id, model.end_id, model.start_id))

    @property
    def size(self):
        return len(self.rows)

    def suppressed(self):
        """The checkpoint ids our search never generates (pad and start), as `bad_words_ids`."""
        return [[i] for i in sorted({self.pad, self.start})]


# ---------------------------------------------------------------------- #
# Weights
# ---------------------------------------------------------------------- #
def hf_tensors(model, ids=None, source_ids=None):
    """`{name: float32 array}`: `model`'s weights under `MarianMTModel`'s names, in its layout.

    PyTorch's `Linear` stores `[out, in]` (Keras' `Dense` kernels are `[in,
    out]`); the residual-stream features are permuted by
    `feature_permutation` (see the module docstring) and the vocabulary rows
    ordered by `IdMap.rows`.
    """
    check_exportable(model)
    ids = ids or IdMap(model)
    source_ids = source_ids or IdMap(model, source=True)
    order = feature_permutation(model)
    tensors = {}

    def put(name, value):
        tensors[name] = np.ascontiguousarray(value, dtype=np.float32)

    def reading(name, dense):  # reads the (permuted) stream: input rows permuted
        put(f"{name}.weight", _numpy(dense.kernel)[order, :].T)
        put(f"{name}.bias", _numpy(dense.bias))

    def writing(name, dense):  # adds to the stream: output columns and bias permuted
        put(f"{name}.weight", _numpy(dense.kernel)[:, order].T)
        put(f"{name}.bias", _numpy(dense.bias)[order])

    def norm(name, layer_norm):
        put(f"{name}.weight", _numpy(layer_norm.gamma)[order])
        put(f"{name}.bias", _numpy(layer_norm.beta)[order])

    def attention(name, layer):
        reading(f"{name}.q_proj", layer.query_dense)
        reading(f"{name}.k_proj", layer.key_dense)
        reading(f"{name}.v_proj", layer.value_dense)
        writing(f"{name}.out_proj", layer.output_dense)

    def feedforward(name, layer):
        reading(f"{name}.fc1", layer.feedforward_intermediate)
        writing(f"{name}.fc2", layer.feedforward_output)
        norm(f"{name}.final_layer_norm", layer.feedforward_norm)

    # One matrix: both embeddings and the output projection (tied in Marian, stored once).
    if model.source_token_embedding is None:
        # One matrix: both embeddings and the output projection (tied in Marian, stored once).
        put("model.shared.weight", _numpy(model.token_embedding.embeddings)[ids.rows][:, order])
    else:  # the encoder's table, and the decoder's (tied to the output projection, stored once)
        put("model.encoder.embed_tokens.weight",
            _numpy(model.source_token_embedding.embeddings)[source_ids.rows][:, order])
        put("model.decoder.embed_tokens.weight", _numpy(model.token_embedding.embeddings)[ids.rows][:, order])
    bias = _numpy(model.logits_bias_weight) if model.logits_bias else np.zeros(model.vocabulary_size, np.float32)
    put("final_logits_bias", bias[ids.rows][None, :])
    for i, layer in enumerate(model.encoder_layers):
        key = f"model.encoder.layers.{i}"
        attention(f"{key}.self_attn", layer.self_attention)
        norm(f"{key}.self_attn_layer_norm", layer.self_attention_norm)
        feedforward(key, layer)
    for i, layer in enumerate(model.decoder_layers):
        key = f"model.decoder.layers.{i}"
        attention(f"{key}.self_attn", layer.self_attention)
        norm(f"{key}.self_attn_layer_norm", layer.self_attention_norm)
        attention(f"{key}.encoder_attn", layer.cross_attention)
        norm(f"{key}.encoder_attn_layer_norm", layer.cross_attention_norm)
        feedforward(key, layer)
    return tensors


# ---------------------------------------------------------------------- #
# Configs and tokenizer files
# ---------------------------------------------------------------------- #
def hf_config(model, ids, source_ids=None):
    """`config.json` of the `MarianMTModel` computing what `model` does."""
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": (source_ids or IdMap(model, source=True)).size,
        "decoder_vocab_size": ids.size,
        "d_model": model.hidden_dim,
        "encoder_layers": len(model.encoder_layers),
        "decoder_layers": len(model.decoder_layers),
        "encoder_attention_heads": model.num_heads,
        "decoder_attention_heads": model.num_heads,
        "encoder_ffn_dim": model.intermediate_dim,
        "decoder_ffn_dim": model.intermediate_dim,
        "activation_function": activation_function(model),
        "max_position_embeddings": model.max_sequence_length,
        "dropout": float(model.dropout),
        "attention_dropout": float(model.attention_dropout),
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "init_std": 0.02,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": model.source_token_embedding is None,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "use_cache": True,
        "pad_token_id": ids.pad,
        "eos_token_id": ids.end,
        "forced_eos_token_id": ids.end,
        "decoder_start_token_id": ids.start,
        "bos_token_id": None,
        "dtype": "float32",
    }


def generation_config(model, ids):
    """`generation_config.json`: our special ids, and the pad and start ids never generated (as our search)."""
    return {
        "bad_words_ids": ids.suppressed(),
        "decoder_start_token_id": ids.start,
        "eos_token_id": ids.end,
        "forced_eos_token_id": ids.end,
        "pad_token_id": ids.pad,
        "max_length": model.max_sequence_length,
        "num_beams": 4,
    }


def tokenizer_config(ids, languages, separate_vocabs=False):
    """`tokenizer_config.json` for `MarianTokenizer` (one shared vocabulary)."""
    return {
        "tokenizer_class": "MarianTokenizer",
        **ids.pieces,
        "model_max_length": 512,
        "separate_vocabs": separate_vocabs,
        "sp_model_kwargs": {},
        "source_lang": languages[0] if languages else None,
        "target_lang": languages[1] if languages else None,
    }


def _write_tokenizer(directory, tokenizer, ids, source_ids=None):
    from keras_transformer.tokenizers.marian import SOURCE_SPM, TARGET_SPM, TARGET_VOCAB_FILE, VOCAB_FILE

    # Ours has one shared vocabulary: its source_proto and target_proto are the same model.
    (directory / SOURCE_SPM).write_bytes(tokenizer.source_proto)
    (directory / TARGET_SPM).write_bytes(tokenizer.target_proto)
    if getattr(tokenizer, "separate_vocabs", False):  # an imported checkpoint's two vocabularies
        (directory / TARGET_VOCAB_FILE).write_text(json.dumps(ids.vocab, ensure_ascii=False, indent=2) + "\n",
                                                   encoding="utf-8")
        ids = source_ids
    (directory / VOCAB_FILE).write_text(json.dumps(ids.vocab, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _write_json(path, value):
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------- #
# Export
# ---------------------------------------------------------------------- #
def _load(preset):
    """`(model, metadata)`: the model to export and its preset's `metadata.json` ({} when there is none).

    `Exporter.load_model` keeps the preset's dropout here: `config.json` records it for fine-tuning.
    """
    model = EXPORTER.load_model(preset, argument="model")
    metadata = {}
    if not isinstance(preset, (str, os.PathLike)):
        return model, metadata
    path = pathlib.Path(preset) / "metadata.json"
    if path.is_file():
        try:
            metadata = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            logger.warning("%s is not valid JSON; the model card leaves its fields out", path)
        metadata = metadata if isinstance(metadata, dict) else {}
    return model, metadata


def is_huggingface_export(directory):
    """Whether `directory` is a Hugging Face Marian checkpoint (ours or another writer's)."""
    from keras_transformer.convert import hf_model_type

    directory = pathlib.Path(directory)
    return hf_model_type(directory) == "marian" and (directory / WEIGHTS_FILE).is_file()


EXPORTER = Exporter(
    "Hugging Face (MarianMTModel)", "python -m export.huggingface", "a Hugging Face Marian checkpoint",
    is_huggingface_export, dropout=None,
)


def check_output(output, overwrite, preset=None, flag=OVERWRITE_ARGUMENT):
    """`utils.check_output_directory` for this export: only an earlier Marian checkpoint is replaced."""
    return EXPORTER.check_output(output, overwrite, preset, flag=flag)


def export_huggingface(model, directory, overwrite=False, metadata=None, validate=True,
                       validation_sentences=VALIDATION_SENTENCES):
    """Writes `model` as a Hugging Face `MarianMTModel` checkpoint directory and validates it.

    Args:
        model: a `TransformerModel`, or a built-in preset name, a preset
            directory (its `metadata.json` fills the model card), a Marian
            checkpoint directory or an `hf://` handle.
        directory: the directory to create.
        overwrite: bool, replace an existing `directory` (only an earlier
            Marian checkpoint).
        metadata: optional dict as a preset's `metadata.json` (data, scores)
            for the model card; read from the preset directory when None.
        validate: bool; with `transformers` and PyTorch importable, load the
            checkpoint with `MarianMTModel.from_pretrained` and compare
            logits (within 1e-4), greedy `generate` tokens and
            `MarianTokenizer` ids with ours. Without them it is skipped (said
            in the log and in `keras_transformer.json`).
        validation_sentences: int >= 1, sentences of the bundled test split
            (random ids for a model without a tokenizer) for the comparison.

    Returns:
        `pathlib.Path` of the directory.

    Raises:
        FileExistsError: `directory` exists and `overwrite` is False.
        ValueError: `directory` is the preset's own or not an earlier checkpoint.
        UnsupportedModelError: Marian cannot express the model (one line naming the option).
        export.contract.ValidationError: `transformers` computes something else.
    """
    check_sentences(validation_sentences)
    output = check_output(directory, overwrite, model)
    preset = model
    model, read_metadata = _load(preset)
    metadata = read_metadata if metadata is None else metadata
    check_exportable(model)
    ids, source_ids = IdMap(model), IdMap(model, source=True)
    if ids.pad >= source_ids.size:
        raise UnsupportedModelError(
            f"source_vocabulary_size={model.source_vocabulary_size} cannot be exported as a Marian checkpoint: "
            f"MarianMTModel's encoder table needs pad_token_id={ids.pad} (the target's) below its "
            f"{source_ids.size} rows")
    tensors = hf_tensors(model, ids, source_ids)
    # The training data's languages, else those an imported Marian checkpoint named (its tokenizer keeps them).
    languages = _languages(metadata) or list(getattr(model.tokenizer, "languages", None) or [])
    try:
        from safetensors.numpy import save_file
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "The Hugging Face export writes model.safetensors: pip install \"keras-aiayn[hub]\" (safetensors)",
            name="safetensors",
        ) from None

    with EXPORTER.staged(output, overwrite, preset) as staging:
        logger.info("Writing the Marian checkpoint (%d tensors)", len(tensors))
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(staging / CONFIG_FILE, hf_config(model, ids, source_ids))
        _write_json(staging / GENERATION_CONFIG_FILE, generation_config(model, ids))
        if model.tokenizer is not None:
            _write_tokenizer(staging, model.tokenizer, ids, source_ids)
            _write_json(staging / TOKENIZER_CONFIG_FILE, tokenizer_config(
                ids, languages, separate_vocabs=bool(getattr(model.tokenizer, "separate_vocabs", False))))
        else:
            logger.warning("The model has no tokenizer: the checkpoint has no tokenizer files (ids as ours)")
        report = validate_huggingface(staging, model, sentences=validation_sentences) if validate else {
            "skipped": "validate=False"}
        (staging / MODEL_CARD_FILE).write_text(model_card(model, metadata, languages, report), encoding="utf-8")
        contract.write_config(staging, _metadata(model, ids, report), METADATA_FILE)
    return output


def _metadata(model, ids, validation):
    from keras_transformer.presets import jsonable_config

    return {
        "format_version": FORMAT_VERSION,
        "engine": "transformers (MarianMTModel)",
        "vocabulary_size": model.vocabulary_size,
        "hf_vocabulary_size": ids.size,
        "hf_ids": {"pad": ids.pad, "end": ids.end, "start": ids.start},
        "feature_permutation": "identity" if model.position_encoding == "sinusoidal_halves" else
        "Marian feature k = our feature P[k], P = even features then odd ones (interleaved -> halves sinusoids)",
        "versions": contract.versions(optional=("transformers", "torch", "safetensors")),
        "model_config": jsonable_config(model.get_config()),
        "validation": validation,
    }


# ---------------------------------------------------------------------- #
# Validation
# ---------------------------------------------------------------------- #
def _import_reference():
    """`(torch, transformers)`, or None when either is missing."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    return torch, transformers


def validate_huggingface(directory, model, sentences=VALIDATION_SENTENCES, atol=LOGITS_ATOL, seed=0):
    """Loads the checkpoint with `transformers` and compares it with `model`.

    In order: `MarianTokenizer` gives our ids (mapped) on the sentences; the
    teacher-forced logits of `MarianMTModel.from_pretrained` equal ours
    within `atol` at every position and vocabulary entry; greedy `generate`
    (one sentence at a time, our maximum length) gives our greedy tokens.

    Returns:
        dict: `sentences`, `largest_logits_difference`, `logits_atol`,
        `greedy_identical`; or `{"skipped": reason}` without transformers or PyTorch.

    Raises:
        export.contract.ValidationError: naming the first difference.
    """
    from keras import ops

    reference = _import_reference()
    if reference is None:
        reason = "transformers and torch are not both importable (pip install transformers torch)"
        logger.warning("Validation skipped: %s", reason)
        return {"skipped": reason}
    torch, transformers = reference
    directory = pathlib.Path(directory)
    ids, source_ids = IdMap(model), IdMap(model, source=True)
    texts, sources = validation_sources(model, sentences, seed=seed)

    if model.tokenizer is not None:
        with warnings.catch_warnings():  # "Recommended: pip install sacremoses" (Moses is not used to tokenize)
            warnings.simplefilter("ignore", UserWarning)
            hf_tokenizer = transformers.MarianTokenizer.from_pretrained(str(directory))
        expected = [source_ids.to_hf[row].tolist() for row in model.tokenizer.encode(texts)]
        actual = hf_tokenizer(texts)["input_ids"]
        for text, ours, theirs in zip(texts, expected, actual):
            if list(theirs) != ours:
                raise ValidationError(f"MarianTokenizer gives {list(theirs)} for {text!r}; ours (mapped) {ours}")

    hf_model = transformers.MarianMTModel.from_pretrained(str(directory)).eval()
    # Logits: sources with the end id (padded), targets the start id then random ordinary ids.
    rng = np.random.default_rng(seed)
    length = min(12, model.max_sequence_length)
    batch = np.zeros((len(sources), max(len(row) for row in sources) + 1), np.int32)
    for i, row in enumerate(sources):
        batch[i, : len(row) + 1] = list(row) + [model.end_id]
    targets = np.concatenate([
        np.full((len(sources), 1), model.start_id, np.int32),
        rng.integers(4, model.vocabulary_size, size=(len(sources), length - 1)).astype(np.int32),
    ], axis=1)
    ours = np.asarray(ops.convert_to_numpy(model({"encoder_token_ids": batch, "decoder_token_ids": targets})),
                      np.float32)[..., ids.rows]  # [B, T, V_hf]
    with torch.no_grad():
        theirs = hf_model(
            input_ids=torch.tensor(source_ids.to_hf[batch]), attention_mask=torch.tensor(batch != model.pad_id),
            decoder_input_ids=torch.tensor(ids.to_hf[targets]),
        ).logits.numpy()
    largest = float(np.max(np.abs(ours - theirs))) if ours.shape == theirs.shape else math.inf
    if not largest <= atol:
        raise ValidationError(
            f"MarianMTModel's logits {theirs.shape} differ from Keras' {ours.shape} by {largest:.3g} > atol={atol:g}"
        )

    def describe(row):
        return repr(texts[row]) if texts is not None else f"ids {sources[row]}"

    greedy = keras_outputs(model, sources, 1, 0.0)
    for row, (source, output) in enumerate(zip(sources, greedy)):
        encoder = torch.tensor([source_ids.to_hf[list(source) + [model.end_id]].tolist()])
        # Ours: at most n + 50 ids with the end id (n: the source with its end id), below max_sequence_length.
        limit = min(len(source) + 1 + MAX_EXTRA_LENGTH, model.max_sequence_length - 1)
        with torch.no_grad():
            generated = hf_model.generate(input_ids=encoder, num_beams=1, do_sample=False, max_length=limit + 1)
        generated = generated[0, 1:].tolist()
        generated = generated[: generated.index(ids.end)] if ids.end in generated else generated
        expected = ids.to_hf[output].tolist() if output else []
        if generated != expected:
            raise ValidationError(
                f"MarianMTModel's greedy generate differs from Keras' on sentence {row} ({describe(row)}): "
                f"{generated[:12]}... != {expected[:12]}... (lengths {len(generated)} and {len(expected)})"
            )
    logger.info("transformers gives Keras' logits (largest difference %.1e) and greedy tokens on %d sentences",
                largest, len(sources))
    return {"sentences": len(sources), "largest_logits_difference": largest, "logits_atol": atol,
            "greedy_identical": len(sources), "transformers": transformers.__version__}


def main(argv=None):
    parser = EXPORTER.parser(
        "Export a TransformerModel as a Hugging Face MarianMTModel checkpoint (and check it with "
        "transformers when installed)."
    )
    parser.add_argument("--validation-sentences", type=int, default=VALIDATION_SENTENCES,
                        help=f"sentences compared with transformers (default {VALIDATION_SENTENCES})")
    return EXPORTER.main(parser, argv, lambda args: export_huggingface(
        args.preset, args.output, overwrite=args.overwrite, validation_sentences=args.validation_sentences,
    ))


if __name__ == "__main__":
    sys.exit(main())
