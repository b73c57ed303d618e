"""Keras' own int8 quantization of a `TransformerModel` (`model.quantize("int8")`).

What Keras quantizes here, with its `AbsMaxQuantizer`: every projection
(`Dense`: W^Q, W^K, W^V, W^O of each attention, W_1 and W_2 of each
feed-forward network) becomes an int8 kernel with one float32 scale per
output column, and its inputs are quantized per row at run time (dynamic
int8: no calibration data); the shared embedding matrix becomes an int8
`[V, D]` with one scale per row (per token).

The tied embedding and pre-softmax projection (section 3.4) stay tied: the
one int8 matrix serves the lookup (a row and its scale) and, transposed, the
output projection, where the per-row scale is one scale per output logit,
the same per-output-channel scheme as every other projection. Untying would
add a second `[V, D]` matrix (the largest of a small model) for no gain in
accuracy, and ONNX Runtime's and CTranslate2's int8 keep the tie too.

What stays float32: the layer norms, the biases, the positions (the
sinusoidal table is computed; Keras has no int8 for a learned position
table) and the logits bias. `quantize` says so in one log line, and warns
when a layer holding a weight matrix was left float32.

A quantized model translates on TensorFlow, JAX and PyTorch (`generate`,
`Translator`) and saves as a preset (config.json records `"quantization":
"int8"`, so `from_preset` quantizes the layers before loading the int8
weights). It is not exported: the exporters quantize from float32 weights
themselves (`python -m export.onnx --quantize int8`, `python -m
export.ctranslate2 --quantization int8`), and a Keras int8 model given to
them is refused in one line (`refuse_quantized`) rather than dequantized,
which would export rounded weights as if they were the float32 model.
LoRA: `enable_lora` refuses a quantized model, and `quantize` a model with
adapters (merge first: `model.merge_lora().quantize("int8")`).

No framework is imported until a function needs Keras: the exporters import
`refuse_quantized` at start-up.
"""

import collections
import contextlib
import logging
import warnings

logger = logging.getLogger(__name__)

# The modes this project supports and tests (Keras has others: int4, float8, GPTQ, AWQ).
QUANTIZATION_MODES = ("int8",)
# The layer types Keras can quantize (`keras.layers` names): one of them left float32 is warned about.
QUANTIZABLE_LAYERS = ("Dense", "EinsumDense", "Embedding")
# Keras' `Model.quantize` warns once per layer it cannot quantize; `quantize` reports them in one line instead.
_KERAS_SKIP_WARNING = "does not have a `quantize` method"


def check_quantization(mode, name="quantize"):
    """Refuses a quantization mode other than None and `QUANTIZATION_MODES`; returns it."""
    if mode is not None and (not isinstance(mode, str) or mode not in QUANTIZATION_MODES):
        raise ValueError(
            f"{name}={mode!r} must be None (float32) or one of {', '.join(map(repr, QUANTIZATION_MODES))} "
            "(Keras' int8: int8 weights, inputs quantized at run time)"
        )
    return mode


def _leaf_layers(model):
    return [layer for layer in model._flatten_layers(include_self=False) if not layer._layers]


def quantization_of(model):
    """The model's quantization mode ("int8"), or None for a float model."""
    modes = {layer.quantization_mode for layer in _leaf_layers(model)} - {None}
    if len(modes) > 1:  # only `keras.Model.quantize` with `filters` and two modes makes this
        raise ValueError(f"The model mixes quantization modes {sorted(modes)}; this project supports one")
    return modes.pop() if modes else None


def _relative_name(layer, model):
    """The layer's path inside the model ("encoder_layer_0/self_attention/query"), without the model's name."""
    path = layer.path or layer.name
    prefix = model.name + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


@contextlib.contextmanager
def _one_garbage_collection():
    """Keras' `Layer.__delattr__` runs `gc.collect()` for every float kernel it replaces.

    That is a full collection per layer: 0.3 s each in a process holding
    TensorFlow, JAX and PyTorch, so 10 s to quantize a 2 + 2-layer model. The
    float kernels are freed by one collection at the end all the same.
    """
    import gc

    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = collect
        gc.collect()


def quantize(model, mode=None, config=None):
    """`TransformerModel.quantize`: Keras' quantization of every layer it can, reported in one line.

    Args:
        model: a float `TransformerModel` without LoRA adapters.
        mode: one of `QUANTIZATION_MODES` (Keras resolves it from `config`
            when None).
        config: optional `keras.quantizers.QuantizationConfig`.

    Returns:
        the names of the layers left float32, in the model's order.

    Raises:
        ValueError: an unsupported mode, a model with LoRA adapters, or one
            already quantized.
    """
    import keras

    check_quantization(mode)
    if mode is None:
        raise ValueError(f"quantize needs a mode: one of {', '.join(map(repr, QUANTIZATION_MODES))}")
    if model.lora_enabled:
        raise ValueError(
            f"quantize({mode!r}) on a model with LoRA adapters (rank={model.lora_rank}) is not supported: "
            f"quantize the merged model, model.merge_lora().quantize({mode!r})"
        )
    current = quantization_of(model)
    if current is not None:
        raise ValueError(
            f"quantize({mode!r}): the model is already quantized ({current!r}); quantize a float32 model "
            "(from_preset of the float32 preset)"
        )
    from keras_transformer.search import compiled

    with warnings.catch_warnings(record=True) as caught, _one_garbage_collection():
        warnings.simplefilter("always")
        keras.Model.quantize(model, mode, config=config)
    compiled.forget(model)  # a search compiled before holds the float32 kernels
    for warning in caught:  # anything but Keras' per-layer "cannot" (reported below) is passed on
        if _KERAS_SKIP_WARNING not in str(warning.message):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return _report(model, mode)


def _report(model, mode):
    """Logs one line: the layers quantized, and those left float32 that hold weights; returns the latter's names."""
    import keras

    quantizable = tuple(getattr(keras.layers, name) for name in QUANTIZABLE_LAYERS)
    quantized, kept, missed = collections.Counter(), collections.Counter(), []
    for layer in _leaf_layers(model):
        if layer.quantization_mode is not None:
            quantized[type(layer).__name__] += 1
        elif layer.weights:
            kept[type(layer).__name__] += 1
            if isinstance(layer, quantizable) or any(len(w.shape) >= 2 for w in layer.weights):
                missed.append(f"{_relative_name(layer, model)} ({type(layer).__name__})")
    own = [weight.name for weight in model._trainable_variables + model._non_trainable_variables]
    summary = ", ".join(f"{count} {name}" for name, count in quantized.items())
    float32 = ", ".join([f"{count} {name}" for name, count in kept.items()] + [f"the {name}" for name in own])
    if missed:
        logger.warning(
            "quantize(%r): Keras cannot quantize %s, left float32 (quantized: %s)", mode, ", ".join(missed), summary
        )
    else:
        logger.info("quantize(%r): %s quantized; left float32: %s", mode, summary, float32 or "nothing")
    return missed


def refuse_quantized(model, command, instead):
    """Refuses, in one line, to export a model that Keras quantized.

    Args:
        model: a `TransformerModel`.
        command: the exporter, e.g. "python -m export.onnx".
        instead: what to run for an int8 export, e.g. "--quantize int8 (ONNX Runtime's int8)".
    """
    mode = quantization_of(model)
    if mode is not None:
        raise ValueError(
            f"{command}: the model is quantized by Keras ({mode!r}), which this exporter does not read; export the "
            f"float32 preset{', with ' + instead if instead else ''}"
        )
