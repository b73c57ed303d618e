"""The model card (`README.md`) of a Hugging Face export: what the model is, its data and scores.

Read from a preset's `metadata.json` (`export/huggingface.py` passes it);
the license is left to fill in before publishing.
"""

import pathlib


def _languages(metadata):
    """`[source, target]` language codes from a preset's `metadata.json` data files, or [] when unknown."""
    data = metadata.get("data") or {}
    corpus = (data.get("bundled_corpus") or {}).get("name", "")
    parts = corpus.rsplit("_", 2)
    if len(parts) == 3 and all(len(code) == 2 for code in parts[1:]):
        return parts[1:]
    files = data.get("train") or []
    codes = []
    for name in files:
        if not isinstance(name, str):
            return []
        stem = name[:-3] if name.endswith(".gz") else name
        suffix = pathlib.PurePosixPath(stem).suffix.lstrip(".")
        codes.append(suffix)
    if len(codes) == 2 and all(2 <= len(code) <= 3 and code.isalpha() for code in codes):
        return codes
    return []


def model_card(model, metadata, languages, validation=None):
    """`README.md`: what the model is, its data and scores as `metadata.json` records them; license left to fill in."""
    data = metadata.get("data") or {}
    front = ["---", "library_name: transformers", "pipeline_tag: translation", "tags:", "- translation",
             "- marian", "- keras-aiayn"]
    if languages:
        front += ["language:"] + [f"- {code}" for code in languages]
    else:
        front += ["# language: [xx, yy]  (fill in: the source and target languages)"]
    front += ["# license: (fill in, e.g. apache-2.0, and the training data's terms)", "---", ""]
    pair = f" ({languages[0]} → {languages[1]})" if languages else ""
    lines = [
        f"# Transformer translation model{pair}",
        "",
        "A Transformer encoder-decoder (Vaswani et al., 2017, \"Attention Is All You Need\") exported from "
        "[keras-aiayn](https://pypi.org/project/keras-aiayn/) with `python -m export.huggingface`, as a "
        "`MarianMTModel` checkpoint.",
        "",
        "## Architecture",
        "",
        f"- {len(model.encoder_layers)} encoder and {len(model.decoder_layers)} decoder layers, d_model "
        f"{model.hidden_dim}, d_ff {model.intermediate_dim}, {model.num_heads} heads, post-LN, "
        f"activation {model.activation}, sinusoidal positions (at most {model.max_sequence_length} tokens)",
        f"- vocabulary: {model.vocabulary_size} pieces"
        + (" (SentencePiece, shared by both languages)" if model.tokenizer is not None else " (no tokenizer)"),
        "",
        "## Training",
        "",
    ]
    if metadata:
        for split in ("train", "valid", "test"):
            if data.get(split):
                lines.append(f"- {split} data: " + ", ".join(str(name) for name in data[split] if name))
        corpus = data.get("bundled_corpus")
        if corpus:
            lines.append(f"- corpus: {corpus.get('name')} (version {corpus.get('version')})")
        for key, label in (("preset", "architecture preset"), ("init_from", "fine-tuned from"),
                           ("steps", "training steps"), ("train_pairs", "training sentence pairs")):
            value = metadata.get(key, data.get(key))
            if value is not None:
                lines.append(f"- {label}: {value}")
    else:
        lines.append("Not recorded (the model was exported without a preset's metadata.json).")
    lines += ["", "## Evaluation", ""]
    scores = [(key, label) for key, label in (("test_bleu", "test BLEU"), ("valid_bleu", "validation BLEU"),
                                              ("valid_chrf", "validation chrF")) if metadata.get(key) is not None]
    if scores:
        for key, label in scores:
            sentences = metadata.get("valid_bleu_sentences") if key.startswith("valid") else None
            lines.append(f"- {label}: {metadata[key]}" + (f" ({sentences} sentences)" if sentences else ""))
        if metadata.get("valid_bleu_signature"):
            lines.append(f"- sacreBLEU signature: `{metadata['valid_bleu_signature']}`")
    else:
        lines.append("No score recorded.")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import MarianMTModel, MarianTokenizer",
        "",
        "model = MarianMTModel.from_pretrained(\"PATH_OR_REPO\")",
        "tokenizer = MarianTokenizer.from_pretrained(\"PATH_OR_REPO\")",
        "batch = tokenizer([\"A sentence.\"], return_tensors=\"pt\")",
        "print(tokenizer.batch_decode(model.generate(**batch, num_beams=1), skip_special_tokens=True))",
        "```",
        "",
        "Greedy `generate` gives keras-aiayn's greedy tokens (checked at export); beam search scores "
        "hypotheses with transformers' length penalty, not the GNMT penalty keras-aiayn uses.",
    ]
    if validation and not validation.get("skipped"):
        lines += ["", f"Checked at export: logits within {validation['logits_atol']:g} of keras-aiayn's "
                      f"(largest difference {validation['largest_logits_difference']:.1e}), the same greedy "
                      f"tokens on {validation['sentences']} sentences."]
    lines += ["", "## License", "", "Not set: fill in the license and the training data's terms before publishing.", ""]
    return "\n".join(front + lines)
