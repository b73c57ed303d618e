"""Built-in presets (data, not code), and preset directories: their files, how they are written and read.

`PRESETS` are architectures (random weights). Each entry: `config`
(TransformerModel arguments), `description`, the paper's reference, and
`average_last`: how many of the last checkpoints `run_training` averages by
default (section 6.1: 5 for base, 20 for big).

`PRETRAINED_PRESETS` are trained checkpoints of the same architecture: each
entry's `handle` is a Hugging Face repository (`hf://org/name`), converted on
load by `keras_transformer.convert` (downloaded once, then read from the
Hugging Face cache).
Paper: Vaswani et al., "Attention Is All You Need",
NeurIPS 2017, arXiv:1706.03762; Table 3 lists base and big.

A preset directory (`TransformerModel.save_to_preset`, `write_preset`) holds
config.json (the constructor arguments and the format version), the weights,
the tokenizer's files and metadata.json; `load_preset_directory` reads one
back, checking each file and upgrading older formats
(`upgrade_preset_config`). The module imports no framework at load time (the
ONNX Runtime server reads `is_preset_directory`); Keras and h5py are imported
by the functions that need them.
"""

import json
import os
import pathlib

from keras_transformer.quantization import check_quantization
from keras_transformer.utils import is_integer, open_hdf5

PAPER = "Vaswani et al. 2017, arXiv:1706.03762"

# A preset directory (`TransformerModel.save_to_preset`): the model's config, its weights, what made it.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"
TOKENIZER_FILE = "tokenizer.model"
# Format 2: `value_dim=None` means hidden_dim // num_heads and `attention_window`
# is the window's width r (see `upgrade_preset_config` for format 1).
PRESET_FORMAT_VERSION = 2
# Format 3: format 2 with `"quantization": "int8"` (Keras' int8 weights). Only a
# quantized model writes it, so that an older reader refuses it by its format
# rather than failing on its int8 arrays; float32 presets stay format 2.
QUANTIZED_PRESET_FORMAT_VERSION = 3
READABLE_PRESET_FORMATS = (1, 2, 3)


def is_preset_directory(directory):
    """Whether `directory` holds a preset: its config.json and weights (any format version).

    Framework-free: the ONNX Runtime server names a preset given where an
    export is expected.
    """
    directory = pathlib.Path(directory)
    return (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def jsonable_config(config):
    """A Keras `get_config()` as plain JSON holds it; a dtype policy as its name, as a preset stores it.

    Framework-free: written into a preset's, an export's and a fine-tuning
    run's config, and read back as written.
    """
    config = dict(config)
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = config["dtype"].get("config", {}).get("name")
    return json.loads(json.dumps(config, default=str))


PRESETS = {
    "base": {
        "description": (
            "The paper's base model (Table 3): N=6, d_model=512, d_ff=2048, h=8, "
            "d_k=d_v=64, P_drop=0.1, shared 37000-token BPE vocabulary (EN-DE). Random init."
        ),
        "reference": PAPER + ", Table 3 'base'",
        "average_last": 5,
        "config": {
            "vocabulary_size": 37000,
            "num_layers": 6,
            "num_heads": 8,
            "hidden_dim": 512,
            "intermediate_dim": 2048,
            "dropout": 0.1,
            "max_sequence_length": 1024,
        },
    },
    "big": {
        "description": (
            "The paper's big model (Table 3) for EN-DE: N=6, d_model=1024, d_ff=4096, "
            "h=16, d_k=d_v=64, P_drop=0.3, shared 37000-token BPE vocabulary. Random init."
        ),
        "reference": PAPER + ", Table 3 'big' and section 6.1",
        "average_last": 20,
        "config": {
            "vocabulary_size": 37000,
            "num_layers": 6,
            "num_heads": 16,
            "hidden_dim": 1024,
            "intermediate_dim": 4096,
            "dropout": 0.3,
            "max_sequence_length": 1024,
        },
    },
    "big_en_fr": {
        "description": (
            "The paper's big model for EN-FR: as 'big' but P_drop=0.1 (section 6.1) and "
            "the 32000 word-piece vocabulary the paper used for EN-FR (section 5.1). Random init."
        ),
        "reference": PAPER + ", sections 5.1 and 6.1",
        "average_last": 20,
        "config": {
            "vocabulary_size": 32000,
            "num_layers": 6,
            "num_heads": 16,
            "hidden_dim": 1024,
            "intermediate_dim": 4096,
            "dropout": 0.1,
            "max_sequence_length": 1024,
        },
    },
    "small": {
        "description": (
            "CPU-sized model for the Quick start: N=3, d_model=256, d_ff=1024, h=4, "
            "P_drop=0.1, 8000-token vocabulary. Trains on the bundled corpus on a laptop CPU."
        ),
        "reference": "Not in the paper; the paper's architecture at a smaller size.",
        "average_last": 5,
        "config": {
            "vocabulary_size": 8000,
            "num_layers": 3,
            "num_heads": 4,
            "hidden_dim": 256,
            "intermediate_dim": 1024,
            "dropout": 0.1,
            "max_sequence_length": 256,
        },
    },
    "tiny": {
        "description": (
            "Test-sized model: N=2, d_model=64, d_ff=128, h=4, P_drop=0.1, "
            "1000-token vocabulary. Seconds per step on a CPU."
        ),
        "reference": "Not in the paper; for tests and smoke runs.",
        "average_last": 5,
        "config": {
            "vocabulary_size": 1000,
            "num_layers": 2,
            "num_heads": 4,
            "hidden_dim": 64,
            "intermediate_dim": 128,
            "dropout": 0.1,
            "max_sequence_length": 256,
        },
    },
}


OPUS_MT = (
    "OPUS-MT (Tiedemann & Thottingal 2020, Helsinki-NLP), trained with Marian on OPUS data; CC-BY 4.0. "
    "The paper's base size (6+6 layers, d_model 512, 8 heads, d_ff 2048) with Marian's departures: "
    "swish feed-forward activation, sin|cos-halves positions, a logits bias. Trained weights, "
    "downloaded once from the Hugging Face Hub."
)

PRETRAINED_PRESETS = {
    f"opus_mt_{source}_{target}": {
        "description": f"{names[0]} -> {names[1]}: {OPUS_MT}",
        "handle": f"hf://Helsinki-NLP/opus-mt-{source}-{target}",
        "reference": "Tiedemann & Thottingal, 'OPUS-MT - Building open translation services for the World', EAMT 2020",
        "average_last": 5,
    }
    for source, target, names in (
        ("en", "de", ("English", "German")),
        ("de", "en", ("German", "English")),
        ("en", "fr", ("English", "French")),
        ("fr", "en", ("French", "English")),
        ("en", "es", ("English", "Spanish")),
        ("es", "en", ("Spanish", "English")),
    )
}

NLLB_200 = (
    "NLLB-200 (NLLB Team, 'No Language Left Behind', 2022, Meta AI): 200 languages; CC-BY-NC 4.0 (non-commercial). "
    "fairseq's pre-LN Transformer (a LayerNorm after each stack, fairseq's sinusoids, relu) with a 256k-piece "
    "SentencePiece vocabulary; translate with source_language= and target_language= (e.g. 'eng_Latn', "
    "'fra_Latn'). Trained weights, downloaded once from the Hugging Face Hub."
)

PRETRAINED_PRESETS.update({
    f"nllb_200_{name}": {
        "description": f"NLLB-200 {size} parameters ({what}): {NLLB_200}",
        "handle": f"hf://facebook/nllb-200-{repository}",
        "reference": "NLLB Team et al., 'No Language Left Behind: Scaling Human-Centered Machine Translation', 2022",
        "average_last": 5,
    }
    for name, repository, size, what in (
        ("distilled_600m", "distilled-600M", "600M", "distilled"),
        ("distilled_1_3b", "distilled-1.3B", "1.3B", "distilled"),
    )
})


def write_preset(model, directory, tokenizer=None, metadata=None, overwrite=False):
    """`TransformerModel.save_to_preset` of a model without LoRA adapters: staged, then renamed into place."""
    import keras

    from keras_transformer.utils import atomic_directory, check_output_directory
    from keras_transformer.version import __version__

    quantization = model.quantization
    directory = check_output_directory(
        directory, overwrite, is_preset_directory, "a preset directory (save_to_preset)", flag="overwrite=True"
    )
    with atomic_directory(directory) as staging:
        config = {
            "module": "keras_transformer",
            "class_name": type(model).__name__,
            "format_version": QUANTIZED_PRESET_FORMAT_VERSION if quantization else PRESET_FORMAT_VERSION,
            "keras_transformer_version": __version__,
            "keras_version": keras.__version__,
            "config": jsonable_config(model.get_config()),
        }
        if quantization:  # `from_preset` quantizes the layers before loading the int8 weights
            config["quantization"] = quantization
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.save_weights(str(staging / WEIGHTS_FILE))
        if tokenizer is not None:
            tokenizer.save(staging)
        (staging / METADATA_FILE).write_text(json.dumps(metadata or {}, indent=2, sort_keys=True) + "\n")

def load_preset(cls, preset, overrides):
    """`cls.from_preset(preset, **overrides)` without its quantization: a name, a directory or a checkpoint."""
    from keras_transformer import convert

    allowed = set(constructor_args(cls))
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"Unknown TransformerModel argument(s) {unknown}; allowed: {sorted(allowed)}")
    # A directory of that name wins, as it does over an architecture's name (below).
    if isinstance(preset, str) and preset in PRETRAINED_PRESETS and not os.path.isdir(preset):
        preset = PRETRAINED_PRESETS[preset]["handle"]
    checkpoint = convert.checkpoint_directory(preset)
    if checkpoint is not None:
        return convert.load_checkpoint(cls, checkpoint, overrides)
    if isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset):
        return load_preset_directory(cls, pathlib.Path(preset), overrides)
    if isinstance(preset, str) and preset in PRESETS:
        return cls(**{**PRESETS[preset]["config"], **overrides})
    raise ValueError(
        f"Unknown preset {preset!r}. Built-in presets: {', '.join([*PRESETS, *PRETRAINED_PRESETS])}; "
        "or pass a directory written by save_to_preset, a Hugging Face checkpoint directory, or hf://org/name."
    )


def constructor_args(cls):
    """The arguments a preset's config may hold: `cls.__init__`'s, with Keras' `dtype` and `name`."""
    import inspect

    return [
        name
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind is not p.VAR_KEYWORD
    ] + ["dtype", "name"]


def load_preset_directory(cls, directory, overrides):
    """`cls.from_preset(directory)` of a directory written by `save_to_preset`: checked, built, loaded."""
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"Preset directory {directory} has no {name}; a preset directory "
                f"written by save_to_preset holds {CONFIG_FILE} and {WEIGHTS_FILE}."
            )
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    config, quantization = read_preset_config(cls, config_path, with_quantization=True)
    config = {**config, **overrides}
    config.pop("name", None)
    try:
        model = cls.from_config(config)
        if quantization:  # the int8 layers (their variables) first, then the file's int8 weights
            model.quantize(quantization)
    except (TypeError, ValueError) as error:
        where = f"{config_path} with overrides {sorted(overrides)}" if overrides else str(config_path)
        raise ValueError(f"Cannot build a {cls.__name__} from {where}: {error}") from None
    check_weights_file(model, weights_path, config_path)
    try:
        model.load_weights(str(weights_path))
    except Exception as error:  # noqa: BLE001 - re-raised with the file named
        # Keras lists every layer that failed on several lines; its first lines say why.
        reason = " ".join(str(error).split("List of objects")[0].split())
        raise ValueError(
            f"Could not load {weights_path} into a model built from {config_path}: {reason}"
        ) from error
    from keras_transformer.tokenizers.sentencepiece import load_tokenizer

    model.tokenizer = load_tokenizer(directory)
    return model


def read_preset_config(cls, path, with_quantization=False):
    """The constructor arguments stored in a preset's config.json, checked for shape.

    With `with_quantization`: `(arguments, quantization)`, the latter None
    or "int8" (format 3).

    Raises:
        ValueError: naming `path`: not UTF-8, not JSON, not an object, another
            class or format, or keys that are not constructor arguments (the
            values themselves are checked by the constructor).
    """
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path} must hold a JSON object with 'class_name' and 'config', received a JSON "
            f"{_json_type(saved)}"
        )
    if saved.get("class_name") != cls.__name__ or "config" not in saved:
        raise ValueError(
            f"{path} does not describe a {cls.__name__} "
            f"(class_name={saved.get('class_name')!r})"
        )
    if saved.get("format_version") not in READABLE_PRESET_FORMATS:
        raise ValueError(
            f"{path} has format_version={saved.get('format_version')!r}; "
            f"this version of keras_transformer reads formats {', '.join(map(str, READABLE_PRESET_FORMATS))}"
        )
    config = saved["config"]
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: 'config' must be a JSON object of {cls.__name__} arguments, "
            f"received a JSON {_json_type(config)}"
        )
    unknown = sorted(set(config) - set(constructor_args(cls)) - {"trainable"})
    if unknown:
        raise ValueError(f"{path}: unknown {cls.__name__} argument(s) {unknown}")
    config = upgrade_preset_config(config, saved["format_version"])
    if not with_quantization:
        return config
    quantization = saved.get("quantization")
    if (quantization is None) != (saved["format_version"] != QUANTIZED_PRESET_FORMAT_VERSION):
        raise ValueError(
            f"{path} has format_version={saved['format_version']} and quantization={quantization!r}: "
            f"format {QUANTIZED_PRESET_FORMAT_VERSION} (and only it) records a quantization"
        )
    try:
        check_quantization(quantization, name="quantization")
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return config, quantization


def upgrade_preset_config(config, format_version):
    """The constructor arguments of a preset of `format_version`, in today's meaning.

    Format 1 differs in two arguments, translated so that an old preset
    builds the same model (same weight shapes, same outputs):
    - `value_dim=None` with `key_dim` set meant d_v = d_k (today:
      hidden_dim // num_heads), so `value_dim` becomes `key_dim`;
    - `attention_window=w` let each query see |i - j| <= w, 2w + 1 positions
      (today it is the width r of the window), so it becomes `2 * w + 1`.

    Args:
        config: dict of `TransformerModel` arguments as stored in config.json.
        format_version: the preset's `format_version`.

    Returns:
        a new dict for format `PRESET_FORMAT_VERSION`.
    """
    config = dict(config)
    if format_version == 1:
        if config.get("key_dim") is not None and config.get("value_dim") is None:
            config["value_dim"] = config["key_dim"]
        window = config.get("attention_window")
        if is_integer(window) and window >= 0:  # anything else is refused by the constructor
            config["attention_window"] = 2 * int(window) + 1
    return config


def _json_type(value):
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_weights_file(model, weights_path, config_path):
    """Refuses a weights file with arrays the model would not load.

    Keras' `load_weights` fails when the model has a weight that the file
    lacks, but silently ignores what the file has beyond the model (a file
    saved with more layers than `config_path` describes). Every array of the
    file except the optimizer's must therefore be one of the model's weights:
    with Keras' per-layer checks, equal counts mean every array is used.
    """
    import h5py

    arrays, names = [], set()
    with open_hdf5(weights_path) as handle:
        handle.visititems(lambda name, item: arrays.append(name) if isinstance(item, h5py.Dataset) else None)
        # Optimizer state, saved with a compiled model, is not a model weight.
        arrays = [name for name in arrays if name.split("/")[0] != "optimizer"]
        expected = len(model.weights)
        if len(arrays) == expected:
            return
        # For the message, the Keras names of the layers holding the arrays:
        # Keras stores each layer's name on its "vars" group.
        for name in arrays:
            parts = name.split("/")
            for depth in range(1, len(parts) - 1):
                group = handle.get("/".join(parts[:depth] + ["vars"]))
                if group is not None and "name" in group.attrs:
                    names.add(str(group.attrs["name"]))
    # Weight paths read "model_name/layer_name/.../variable_name".
    model_names = {part for weight in model.weights for part in weight.path.split("/")[1:-1]}
    top_level = {weight.path.split("/")[1] for weight in model.weights if weight.path.count("/") > 1}
    detail = ""
    if names - model_names:
        detail += f"; layers in the file that the model does not have: {', '.join(sorted(names - model_names))}"
    if top_level - names:
        detail += f"; layers of the model missing from the file: {', '.join(sorted(top_level - names))}"
    raise ValueError(
        f"{weights_path} holds {len(arrays)} weight arrays but the model described by "
        f"{config_path} has {expected}{detail}. The weights were saved from a different "
        "architecture (e.g. num_layers); use the config.json written with them."
    )
