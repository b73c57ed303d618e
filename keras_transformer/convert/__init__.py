"""Checkpoints of other frameworks, imported into `TransformerModel` and its tokenizer.

The shape of keras-hub's Hugging Face converters
(`keras_hub/src/utils/transformers/`): per source architecture one module
with a config conversion, a weight walk that ports each weight by name, and
a tokenizer conversion; `load_checkpoint` dispatches on the checkpoint's
`model_type`. The model's definition stays in `keras_transformer.model`: a
converter only maps names and arrays. Loading reads JSON, safetensors and
SentencePiece files only (never a pickle such as `pytorch_model.bin`).

A checkpoint is a local directory in the Hugging Face layout (`config.json`
with a `model_type`, `model.safetensors`, the tokenizer files) or a handle
`hf://org/name` (optionally `hf://org/name@revision`), which `huggingface_hub`
downloads once into its cache; with `HF_HUB_OFFLINE=1` a populated cache is
used without any network.

Supported: `"marian"` (the OPUS-MT models, `convert/marian.py`), `"m2m_100"`
(NLLB-200 with its `NllbTokenizer`, `convert/m2m_100.py`) and `"fsmt"`
(fairseq's WMT19 models with their Moses + BPE `FsmtTokenizer`, `convert/fsmt.py`).

Example:

```python
model = kt.TransformerModel.from_preset("hf://Helsinki-NLP/opus-mt-en-de")
model = kt.TransformerModel.from_preset("path/to/opus-mt-en-de")      # save_pretrained's layout
```
"""

import importlib
import json
import os
import pathlib

HF_PREFIX = "hf://"
HF_CONFIG_FILE = "config.json"
# model_type -> the module converting it (each has `load(cls, directory, overrides)`).
CONVERTERS = {"marian": "keras_transformer.convert.marian", "m2m_100": "keras_transformer.convert.m2m_100",
              "fsmt": "keras_transformer.convert.fsmt"}
# What a download fetches: configs, safetensors and tokenizer files; never a pickle.
DOWNLOAD_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "source.spm",
    "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json", "special_tokens_map.json",
    "sentencepiece.bpe.model", "tokenizer.json", "vocab-src.json", "vocab-tgt.json", "merges.txt",
]
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack", "rust_model.ot")


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported (the message names the field or file and the way out)."""


def is_hf_handle(preset):
    return isinstance(preset, str) and preset.startswith(HF_PREFIX)


def hf_model_type(directory):
    """The `model_type` of a Hugging Face checkpoint directory, or None for anything else (e.g. our presets)."""
    path = pathlib.Path(directory) / HF_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # our preset reader names the problem
    if not isinstance(config, dict) or "class_name" in config:
        return None
    return config.get("model_type")


def read_hf_config(directory):
    path = pathlib.Path(directory) / HF_CONFIG_FILE
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {HF_CONFIG_FILE}; expected a Hugging Face checkpoint directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid UTF-8 JSON: {error}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return config


def resolve_handle(handle):
    """The local directory of `hf://org/name[@revision]`, downloaded into the Hugging Face cache if needed.

    Raises:
        ModuleNotFoundError: `huggingface_hub` is not installed (one line: the extra to install).
        CheckpointError: the repository does not exist, it is not in the
            cache and the Hub cannot be reached (offline), or its revision has
            no model.safetensors (named with the way to convert it).
    """
    name = handle[len(HF_PREFIX):]
    repo_id, _, revision = name.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise CheckpointError(f"{handle!r} is not a Hugging Face handle; write hf://org/name (e.g. hf://Helsinki-NLP/opus-mt-en-de)")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"Loading {handle} needs huggingface_hub and safetensors: pip install \"keras-aiayn[hub]\"",
            name="huggingface_hub",
        ) from None
    try:
        directory = pathlib.Path(
            huggingface_hub.snapshot_download(repo_id, revision=revision or None, allow_patterns=DOWNLOAD_PATTERNS)
        )
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{handle}: no such repository on the Hugging Face Hub (or it is private)") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{handle}: the repository has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise CheckpointError(
            f"{handle} is not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) and the Hub "
            "cannot be reached (offline, or HF_HUB_OFFLINE=1): download it once with network access, or pass a "
            "local directory written by save_pretrained"
        ) from None
    if not any((directory / name).is_file() for name in SAFETENSORS_FILES):
        # Only the patterns above were fetched: the snapshot has no pickle to convert in place.
        local = repo_id.split("/")[1]
        raise CheckpointError(
            f"{handle} has no model.safetensors at revision {revision or 'main'} (this package never reads a "
            "pickle such as pytorch_model.bin). Convert it once, where you trust the file: python -c \"from "
            f"transformers import AutoModelForSeq2SeqLM as M, AutoTokenizer as T; M.from_pretrained('{repo_id}')"
            f".save_pretrained('{local}'); T.from_pretrained('{repo_id}').save_pretrained('{local}')\" and pass "
            f"the directory {local}, or name a revision that has model.safetensors (hf://{repo_id}@revision; the "
            "Hub's safetensors conversion is often an open pull request, hf://org/name@refs/pr/N, listed in the "
            "repository's Community tab)"
        )
    return directory


def checkpoint_directory(preset):
    """The directory of a Hugging Face checkpoint named by `preset`, or None if `preset` is not one.

    `preset` is an `hf://` handle or a directory whose config.json has a `model_type`.
    """
    if is_hf_handle(preset):
        return resolve_handle(preset)
    if isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset) and hf_model_type(preset) is not None:
        return pathlib.Path(preset)
    return None


def load_checkpoint(cls, directory, overrides):
    """A `cls` (TransformerModel) with the checkpoint's weights and, as `model.tokenizer`, its tokenizer.

    Raises:
        CheckpointError: an unsupported `model_type` (named), or whatever the
            converter refuses (named).
    """
    model_type = hf_model_type(directory)
    if model_type not in CONVERTERS:
        raise CheckpointError(
            f"{pathlib.Path(directory) / HF_CONFIG_FILE}: model_type={model_type!r} is not supported; "
            f"supported: {', '.join(sorted(CONVERTERS))} (the OPUS-MT models; NLLB-200; fairseq's WMT19 models)"
        )
    return importlib.import_module(CONVERTERS[model_type]).load(cls, pathlib.Path(directory), overrides)
