"""keras_transformer: the original Transformer (Vaswani et al., 2017) in Keras 3.

The public names below are imported on first use (PEP 562), so that the
submodules that need no training framework (`keras_transformer.textio`,
`keras_transformer.tokenizer`, `keras_transformer.translator`,
`keras_transformer.search_output`) can be imported by the ONNX Runtime server
(`export.runtime`) without loading Keras, TensorFlow, JAX or PyTorch.
"""

import importlib

from keras_transformer.version import __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "InPlaceAdam": "keras_transformer.optimizers",
    "LabelSmoothedCrossEntropy": "keras_transformer.losses",
    "TransformerModel": "keras_transformer.model",
    "WarmupSchedule": "keras_transformer.schedules",
    "WarmupScheduleCallback": "keras_transformer.schedules",
    "warmup_learning_rate": "keras_transformer.schedules",
    "Tokenizer": "keras_transformer.tokenizers.sentencepiece",
    "train_tokenizer": "keras_transformer.tokenizers.sentencepiece",
    "average_checkpoints": "keras_transformer.training",
    "Translator": "keras_transformer.translator",
    "SearchOptions": "keras_transformer.search.options",
}

__all__ = sorted([*_EXPORTS, "__version__", "layers"])


# Packages of the `[train]` extra, which the base install (a server) lacks.
_TRAINING_PACKAGES = {"keras", "tensorflow", "keras_hub", "tensorflow_text", "sacrebleu", "h5py"}


def __getattr__(name):
    if name not in _EXPORTS and name != "layers":
        raise AttributeError(f"module 'keras_transformer' has no attribute {name!r}")
    try:
        if name == "layers":
            module = importlib.import_module("keras_transformer.layers")
        else:
            module = getattr(importlib.import_module(_EXPORTS[name]), name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in _TRAINING_PACKAGES:
            raise
        raise ModuleNotFoundError(
            f"keras_transformer.{name} needs {error.name}, which this install lacks: "
            'pip install "keras-aiayn[train]" (the base install only serves exported models)',
            name=error.name,
        ) from error
    # Cached as a module attribute: later lookups do not come here.
    globals()[name] = module
    return module


def __dir__():
    return sorted(set(globals()) | set(__all__))
