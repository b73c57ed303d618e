"""FSMT checkpoints (fairseq's WMT19 models, `"model_type": "fsmt"`) -> `TransformerModel` + `FsmtTokenizer`.

facebook/wmt19-{en-de,de-en,en-ru,ru-en} are fairseq's ports of the WMT19
news-translation systems: the paper's post-LN architecture at big sizes,
with a vocabulary for each side. What they carry that the paper does not is expressed exactly by
`TransformerModel` options, never approximated:

| FSMT (`config.json`)                           | `TransformerModel`                          |
|------------------------------------------------|---------------------------------------------|
| `src_vocab_size`, `tgt_vocab_size` (two tables) | `source_vocabulary_size` (the encoder's)    |
| the decoder's output projection                | tied to the decoder's table (checked equal)  |
| fairseq's sinusoids, positions from pad + 1    | `position_encoding="sinusoidal_fairseq"`    |
| `activation_function` "relu"                   | `activation="relu"` (the paper's)           |
| `scale_embedding` true                         | embeddings times sqrt(d_model) (the paper's) |
| `<s> <pad> </s> <unk>` = 0-3, start = `</s>`   | ids renumbered by `FsmtTokenizer`           |
| Moses + BPE (`merges.txt`), `langs`            | `FsmtTokenizer` (sacremoses)                |
| LayerNorm epsilon 1e-5 (PyTorch's)             | `layer_norm_epsilon=1e-5`                   |

`FSMTForConditionalGeneration` keeps `model.decoder.output_projection.weight`
apart from `model.decoder.embed_tokens.weight` (`tie_word_embeddings` false);
the model ties them, so the import checks that the two are equal and refuses
in one line where they are not (an untied projection would need a second
output matrix, which `TransformerModel` does not have).

Three steps, as `convert/marian.py`: `convert_config`, `convert_tokenizer`
and `convert_weights` (each tensor ported by name, every tensor of the file
used or checked).
"""

import pathlib
import sys

import numpy as np

from keras_transformer.convert import HF_CONFIG_FILE, CheckpointError
from keras_transformer.convert.weights import (
    TOKENIZER_CONFIG, WeightWalk, check_all_used, config_field, load_family, port_layers, read_json,
    read_tokenizer_config, refusal, same_as, stack_arguments,
)
from keras_transformer.tokenizers.fsmt import (
    MERGES_FILE, SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE, FsmtTokenizer, read_merges,
)

# fairseq's dictionary, which FSMT's config.json and both vocabularies follow.
FAIRSEQ_SPECIALS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}


def convert_config(config, path="config.json"):
    """`TransformerModel` arguments for an FSMT `config.json` (a dict).

    Raises:
        CheckpointError: naming the first field the model cannot express.
    """
    refuse = refusal(config, path)
    if not config_field(config, "scale_embedding", True):
        refuse("scale_embedding", "is not supported: TransformerModel multiplies embeddings by sqrt(d_model)")
    for field, expected in FAIRSEQ_SPECIALS.items():
        value = config_field(config, field, expected)
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        if value != expected:
            refuse(field, f"is not supported: fairseq's dictionary has {expected} there (positions are counted from "
                   "padding_idx + 1 = 2, the decoder starts from </s>)")
    languages = config.get("langs")
    if not (isinstance(languages, list) and len(languages) == 2 and all(isinstance(code, str) for code in languages)):
        refuse("langs", "must be two language codes (source, target), e.g. ['en', 'de']")
    for field in ("src_vocab_size", "tgt_vocab_size"):
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 5:
            refuse(field, "must be an integer of at least 5 (fairseq's four special pieces and one more)")
    return {
        **stack_arguments(config, path, default_activation="relu", default_max_length=1024),
        # The decoder's table (tied to the output projection) is `vocabulary_size`, the encoder's its own;
        # `vocabulary_sizes` adds the start row to both.
        "vocabulary_size": config["tgt_vocab_size"],
        "source_vocabulary_size": config["src_vocab_size"],
        "position_encoding": "sinusoidal_fairseq",
        "normalize_first": False,
        "logits_bias": False,
        # The added start id copies </s>'s row (FsmtTokenizer): one </s> in the softmax, as Hugging Face's.
        "exclude_start_logit": True,
    }


def convert_tokenizer(directory, config):
    """The `FsmtTokenizer` of a checkpoint directory (our ids), refusing what it cannot express."""
    directory = pathlib.Path(directory)
    tokenizer_config = read_tokenizer_config(directory)
    tokenizer_class = tokenizer_config.get("tokenizer_class")
    if tokenizer_class not in (None, "FSMTTokenizer"):
        raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: tokenizer_class={tokenizer_class!r} is not supported; "
                              "an fsmt checkpoint is imported with FSMTTokenizer's files (Moses + BPE)")
    names = (SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE, MERGES_FILE)
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory} has no {name}: an FSMT checkpoint's tokenizer is {', '.join(names)}")
    vocabs = []
    for name, field in ((SOURCE_VOCAB_FILE, "src_vocab_size"), (TARGET_VOCAB_FILE, "tgt_vocab_size")):
        vocab = read_json(directory / name)
        if not isinstance(vocab, dict) or len(vocab) != config.get(field):
            size = len(vocab) if isinstance(vocab, dict) else "no"
            raise CheckpointError(f"{directory / HF_CONFIG_FILE}: {field}={config.get(field)!r} but {name} has "
                                  f"{size} pieces")
        by_id = {i: piece for piece, i in vocab.items()}
        for field_id, expected in (("bos_token_id", "<s>"), ("pad_token_id", "<pad>"), ("eos_token_id", "</s>")):
            if by_id.get(FAIRSEQ_SPECIALS[field_id]) != expected:
                raise CheckpointError(f"{directory / name}: id {FAIRSEQ_SPECIALS[field_id]} must be {expected} "
                                      "(fairseq's dictionary)")
        vocabs.append(vocab)

    def token(name, default):
        value = tokenizer_config.get(name, default)
        return value.get("content") if isinstance(value, dict) else value  # an AddedToken as transformers writes it

    try:
        return FsmtTokenizer(*vocabs, read_merges(directory / MERGES_FILE), config.get("langs"),
                             do_lower_case=bool(tokenizer_config.get("do_lower_case", False)),
                             unk_token=token("unk_token", "<unk>"))
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{directory}: {error}") from None


def _check_positions(walk, model):
    """The stored sinusoid tables (from row 0; row 1, padding_idx, zero) must be fairseq's, which the model computes."""
    from keras_transformer.layers.position import FAIRSEQ_FIRST_POSITION, sinusoidal_table

    for side in ("encoder", "decoder"):
        key = f"model.{side}.embed_positions.weight"
        stored = walk.tensors.get(key)
        if stored is None:
            continue
        rows = np.asarray(sinusoidal_table(np.arange(len(stored) - FAIRSEQ_FIRST_POSITION), model.hidden_dim,
                                           layout="fairseq"))
        # Rows 0 and 1 (below fairseq's first position) are never read; float32 vs float64 as in marian.py.
        same_as(walk, key, np.concatenate([stored[:FAIRSEQ_FIRST_POSITION], rows]),
                "fairseq's sinusoids from padding_idx + 1 (position_encoding='sinusoidal_fairseq')", tolerance=1e-4)


def convert_weights(model, tensors, tokenizer, source="model.safetensors"):
    """Ports an FSMT checkpoint's tensors into `model` (built by `convert_config`), every tensor accounted for."""
    walk = WeightWalk(tensors, source)
    source_rows, rows = tokenizer.source_checkpoint_ids, tokenizer.checkpoint_ids
    walk.port_weight(model.source_token_embedding.embeddings, "model.encoder.embed_tokens.weight",
                     lambda table: table[source_rows])
    decoder_key = "model.decoder.embed_tokens.weight"
    walk.port_weight(model.token_embedding.embeddings, decoder_key, lambda table: table[rows])
    same_as(walk, "model.decoder.output_projection.weight", walk.tensors[decoder_key],
            f"{decoder_key} (an untied output projection; TransformerModel ties it to the decoder's embeddings)")
    _check_positions(walk, model)
    port_layers(walk, model)
    check_all_used(walk, tensors, source)


def vocabulary_sizes(tokenizer, arguments):
    """One more row than each vocabulary: the decoder's start token, apart from </s> (see FsmtTokenizer)."""
    return {"vocabulary_size": tokenizer.vocabulary_size, "source_vocabulary_size": tokenizer.source_vocabulary_size}


def load(cls, directory, overrides):
    """A `cls` from an FSMT checkpoint directory, with its `FsmtTokenizer` as `model.tokenizer`."""
    return load_family(cls, directory, overrides, sys.modules[__name__], "FSMT")
