"""Marian (OPUS-MT) checkpoints in the Hugging Face layout -> `TransformerModel` + `MarianTokenizer`.

OPUS-MT models are the paper's architecture trained by the Helsinki-NLP
group with Marian: post-LN encoder-decoder, sinusoidal positions, embeddings
scaled by sqrt(d_model) and shared by both embeddings and the output
projection. What they carry that the paper does not is expressed exactly by
`TransformerModel` options, never approximated:

| Marian (`config.json`)              | `TransformerModel`                         |
|-------------------------------------|--------------------------------------------|
| `activation_function` "swish"       | `activation="silu"` (paper: relu)          |
| sin \\| cos halves, from position 0   | `position_encoding="sinusoidal_halves"`    |
| `final_logits_bias`                 | `logits_bias=True`                         |
| pad = last id, `</s>` = 0, start = pad | ids renumbered by `MarianTokenizer`     |
| LayerNorm epsilon 1e-5 (PyTorch's)  | `layer_norm_epsilon=1e-5`                  |
| `share_encoder_decoder_embeddings` false, `decoder_vocab_size` | `source_vocabulary_size` (the encoder's table; the decoder's is tied to the output) |
| `separate_vocabs` (`target_vocab.json`) | `MarianTokenizer(target_vocab=...)`    |

Three steps, as keras-hub's converters: `convert_config` (config.json ->
constructor arguments, refusing in one line what the model cannot express),
`convert_tokenizer` (the SentencePiece models and vocab.json), and
`convert_weights` (each weight ported by name, transposed where PyTorch's
`Linear` stores [out, in], rows renumbered to our ids; every tensor of the
file is used or checked).
"""

import pathlib
import sys

import numpy as np

from keras_transformer.convert import HF_CONFIG_FILE, CheckpointError
from keras_transformer.convert.weights import (
    TOKENIZER_CONFIG, WeightWalk, check_all_used, config_field, load_family, port_layers, read_json,
    read_tokenizer_config, refusal, same_as, stack_arguments,
)
from keras_transformer.tokenizers.marian import SOURCE_SPM, TARGET_SPM, TARGET_VOCAB_FILE, VOCAB_FILE, MarianTokenizer


def convert_config(config, path="config.json"):
    """`TransformerModel` arguments for a Marian `config.json` (a dict).

    Raises:
        CheckpointError: naming the first field the model cannot express.
    """
    refuse = refusal(config, path)
    shared = config_field(config, "share_encoder_decoder_embeddings", True)
    vocabulary_size = config.get("vocab_size")
    decoder_vocabulary_size = config_field(config, "decoder_vocab_size", vocabulary_size)
    if shared and decoder_vocabulary_size != vocabulary_size:
        refuse("decoder_vocab_size", f"differs from vocab_size={vocabulary_size} with one shared embedding matrix "
               "(share_encoder_decoder_embeddings=true)")
    for field, value in (("vocab_size", vocabulary_size), ("decoder_vocab_size", decoder_vocabulary_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            refuse(field, "must be a positive integer")
    if not config_field(config, "tie_word_embeddings", True):
        refuse("tie_word_embeddings",
               "is not supported: the output projection must share the (decoder's) embedding matrix")
    if not config_field(config, "scale_embedding", False):
        refuse("scale_embedding", "is not supported: TransformerModel multiplies embeddings by sqrt(d_model)")
    for field in ("normalize_before", "add_final_layer_norm", "normalize_embedding"):
        if config.get(field):
            refuse(field, "is not supported (post-LN without an embedding LayerNorm, as Marian checkpoints)")
    return {
        **stack_arguments(config, path, default_activation="gelu", default_max_length=512),
        # Separate tables: the decoder's (tied to the output projection) is `vocabulary_size`, the encoder's its own.
        "vocabulary_size": decoder_vocabulary_size,
        **({} if shared else {"source_vocabulary_size": vocabulary_size}),
        "position_encoding": "sinusoidal_halves",
        "logits_bias": True,
    }


def convert_tokenizer(directory, config):
    """The `MarianTokenizer` of a checkpoint directory (our ids), refusing what it cannot express."""
    directory = pathlib.Path(directory)
    tokenizer_config = read_tokenizer_config(directory)
    separate = bool(tokenizer_config.get("separate_vocabs"))
    if separate and config_field(config, "share_encoder_decoder_embeddings", True):
        raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: separate_vocabs=true (separate source and target "
                              "vocabularies) needs share_encoder_decoder_embeddings=false in config.json: one shared "
                              "embedding matrix cannot number two vocabularies")
    names = (SOURCE_SPM, TARGET_SPM, VOCAB_FILE) + ((TARGET_VOCAB_FILE,) if separate else ())
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory} has no {name}: a Marian checkpoint's tokenizer is "
                                  f"{', '.join(names[:-1])} and {names[-1]}")

    def read_vocab(name, field, default=None):
        vocab = read_json(directory / name)
        if not isinstance(vocab, dict):
            raise CheckpointError(f"{directory / name} must be a JSON object of piece -> id")
        size = config_field(config, field, default)
        if len(vocab) != size:
            raise CheckpointError(f"{directory / HF_CONFIG_FILE}: {field}={size!r} but {name} has {len(vocab)} pieces")
        return vocab

    vocab = read_vocab(VOCAB_FILE, "vocab_size")
    target_vocab = read_vocab(TARGET_VOCAB_FILE, "decoder_vocab_size") if separate else None
    # The config's special ids are the decoder's: the target vocabulary's when it has its own.
    decoder_vocab_name = TARGET_VOCAB_FILE if separate else VOCAB_FILE
    by_id = {i: piece for piece, i in (target_vocab if separate else vocab).items()}

    def special(field):
        value = config.get(field)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, int) or value not in by_id:
            raise CheckpointError(
                f"{directory / HF_CONFIG_FILE}: {field}={value!r} must be one id of {decoder_vocab_name}")
        return by_id[value]

    pad_token, end_token = special("pad_token_id"), special("eos_token_id")
    start_token = special("decoder_start_token_id") if config.get("decoder_start_token_id") is not None else pad_token
    unk_token = tokenizer_config.get("unk_token", "<unk>")
    if isinstance(unk_token, dict):  # an AddedToken as serialized by transformers
        unk_token = unk_token.get("content")
    source_proto, target_proto = ((directory / name).read_bytes() for name in (SOURCE_SPM, TARGET_SPM))
    # Kept for an export's model card; a checkpoint without both codes (or with odd values) has none.
    languages = [tokenizer_config.get(key) for key in ("source_lang", "target_lang")]
    languages = languages if all(isinstance(code, str) and code.strip() for code in languages) else None
    try:
        return MarianTokenizer(source_proto, target_proto, vocab, pad_token=pad_token, unk_token=unk_token,
                               end_token=end_token, start_token=start_token, target_vocab=target_vocab,
                               languages=languages)
    except ValueError as error:
        raise CheckpointError(f"{directory}: {error}") from None


def convert_weights(model, tensors, tokenizer, source="model.safetensors"):
    """Ports a Marian checkpoint's tensors into `model` (built by `convert_config`), every tensor accounted for."""
    walk = WeightWalk(tensors, source)
    rows = tokenizer.marian_ids  # our id -> Marian row (the added start id takes <pad>'s)
    if model.source_token_embedding is None:
        embeddings_key = next(
            (key for key in ("model.shared.weight", "model.encoder.embed_tokens.weight") if key in tensors),
            "model.shared.weight")
        tied = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
    else:  # separate tables: the encoder's, and the decoder's tied to the output projection
        source_rows = tokenizer.source_marian_ids
        walk.port_weight(model.source_token_embedding.embeddings, "model.encoder.embed_tokens.weight",
                         lambda table: table[source_rows])
        embeddings_key = next(
            (key for key in ("model.decoder.embed_tokens.weight", "lm_head.weight") if key in tensors),
            "model.decoder.embed_tokens.weight")
        tied = ("model.decoder.embed_tokens.weight", "lm_head.weight")
    shared = walk.take(embeddings_key)
    walk.port_weight(model.token_embedding.embeddings, embeddings_key, lambda table: table[rows])
    for key in tied:
        same_as(walk, key, shared, embeddings_key + " (they are tied in Marian)")
    walk.port_weight(model.logits_bias_weight, "final_logits_bias", lambda bias: bias.reshape(-1)[rows])
    from keras_transformer.layers.position import sinusoidal_table

    table = np.asarray(sinusoidal_table(np.arange(model.max_sequence_length), model.hidden_dim, layout="halves"))
    for side in ("encoder", "decoder"):
        stored = tensors.get(f"model.{side}.embed_positions.weight")
        if stored is not None:
            length = min(len(stored), len(table))
            # Hugging Face computes the table in float64, we in float32: at position 500 the angles
            # differ by float32's resolution (~3e-5); another layout would differ by ~1.
            same_as(walk, f"model.{side}.embed_positions.weight", np.concatenate([table[:length], stored[length:]]),
                     "the sin|cos-halves sinusoids from position 0", tolerance=1e-4)
    port_layers(walk, model)
    check_all_used(walk, tensors, source)


def vocabulary_sizes(tokenizer, arguments):
    """One more row than Marian's vocabulary when the decoder starts from <pad> (see MarianTokenizer)."""
    sizes = {"vocabulary_size": tokenizer.vocabulary_size}
    if "source_vocabulary_size" in arguments:  # separate tables (and one vocabulary, or two)
        sizes["source_vocabulary_size"] = tokenizer.source_vocabulary_size or tokenizer.vocabulary_size
    return sizes


def load(cls, directory, overrides):
    """A `cls` from a Marian checkpoint directory, with its `MarianTokenizer` as `model.tokenizer`."""
    return load_family(cls, directory, overrides, sys.modules[__name__], "Marian")
