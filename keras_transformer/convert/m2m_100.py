"""NLLB-200 and M2M-100-architecture checkpoints (`"model_type": "m2m_100"`) -> `TransformerModel` + `NllbTokenizer`.

NLLB-200 (facebook/nllb-200-*) is fairseq's pre-LN Transformer at the
paper's sizes or larger, trained on 200 languages with one 256k-piece
SentencePiece vocabulary. What it carries that the paper does not is
expressed exactly by `TransformerModel` options, never approximated:

| M2M-100 (`config.json`)                        | `TransformerModel`                          |
|------------------------------------------------|---------------------------------------------|
| pre-LN layers, a LayerNorm after each stack    | `normalize_first=True` (paper: post-LN)     |
| fairseq's sinusoids, positions from pad + 1    | `position_encoding="sinusoidal_fairseq"`    |
| `activation_function` "relu"                   | `activation="relu"` (the paper's)           |
| `scale_embedding` true                         | embeddings times sqrt(d_model) (the paper's) |
| `<s> <pad> </s> <unk>` = 0-3, start = `</s>`   | ids renumbered by `NllbTokenizer`           |
| the target language forced first               | a target prefix (`Translator`)              |
| LayerNorm epsilon 1e-5 (PyTorch's)             | `layer_norm_epsilon=1e-5`                   |

The tokenizer is NLLB's (`sentencepiece.bpe.model`, language codes such as
`eng_Latn`); the M2M-100 checkpoints' own tokenizer (`M2M100Tokenizer`:
vocab.json and `__en__` codes) is refused in one line.

Three steps, as `convert/marian.py`: `convert_config`, `convert_tokenizer`
and `convert_weights` (each tensor ported by name, every tensor of the file
used or checked).
"""

import pathlib
import sys

from keras_transformer.convert import CheckpointError
from keras_transformer.convert.weights import (
    TOKENIZER_CONFIG, WeightWalk, check_all_used, config_field, load_family, port_layers, read_json,
    read_tokenizer_config, refusal, same_as, stack_arguments,
)
from keras_transformer.tokenizers.nllb import FAIRSEQ_OFFSET, FAIRSEQ_SPECIALS, SPM_FILE, NllbTokenizer
TOKENIZER_JSON = "tokenizer.json"
NLLB_TOKENIZERS = ("NllbTokenizer", "NllbTokenizerFast")


def convert_config(config, path="config.json"):
    """`TransformerModel` arguments for an M2M-100 `config.json` (a dict).

    Raises:
        CheckpointError: naming the first field the model cannot express.
    """
    refuse = refusal(config, path)
    if not config_field(config, "scale_embedding", False):
        refuse("scale_embedding", "is not supported: TransformerModel multiplies embeddings by sqrt(d_model)")
    if not config_field(config, "tie_word_embeddings", True):
        refuse("tie_word_embeddings", "is not supported: the output projection must share the embedding matrix")
    if config.get("pad_token_id") != FAIRSEQ_SPECIALS["<pad>"]:
        refuse("pad_token_id", "is not supported: fairseq's positions are counted from padding_idx + 1 with "
               "padding_idx 1 (position_encoding='sinusoidal_fairseq')")
    for field, expected in (("eos_token_id", FAIRSEQ_SPECIALS["</s>"]), ("bos_token_id", FAIRSEQ_SPECIALS["<s>"])):
        if config_field(config, field, expected) != expected:
            refuse(field, f"is not supported: fairseq's dictionary has {expected} there")
    return {
        **stack_arguments(config, path, default_activation="relu", default_max_length=1024),
        "vocabulary_size": config.get("vocab_size"),
        "position_encoding": "sinusoidal_fairseq",
        "normalize_first": True,
        "logits_bias": False,
        # The added start id copies </s>'s row (NllbTokenizer): one </s> in the softmax, as Hugging Face's.
        "exclude_start_logit": True,
    }


def _content(token):
    return token.get("content") if isinstance(token, dict) else token


def _added_tokens(directory, tokenizer_config, piece_count):
    """The tokens after the pieces (language codes, `<mask>`) with their checkpoint ids, and the language codes.

    From tokenizer.json's `added_tokens` (the Hub's NLLB checkpoints), else
    tokenizer_config.json's `added_tokens_decoder`; the language codes are
    the added special tokens other than `<mask>`.
    """
    first = piece_count + FAIRSEQ_OFFSET
    listed = {}
    if (directory / TOKENIZER_JSON).is_file():
        added = read_json(directory / TOKENIZER_JSON).get("added_tokens") or []
        listed = {_content(token): token.get("id") for token in added if isinstance(token, dict)}
    elif isinstance(tokenizer_config.get("added_tokens_decoder"), dict):
        listed = {_content(token): int(i) for i, token in tokenizer_config["added_tokens_decoder"].items()}
    added = {token: i for token, i in listed.items() if isinstance(i, int) and i >= first}
    if not added:
        raise CheckpointError(f"{directory}: no language codes found after the {piece_count} pieces of {SPM_FILE} "
                              f"(expected in {TOKENIZER_JSON}'s added_tokens, e.g. eng_Latn at id {first})")
    mask = _content(tokenizer_config.get("mask_token")) or "<mask>"
    codes = [token for token in sorted(added, key=added.get) if token != mask]
    return added, codes


def convert_tokenizer(directory, config):
    """The `NllbTokenizer` of a checkpoint directory (our ids), refusing what it cannot express."""
    directory = pathlib.Path(directory)
    tokenizer_config = read_tokenizer_config(directory)
    tokenizer_class = tokenizer_config.get("tokenizer_class")
    if tokenizer_class is not None and tokenizer_class not in NLLB_TOKENIZERS:
        raise CheckpointError(
            f"{directory / TOKENIZER_CONFIG}: tokenizer_class={tokenizer_class!r} is not supported; an m2m_100 "
            f"checkpoint is imported with NLLB's tokenizer ({', '.join(NLLB_TOKENIZERS)}: {SPM_FILE} and language "
            "codes such as eng_Latn)"
        )
    if not (directory / SPM_FILE).is_file():
        raise CheckpointError(
            f"{directory} has no {SPM_FILE}: an NLLB checkpoint's tokenizer is {SPM_FILE} with {TOKENIZER_JSON} "
            "(transformers 5's save_pretrained writes only tokenizer.json; copy sentencepiece.bpe.model from "
            "the original repository)"
        )
    proto = (directory / SPM_FILE).read_bytes()
    import sentencepiece as spm

    try:
        piece_count = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    except RuntimeError:
        raise CheckpointError(f"{directory / SPM_FILE} is not a SentencePiece model") from None
    added, codes = _added_tokens(directory, tokenizer_config, piece_count)
    start = config.get("decoder_start_token_id", FAIRSEQ_SPECIALS["</s>"])
    try:
        return NllbTokenizer(proto, added, codes, config.get("vocab_size"),
                             legacy_behaviour=bool(tokenizer_config.get("legacy_behaviour", False)), start_id=start)
    except ValueError as error:
        raise CheckpointError(f"{directory}: {error}") from None


def convert_weights(model, tensors, tokenizer, source="model.safetensors"):
    """Ports an M2M-100 checkpoint's tensors into `model` (built by `convert_config`), every tensor accounted for."""
    walk = WeightWalk(tensors, source)
    embeddings_key = next((key for key in ("model.shared.weight", "model.encoder.embed_tokens.weight") if key in tensors),
                          "model.shared.weight")
    shared = walk.take(embeddings_key)
    rows = tokenizer.checkpoint_ids  # our id -> checkpoint row (the added start id takes </s>'s)
    walk.port_weight(model.token_embedding.embeddings, embeddings_key, lambda table: table[rows])
    for key in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
        same_as(walk, key, shared, embeddings_key + " (they are tied in M2M-100)")
    port_layers(walk, model)
    walk.port_norm(model.encoder_final_norm, "model.encoder.layer_norm")
    walk.port_norm(model.decoder_final_norm, "model.decoder.layer_norm")
    check_all_used(walk, tensors, source)


def vocabulary_sizes(tokenizer, arguments):
    """One more row than the checkpoint's: the decoder's start token, apart from </s> (see NllbTokenizer)."""
    return {"vocabulary_size": tokenizer.vocabulary_size}


def load(cls, directory, overrides):
    """A `cls` from an NLLB / M2M-100 checkpoint directory, with its `NllbTokenizer` as `model.tokenizer`."""
    return load_family(cls, directory, overrides, sys.modules[__name__], "M2M-100 (NLLB)")
