"""A small Marian checkpoint built locally with Hugging Face `transformers`, for tests and smoke runs.

Nothing is downloaded: the two SentencePiece models are trained on the
bundled English-German corpus, a `MarianMTModel` is built at a small size
(random init, or trained for a few hundred steps so that its translations
end with `</s>`), and everything is written with `save_pretrained` in the
Hugging Face layout of an OPUS-MT checkpoint (`config.json`,
`model.safetensors`, `generation_config.json`, `source.spm`, `target.spm`,
`vocab.json`, `tokenizer_config.json`). It stands in for
`Helsinki-NLP/opus-mt-en-de` where there is no network (CI, the notebook's
smoke mode); it needs `transformers` and PyTorch (the `[test]` extra).

Example:

```python
from keras_transformer.convert.standin import build_marian_checkpoint

build_marian_checkpoint("runs/opus-mt-standin", train_steps=300)
model = kt.TransformerModel.from_preset("runs/opus-mt-standin")
```
"""

import io
import json
import logging
import os
import pathlib
import tempfile

import numpy as np

logger = logging.getLogger(__name__)

# The shapes of the stand-in; Marian's own (opus-mt-en-de) are 512 / 2048 / 8 heads / 6 + 6 layers.
DEFAULT_SIZES = dict(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_layers=2, decoder_layers=2)


def _train_spm(lines, vocabulary_size, model_type="unigram"):
    import sentencepiece as spm

    model = io.BytesIO()
    # SentencePiece's defaults (unk 0, <s> 1, </s> 2), as Marian's and NLLB's own models
    # (Marian's are unigram, NLLB's BPE).
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocabulary_size, model_type=model_type,
        character_coverage=1.0, num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
    )
    return model.getvalue()


def _marian_vocab(source_proto, target_proto, language_codes=(), vocabulary_size=None):
    """Marian's layout: `</s>` 0, `<unk>` 1, the pieces of both models (and codes), `<pad>` last.

    A model may be None: `_marian_vocab(source_proto, None)` is a separate source vocabulary.

    With `vocabulary_size`, unused pieces fill the vocabulary up to that many
    entries (`<pad>` included), as large as the Hub's (58,101 in opus-mt-en-de).
    """
    import sentencepiece as spm

    vocab = {"</s>": 0, "<unk>": 1}
    for code in language_codes:
        vocab.setdefault(code, len(vocab))
    for proto in (source_proto, target_proto):
        if proto is None:
            continue
        processor = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(processor.get_piece_size()):
            if not (processor.is_control(i) or processor.is_unknown(i)):
                vocab.setdefault(processor.id_to_piece(i), len(vocab))
    if vocabulary_size is not None:
        if vocabulary_size < len(vocab) + 1:
            raise ValueError(f"vocabulary_size={vocabulary_size} is below the {len(vocab) + 1} entries the pieces need")
        for i in range(vocabulary_size - 1 - len(vocab)):
            vocab[f"<unused{i}>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def build_marian_checkpoint(directory, train_steps=0, source_vocabulary_size=400, target_vocabulary_size=400,
                            activation_function="swish", language_codes=(), seed=0, max_sentences=4000,
                            batch_size=32, max_tokens=40, vocabulary_size=None, random_extras=True,
                            separate_vocabs=False, **sizes):
    """Writes a Marian checkpoint in the Hugging Face layout; returns the directory.

    Args:
        directory: where to write (created; must not hold a checkpoint already).
        train_steps: int, Adam steps on the bundled training split (0: random
            init, with a random `final_logits_bias` and `<pad>` row so that a
            converter that drops or misplaces them is caught).
        source_vocabulary_size, target_vocabulary_size: pieces of source.spm and target.spm.
        activation_function: the config's (Marian: "swish").
        language_codes: e.g. (">>deu<<", ">>nld<<"): a multilingual target side.
        vocabulary_size: optional int: fill vocab.json with unused pieces up
            to this many entries (a Hub-sized vocabulary; the pieces stay those
            of the two SentencePiece models).
        random_extras: with `train_steps=0`, give `final_logits_bias` and the
            `<pad>` row random values (large ones: a converter that drops or
            misplaces them is caught); False keeps transformers' init.
        separate_vocabs: bool, the Tatoeba-Challenge layout (transformers PR
            #15831): `vocab.json` of the source pieces (and codes),
            `target_vocab.json` of the target's, each `</s>` 0, `<unk>` 1,
            `<pad>` last (so the two pads differ), and separate encoder and
            decoder embedding tables (`share_encoder_decoder_embeddings:
            false`, `decoder_vocab_size`).
        seed: torch's and NumPy's seed.
        max_sentences, batch_size, max_tokens: the training data: the first
            `max_sentences` pairs of at most `max_tokens` pieces.
        **sizes: `MarianConfig` fields replacing `DEFAULT_SIZES`.
    """
    import torch
    import transformers

    from keras_transformer.datasets import load_bundled

    directory = pathlib.Path(directory)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    english, german = load_bundled("train")
    english, german = english[:max_sentences], german[:max_sentences]
    source_proto = _train_spm(english, source_vocabulary_size)
    target_proto = _train_spm(german, target_vocabulary_size)
    if separate_vocabs:
        vocab = _marian_vocab(source_proto, None, language_codes, vocabulary_size)
        target_vocab = _marian_vocab(None, target_proto)
    else:
        vocab = target_vocab = _marian_vocab(source_proto, target_proto, language_codes, vocabulary_size)
    pad = target_vocab["<pad>"]  # the config's ids are the decoder's
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "source.spm").write_bytes(source_proto)
        (scratch / "target.spm").write_bytes(target_proto)
        (scratch / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        separate = {}
        if separate_vocabs:
            (scratch / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False), encoding="utf-8")
            separate = dict(target_vocab_file=str(scratch / "target_vocab.json"), separate_vocabs=True)
        tokenizer = transformers.MarianTokenizer(
            str(scratch / "source.spm"), str(scratch / "target.spm"), str(scratch / "vocab.json"),
            source_lang="en", target_lang="de", **separate,
        )
        tokenizer.save_pretrained(str(directory))

    config = transformers.MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(target_vocab), max_position_embeddings=256,
        activation_function=activation_function, scale_embedding=True, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, share_encoder_decoder_embeddings=not separate_vocabs,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, **{**DEFAULT_SIZES, **sizes},
    )
    model = transformers.MarianMTModel(config)
    if train_steps:
        _train(model, tokenizer, english, german, train_steps, batch_size, max_tokens, rng)
    elif random_extras:
        with torch.no_grad():
            model.final_logits_bias.copy_(torch.randn_like(model.final_logits_bias) * 0.5)
            decoder_table = model.model.decoder.embed_tokens.weight if separate_vocabs else model.model.shared.weight
            decoder_table[pad].copy_(torch.randn_like(decoder_table[pad]))
            if separate_vocabs:
                encoder_table = model.model.encoder.embed_tokens.weight
                encoder_table[vocab["<pad>"]].copy_(torch.randn_like(encoder_table[vocab["<pad>"]]))
    model.eval()
    # As the Hub's OPUS-MT generation configs: never generate <pad>.
    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        pad_token_id=pad, max_length=256, num_beams=4,
    )
    model.save_pretrained(str(directory))
    logger.info("Wrote a Marian stand-in checkpoint (%d pieces, %d steps) to %s", len(target_vocab), train_steps,
                directory)
    return directory


def build_nllb_checkpoint(directory, train_steps=0, piece_count=600, extra_rows=2, legacy_behaviour=False, seed=0,
                          max_sentences=4000, batch_size=32, max_tokens=40, random_extras=True, **sizes):
    """Writes an NLLB-200-style `M2M100ForConditionalGeneration` checkpoint in the Hugging Face layout.

    The layout of facebook/nllb-200-*: `sentencepiece.bpe.model` (a BPE
    SentencePiece model, here trained on both languages of the bundled
    corpus), `tokenizer.json` with the 202 language codes after the pieces
    and `<mask>` last, `vocab_size` `extra_rows` beyond the tokens (NLLB-200:
    2), `config.json`, `model.safetensors`, `generation_config.json`. English
    is `eng_Latn` and German `deu_Latn`.

    Args:
        directory: where to write.
        train_steps: int, Adam steps on eng_Latn -> deu_Latn (0: random
            init, with random LayerNorm weights and biases so that a
            misplaced norm is caught).
        piece_count: pieces of the SentencePiece model.
        extra_rows: embedding rows beyond the tokenizer's tokens.
        legacy_behaviour: tokenizer_config's flag (sources `tokens </s> [lang]`).
        random_extras: with `train_steps=0`, randomize the LayerNorms (False
            keeps transformers' init).
        seed, max_sentences, batch_size, max_tokens: as `build_marian_checkpoint`.
        **sizes: `M2M100Config` fields replacing `DEFAULT_SIZES`.
    """
    import torch
    import transformers
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    from keras_transformer.datasets import load_bundled

    directory = pathlib.Path(directory)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    english, german = load_bundled("train")
    english, german = english[:max_sentences], german[:max_sentences]
    proto = _train_spm([line for pair in zip(english, german) for line in pair], piece_count, model_type="bpe")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "sentencepiece.bpe.model").write_bytes(proto)
        tokenizer = transformers.NllbTokenizer.from_pretrained(
            str(scratch), additional_special_tokens=list(FAIRSEQ_LANGUAGE_CODES), legacy_behaviour=legacy_behaviour)
        tokenizer.save_pretrained(str(scratch / "saved"))
        # As the Hub's tokenizer.json: the codes right after the pieces, <mask> last (transformers puts it first).
        path = scratch / "saved" / "tokenizer.json"
        saved = json.loads(path.read_text(encoding="utf-8"))
        first = piece_count + 1
        order = list(FAIRSEQ_LANGUAGE_CODES) + ["<mask>"]
        for token in saved["added_tokens"]:
            if token["id"] >= first:
                token["id"] = first + order.index(token["content"])
        saved["added_tokens"].sort(key=lambda token: token["id"])
        path.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((scratch / "saved" / name).read_bytes())
    (directory / "sentencepiece.bpe.model").write_bytes(proto)  # the Hub's NLLB repositories have it
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), src_lang="eng_Latn", tgt_lang="deu_Latn")
    tokens = first + len(order)
    assert len(tokenizer) == tokens and tokenizer.convert_tokens_to_ids("<mask>") == tokens - 1

    config = transformers.M2M100Config(
        vocab_size=tokens + extra_rows, max_position_embeddings=256, activation_function="relu", scale_embedding=True,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.1, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, tokenizer_class="NllbTokenizer",
        **{**DEFAULT_SIZES, **sizes},
    )
    model = transformers.M2M100ForConditionalGeneration(config)
    if train_steps:
        _train(model, tokenizer, english, german, train_steps, batch_size, max_tokens, rng)
    elif random_extras:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "layer_norm" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.3)
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, max_length=200,
    )
    model.save_pretrained(str(directory))
    logger.info("Wrote an NLLB stand-in checkpoint (%d rows, %d steps) to %s", tokens + extra_rows, train_steps,
                directory)
    return directory

def _learn_bpe(counts, merges):
    """subword-nmt's BPE learning, short: `merges` times, join the most frequent adjacent pair (ties: first seen).

    Args:
        counts: dict Moses token -> frequency.

    Returns:
        list of (first, second, frequency), in rank order.
    """
    from keras_transformer.tokenizers.fsmt import END_OF_WORD

    words = [(list(word[:-1]) + [word[-1] + END_OF_WORD], count) for word, count in counts.items()]
    learned = []
    for _ in range(merges):
        pairs = {}
        for symbols, count in words:
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = max(pairs, key=pairs.get)
        learned.append((*best, pairs[best]))
        for symbols, _ in words:
            i = 0
            while i < len(symbols) - 1:
                if (symbols[i], symbols[i + 1]) == best:
                    symbols[i: i + 2] = [symbols[i] + symbols[i + 1]]
                i += 1
    return learned


def build_fsmt_checkpoint(directory, merges=300, min_count=2, seed=0, max_sentences=2000, **sizes):
    """Writes an FSMT (`"model_type": "fsmt"`) checkpoint in the Hugging Face layout of facebook/wmt19-en-de.

    `merges.txt` holds `merges` BPE merges learned on the Moses tokens of
    both languages of the bundled corpus; `vocab-src.json` (English) and
    `vocab-tgt.json` (German) are fairseq's dictionaries (`<s> <pad> </s>
    <unk>`, then each side's pieces seen at least `min_count` times: the
    rarer ones are `<unk>`), so the two vocabularies differ in size. The
    model is `FSMTForConditionalGeneration` at a small size with random
    weights (LayerNorms randomized too, so that a misplaced norm is caught)
    and its output projection set equal to the decoder's embeddings, as the
    importer requires.

    Args:
        directory: where to write.
        merges, min_count: the BPE merges, the pieces kept in the vocabularies.
        seed, max_sentences: the random init, the corpus lines used.
        **sizes: `FSMTConfig` fields replacing `DEFAULT_SIZES`.
    """
    import sacremoses
    import torch
    import transformers

    from keras_transformer.datasets import load_bundled
    from keras_transformer.tokenizers.fsmt import bpe_pieces

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    english, german = (lines[:max_sentences] for lines in load_bundled("train"))
    tokens = {}
    for language, lines in (("en", english), ("de", german)):
        normalizer, tokenizer = sacremoses.MosesPunctNormalizer(lang=language), sacremoses.MosesTokenizer(lang=language)
        tokens[language] = [tokenizer.tokenize(normalizer.normalize(line), aggressive_dash_splits=True, escape=True)
                            for line in lines]
    counts = {}
    for words in (*tokens["en"], *tokens["de"]):
        for word in words:
            counts[word] = counts.get(word, 0) + 1
    learned = _learn_bpe(counts, merges)
    ranks = {(first, second): rank for rank, (first, second, _) in enumerate(learned)}
    vocabs = {}
    for language in ("en", "de"):
        seen = {}
        for words in tokens[language]:
            for word in words:
                for piece in bpe_pieces(word, ranks):
                    seen[piece] = seen.get(piece, 0) + 1
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for piece, count in sorted(seen.items(), key=lambda item: -item[1]):
            if count >= min_count:
                vocab[piece] = len(vocab)
        vocabs[language] = vocab
    for name, vocab in (("vocab-src.json", vocabs["en"]), ("vocab-tgt.json", vocabs["de"])):
        (directory / name).write_text(json.dumps(vocab, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (directory / "merges.txt").write_text("".join(f"{a} {b} {n}\n" for a, b, n in learned), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "langs": ["en", "de"], "model_max_length": 1024, "do_lower_case": False, "tokenizer_class": "FSMTTokenizer",
    }), encoding="utf-8")
    config = transformers.FSMTConfig(
        langs=["en", "de"], src_vocab_size=len(vocabs["en"]), tgt_vocab_size=len(vocabs["de"]),
        max_position_embeddings=256, activation_function="relu", scale_embedding=True, tie_word_embeddings=False,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.1,
        attention_dropout=0.0, activation_dropout=0.0,
        **{**DEFAULT_SIZES, **sizes},
    )
    model = transformers.FSMTForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
        decoder = model.model.decoder
        decoder.output_projection.weight.copy_(decoder.embed_tokens.weight)
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, max_length=200,
    )
    model.save_pretrained(str(directory))
    logger.info("Wrote an FSMT stand-in checkpoint (%d + %d pieces, %d merges) to %s", len(vocabs["en"]),
                len(vocabs["de"]), len(learned), directory)
    return directory


def _train(model, tokenizer, english, german, steps, batch_size, max_tokens, rng):
    import torch

    sources = tokenizer(english, truncation=False)["input_ids"]
    targets = tokenizer(text_target=german, truncation=False)["input_ids"]
    pairs = [(s, t) for s, t in zip(sources, targets) if len(s) <= max_tokens and len(t) <= max_tokens]
    pad = tokenizer.pad_token_id  # the source's (the config's is the target's, another with separate vocabularies)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = [pairs[i] for i in rng.integers(0, len(pairs), size=batch_size)]
        source = _pad([s for s, _ in batch], pad)
        labels = _pad([t for _, t in batch], -100)
        loss = model(input_ids=source, attention_mask=source.ne(pad), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0:
            logger.info("stand-in training step %d: loss %.3f", step + 1, loss.item())


def _pad(rows, value):
    import torch

    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


if __name__ == "__main__":  # pragma: no cover - a convenience for notebooks and manual runs
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--train-steps", type=int, default=300)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_marian_checkpoint(args.directory, train_steps=args.train_steps))
    os.sys.exit(0)
