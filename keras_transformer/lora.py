"""LoRA (Hu et al., 2021) on a `TransformerModel`, with Keras' own `Dense.enable_lora`.

A LoRA `Dense` computes `x (W + (alpha / r) A B) + b` with `A [in, r]`,
`B [r, out]` trainable and `W` frozen (Keras initialises `B` to zeros, so the
model starts as it was). `enable_lora` adds the adapters to the target
projections and freezes every other weight (embedding, positions, layer
norms, biases, the logits bias), as keras-hub's `Backbone.enable_lora`
freezes everything but the adapters.

Files: Keras' `Dense.save_own_variables` writes the merged kernel `W +
(alpha / r) A B` in the kernel's place and leaves `A` and `B` out (its
`load_own_variables` zeroes them), so a LoRA model's `.weights.h5` (a
checkpoint) is an ordinary model's, averaged and loaded as one;
`TransformerModel.save_weights` merges in float32 under mixed precision
(`kernels_merged_in_float32`). A resume point must give back `W`, `A` and `B`
themselves: `save_resume_state` stores them beside the merged weights.

References:
- Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv:2106.09685.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from keras_transformer.layers.arguments import check_positive_int
from keras_transformer.utils import is_real

# Target name -> the `Dense` layers (by layer name) it adapts. "attention": the
# four projections W^Q, W^K, W^V, W^O of every self- and cross-attention
# (paper section 3.2.2); "feedforward": W_1 and W_2 of equation (2).
LORA_TARGETS = {
    "attention": ("query", "key", "value", "attention_output"),
    "feedforward": ("feedforward_intermediate_dense", "feedforward_output_dense"),
}
DEFAULT_LORA_TARGETS = ("attention",)
# Every name `targets` accepts: the groups and their layers' names.
LORA_TARGET_NAMES = (*LORA_TARGETS, *(name for names in LORA_TARGETS.values() for name in names))
# The HDF5 group of a resume point that holds each adapted layer's W, A and B.
RESUME_GROUP = "keras_transformer_lora"


def target_layer_names(targets=None, name="targets"):
    """The `Dense` layer names that `targets` adapt, checked; None: `DEFAULT_LORA_TARGETS`.

    Args:
        targets: a name or a list of names from `LORA_TARGET_NAMES` (groups
            such as "attention", or single layers such as "query").
        name: the argument's name in the error messages.

    Raises:
        ValueError: naming what was received and what is allowed.
    """
    received = targets
    targets = DEFAULT_LORA_TARGETS if targets is None else ((targets,) if isinstance(targets, str) else targets)
    try:
        targets = tuple(targets)
    except TypeError:
        targets = None
    allowed = ", ".join(map(repr, LORA_TARGET_NAMES))
    if not targets or not all(isinstance(name, str) for name in targets):
        raise ValueError(f"{name}={received!r} must be one or more of {allowed}")
    unknown = [target for target in targets if target not in LORA_TARGET_NAMES]
    if unknown:
        raise ValueError(f"{name}={received!r}: unknown {', '.join(map(repr, unknown))}; allowed: {allowed}")
    names = []
    for target in targets:
        for layer_name in LORA_TARGETS.get(target, (target,)):
            if layer_name not in names:
                names.append(layer_name)
    return tuple(names)


def check_lora_alpha(lora_alpha):
    """Refuses a `lora_alpha` that is not None or a positive number."""
    if lora_alpha is not None and (not is_real(lora_alpha) or not 0 < lora_alpha < float("inf")):
        raise ValueError(f"lora_alpha={lora_alpha!r} must be None (= rank) or a positive number")


def enable_lora(model, rank, targets=None, lora_alpha=None):
    """`TransformerModel.enable_lora`: adapters on the target `Dense` layers, every other weight frozen.

    Returns:
        the tuple of adapted layer names.
    """
    check_positive_int("rank", rank)
    names = target_layer_names(targets)
    check_lora_alpha(lora_alpha)
    if model.lora_rank is not None:
        raise ValueError(
            f"LoRA is already enabled on this model (rank={model.lora_rank}, targets={list(model.lora_targets)}); "
            "enable_lora can be called once: build the model again, or merge_lora() and enable it on the copy"
        )
    quantized = sorted({layer.quantization_mode for layer in model._flatten_layers() if layer.quantization_mode})
    if quantized:
        raise ValueError(f"enable_lora on a quantized model (quantization_mode={quantized[0]!r}) is not supported")
    # Freeze everything (the layer setter freezes each layer's variables),
    # then let the targets' adapters, and only them, train.
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = False
    for variable in model._trainable_variables:  # the model's own: the logits bias
        variable.trainable = False
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Dense) and layer.name in names:
            layer.trainable = True
            layer.enable_lora(int(rank), lora_alpha=lora_alpha)  # freezes the kernel
            if layer.bias is not None:
                layer.bias.trainable = False
    model.lora_rank, model.lora_alpha, model.lora_targets = int(rank), lora_alpha, names
    return names


def lora_layers(model):
    """The `Dense` layers of `model` with an adapter, in the model's layer order."""
    return [
        layer for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.Dense) and layer.lora_enabled
    ]


def merged_kernel(layer):
    """`W + (alpha / r) A B` of a LoRA `Dense`, as its `kernel` computes it, in the variable's dtype."""
    delta = (layer.lora_alpha / layer.lora_rank) * ops.matmul(layer.lora_kernel_a, layer.lora_kernel_b)
    return ops.add(layer._kernel, ops.cast(delta, layer._kernel.dtype))


def merged_weights(model):
    """`model.get_weights()` with each adapter merged into its kernel and left out.

    The weights of the same config without LoRA, in their order: what
    `set_weights` of `TransformerModel.from_config(model.get_config())` takes.
    """
    layers = lora_layers(model)
    kernels = {id(layer._kernel): layer for layer in layers}
    factors = {id(v) for layer in layers for v in (layer.lora_kernel_a, layer.lora_kernel_b)}
    weights = []
    for variable in model.weights:
        if id(variable) in factors:
            continue
        value = merged_kernel(kernels[id(variable)]) if id(variable) in kernels else variable
        weights.append(np.asarray(ops.convert_to_numpy(value)))
    return weights


@contextlib.contextmanager
def kernels_merged_in_float32(model):
    """Within: each adapted layer's `kernel` (what Keras' `save_weights` writes) is merged in its variable dtype.

    Keras' `Dense.kernel` casts the merged kernel to the compute dtype: under
    mixed precision a checkpoint would hold bfloat16 (or float16) kernels,
    the frozen weights rounded, and `average_checkpoints` would not average
    them (not a float type to NumPy). The layers' policies are set back on
    leaving.
    """
    layers = [layer for layer in lora_layers(model) if layer.compute_dtype != layer.variable_dtype]
    policies = [layer.dtype_policy for layer in layers]
    try:
        for layer in layers:
            layer.dtype_policy = layer.variable_dtype
        yield
    finally:
        for layer, policy in zip(layers, policies):
            layer.dtype_policy = policy


def merged_model(model):
    """`model` itself without LoRA; with LoRA, `model.merge_lora()`: what exporters and presets take."""
    return model.merge_lora() if model.lora_rank is not None else model


def _relative_path(layer, model):
    """The layer's path inside the model ("encoder_layer_0/self_attention/query"), the same in every process.

    A variable's path starts with the model's name, which Keras numbers per
    process (`transformer_model_3`).
    """
    path = layer._kernel.path.rsplit("/", 1)[0]
    prefix = model.name + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def save_resume_state(model, handle):
    """Writes W, A and B of each adapted layer into the open HDF5 file `handle` (nothing without LoRA).

    The file's weights (Keras') hold the merged kernels, from which neither
    W nor the factors can be recovered exactly.
    """
    if model.lora_rank is None:
        return
    group = handle.create_group(RESUME_GROUP)
    group.attrs["rank"] = model.lora_rank
    for layer in lora_layers(model):
        entry = group.create_group(_relative_path(layer, model))
        for name, variable in (("kernel", layer._kernel), ("lora_kernel_a", layer.lora_kernel_a),
                               ("lora_kernel_b", layer.lora_kernel_b)):
            entry.create_dataset(name, data=np.asarray(ops.convert_to_numpy(variable)))


def read_resume_state(model, handle, path):
    """What `save_resume_state` wrote in the open HDF5 file `handle`, checked against `model`.

    Read before Keras' `load_weights`, which would fail first (and less
    clearly) on the optimizer's variables of another rank.

    Returns:
        `[(variable, array), ...]` for `restore_resume_state`; empty without LoRA.

    Raises:
        ValueError: naming `path`, when the file and the model disagree on LoRA.
    """
    group = handle.get(RESUME_GROUP)
    if model.lora_rank is None:
        if group is not None:
            raise ValueError(f"{path} was written by a LoRA run (rank={group.attrs['rank']}); the model has no LoRA")
        return []
    if group is None or int(group.attrs["rank"]) != model.lora_rank:
        found = "no LoRA state" if group is None else f"LoRA rank={int(group.attrs['rank'])}"
        raise ValueError(f"{path} holds {found}; the model has LoRA rank={model.lora_rank}")
    values = []
    for layer in lora_layers(model):
        entry = group.get(_relative_path(layer, model))
        if entry is None:
            raise ValueError(f"{path} has no LoRA state for {_relative_path(layer, model)}")
        for name, variable in (("kernel", layer._kernel), ("lora_kernel_a", layer.lora_kernel_a),
                               ("lora_kernel_b", layer.lora_kernel_b)):
            value = np.asarray(entry[name])
            if value.shape != tuple(variable.shape):
                raise ValueError(f"{path}: {_relative_path(layer, model)}/{name} has shape {value.shape}, "
                                 f"the model {tuple(variable.shape)}")
            values.append((variable, value))
    return values


def restore_resume_state(values):
    """Assigns what `read_resume_state` returned, after Keras' `load_weights` set the merged kernels."""
    for variable, value in values:
        variable.assign(value)
