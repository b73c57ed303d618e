"""What the Hugging Face converters share: reading config fields, JSON and safetensors, and the weight walk.

As keras-hub's `safetensor_utils.py`: `read_safetensors` reads every tensor
as float32 NumPy (never a pickle), and `WeightWalk` ports them into Keras
variables by name, checking shapes and keeping track of what was used, so
that a converter can refuse a file with tensors it did not use.
"""

import json
import logging
import pathlib

import numpy as np

from keras_transformer.convert import HF_CONFIG_FILE, PICKLES, CheckpointError, read_hf_config

logger = logging.getLogger(__name__)

# Hugging Face's `activation_function` -> Keras' (Marian, M2M-100 and FSMT name them alike).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which every imported family uses
# Overrides that keep a checkpoint's computation (anything else would change its shapes or its numbers).
ALLOWED_OVERRIDES = ("dropout", "attention_dropout", "use_fused_attention", "max_sequence_length", "dtype", "name")
TOKENIZER_CONFIG = "tokenizer_config.json"


def config_field(config, name, default=None):
    """`config[name]`, or `default` where it is missing or null."""
    return config.get(name, default) if config.get(name) is not None else default


def read_json(path):
    """A JSON file's value; `CheckpointError` naming the file if it is not UTF-8 JSON."""
    try:
        return json.loads(pathlib.Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid UTF-8 JSON: {error}") from None


def read_tokenizer_config(directory):
    """A checkpoint's tokenizer_config.json as a dict ({} where there is none)."""
    path = pathlib.Path(directory) / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    tokenizer_config = read_json(path)
    if not isinstance(tokenizer_config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return tokenizer_config


def refusal(config, path):
    """`refuse(field, why)`: raises `CheckpointError` naming `path`, the field and its value in `config`."""
    def refuse(field, why):
        raise CheckpointError(f"{path}: {field}={config.get(field)!r} {why}")

    return refuse


def stack_arguments(config, path, default_activation, default_max_length):
    """The `TransformerModel` arguments of both stacks from a BART-family config.json (Marian, M2M-100, FSMT).

    Raises:
        CheckpointError: naming the first field the model cannot express: an
            unknown activation, stacks of different widths or head counts, a
            d_model the heads do not divide.
    """
    refuse = refusal(config, path)
    activation = config_field(config, "activation_function", default_activation)
    if activation not in ACTIVATIONS:
        refuse("activation_function", f"is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")
    for side in ("ffn_dim", "attention_heads"):
        if config.get(f"encoder_{side}") != config.get(f"decoder_{side}"):
            refuse(f"decoder_{side}", f"differs from encoder_{side}={config.get(f'encoder_{side}')!r}; "
                   "TransformerModel has one size for both stacks")
    for field in ("activation_dropout", "encoder_layerdrop", "decoder_layerdrop"):
        if config_field(config, field, 0.0):
            # Training-only: inference is exact, fine-tuning would not apply it.
            logger.warning("%s: %s=%s is not applied by TransformerModel (training only; inference is exact)",
                           path, field, config[field])
    hidden_dim, num_heads = config.get("d_model"), config.get("encoder_attention_heads")
    if not isinstance(hidden_dim, int) or not isinstance(num_heads, int) or num_heads < 1 or hidden_dim % num_heads:
        refuse("d_model", f"must be an integer multiple of encoder_attention_heads={num_heads!r}")
    return {
        "num_layers": config.get("encoder_layers"),
        "num_encoder_layers": config.get("encoder_layers"),
        "num_decoder_layers": config.get("decoder_layers"),
        "num_heads": num_heads,
        "hidden_dim": hidden_dim,
        "intermediate_dim": config.get("encoder_ffn_dim"),
        "dropout": float(config_field(config, "dropout", 0.1)),
        "attention_dropout": float(config_field(config, "attention_dropout", 0.0)),
        "max_sequence_length": config_field(config, "max_position_embeddings", default_max_length),
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "activation": ACTIVATIONS[activation],
    }


def load_family(cls, directory, overrides, family, name):
    """The steps of every converter's `load`: a `cls` from a checkpoint directory, its tokenizer as `model.tokenizer`.

    Args:
        family: the converter module: `convert_config`, `convert_tokenizer`,
            `vocabulary_sizes(tokenizer, arguments)` (the sizes the tokenizer
            fixes: an added start row) and `convert_weights`.
        name: the family, for the log line.
    """
    directory = pathlib.Path(directory)
    config = read_hf_config(directory)
    arguments = family.convert_config(config, directory / HF_CONFIG_FILE)
    check_overrides(directory, overrides, ALLOWED_OVERRIDES)
    tokenizer = family.convert_tokenizer(directory, config)
    tensors = read_safetensors(directory)
    arguments.update(family.vocabulary_sizes(tokenizer, arguments))
    model = cls(**{**arguments, **overrides})
    family.convert_weights(model, tensors, tokenizer, source=str(directory / "model.safetensors"))
    model.tokenizer = tokenizer
    logger.info("Imported the %s checkpoint %s (%d parameters)", name, directory, model.count_params())
    return model


def read_safetensors(directory):
    """Every tensor of the checkpoint's safetensors file(s), as float32 NumPy arrays by name.

    Raises:
        CheckpointError: there is no safetensors file (a pickle-only
            checkpoint is named with the way to convert it), or a tensor of a
            dtype NumPy cannot hold.
    """
    directory = pathlib.Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
    else:
        files = ["model.safetensors"] if (directory / "model.safetensors").is_file() else []
    if not files:
        pickles = [name for name in PICKLES if (directory / name).is_file()]
        found = f" (it has {', '.join(pickles)}, which this package does not read: a pickle can run code)" if pickles else ""
        raise CheckpointError(
            f"{directory} has no model.safetensors{found}. Convert it once, where you trust the file: "
            f"python -c \"from transformers import AutoModelForSeq2SeqLM as M; "
            f"M.from_pretrained('{directory}').save_pretrained('{directory}')\" (writes model.safetensors), "
            "or use a revision of the repository that has model.safetensors (hf://org/name@revision)"
        )
    try:
        from safetensors import safe_open
    except ModuleNotFoundError:
        raise ModuleNotFoundError("Reading safetensors checkpoints needs safetensors: pip install \"keras-aiayn[hub]\"",
                                  name="safetensors") from None
    tensors = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory} is missing {name} (named by model.safetensors.index.json)")
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for key in handle.keys():
                    tensors[key] = np.asarray(handle.get_tensor(key), dtype=np.float32)
        except (TypeError, ValueError, OSError) as error:  # bfloat16 and damaged files land here
            raise CheckpointError(f"Cannot read {path}: {error}") from None
    return tensors


class WeightWalk:
    """Ports checkpoint tensors into Keras variables by name, keeping track of what was used."""

    def __init__(self, tensors, source):
        self.tensors = tensors
        self.source = source
        self.used = set()

    def take(self, key):
        if key not in self.tensors:
            raise CheckpointError(f"{self.source} has no tensor {key!r}; the checkpoint does not match its config.json")
        self.used.add(key)
        return self.tensors[key]

    def port_weight(self, variable, key, hook_fn=None):
        """Assigns `hook_fn(tensor)` (or the tensor) to `variable`, checking the shape."""
        stored = self.take(key)
        value = stored if hook_fn is None else hook_fn(stored)
        if tuple(value.shape) != tuple(variable.shape):
            converted = f" ({tuple(value.shape)} once converted)" if hook_fn is not None else ""
            raise CheckpointError(
                f"{self.source}: {key} has shape {tuple(stored.shape)}{converted}, which does not fit "
                f"{variable.path} {tuple(variable.shape)}; the checkpoint does not match its config.json"
            )
        variable.assign(value.astype(np.float32))

    def port_dense(self, dense, key):
        """A PyTorch `Linear` ([out, in] weight and bias) into a Keras `Dense` ([in, out] kernel)."""
        self.port_weight(dense.kernel, f"{key}.weight", np.transpose)
        self.port_weight(dense.bias, f"{key}.bias")

    def port_norm(self, norm, key):
        self.port_weight(norm.gamma, f"{key}.weight")
        self.port_weight(norm.beta, f"{key}.bias")

    def port_attention(self, attention, norm, key, norm_key):
        for dense, name in ((attention.query_dense, "q_proj"), (attention.key_dense, "k_proj"),
                            (attention.value_dense, "v_proj"), (attention.output_dense, "out_proj")):
            self.port_dense(dense, f"{key}.{name}")
        self.port_norm(norm, norm_key)

    def port_feedforward(self, layer, key):
        self.port_dense(layer.feedforward_intermediate, f"{key}.fc1")
        self.port_dense(layer.feedforward_output, f"{key}.fc2")
        self.port_norm(layer.feedforward_norm, f"{key}.final_layer_norm")


def same_as(walk, key, reference, what, tolerance=0.0):
    """Checks that an optional duplicate tensor (a tied copy, a stored table) equals what the model computes."""
    if key in walk.tensors:
        walk.used.add(key)
        value = walk.tensors[key]
        if value.shape != reference.shape or not np.allclose(value, reference, atol=tolerance, rtol=0):
            raise CheckpointError(f"{walk.source}: {key} differs from {what}; TransformerModel cannot express that")


def port_layers(walk, model):
    """Ports every encoder and decoder layer of `model` from Hugging Face's BART-family names (Marian, M2M-100)."""
    for i, layer in enumerate(model.encoder_layers):
        key = f"model.encoder.layers.{i}"
        walk.port_attention(layer.self_attention, layer.self_attention_norm, f"{key}.self_attn",
                            f"{key}.self_attn_layer_norm")
        walk.port_feedforward(layer, key)
    for i, layer in enumerate(model.decoder_layers):
        key = f"model.decoder.layers.{i}"
        walk.port_attention(layer.self_attention, layer.self_attention_norm, f"{key}.self_attn",
                            f"{key}.self_attn_layer_norm")
        walk.port_attention(layer.cross_attention, layer.cross_attention_norm, f"{key}.encoder_attn",
                            f"{key}.encoder_attn_layer_norm")
        walk.port_feedforward(layer, key)


def check_all_used(walk, tensors, source):
    """Refuses a checkpoint with tensors the walk did not port: every weight has a home or the import stops."""
    from keras_transformer.convert import CheckpointError

    unused = sorted(set(tensors) - walk.used)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(f"{source} has tensors the converted model does not use: {shown}")


def check_overrides(directory, overrides, allowed):
    """Refuses constructor overrides that would change what a pretrained checkpoint's weights mean."""
    from keras_transformer.convert import CheckpointError

    refused = sorted(set(overrides) - set(allowed))
    if refused:
        raise CheckpointError(
            f"Cannot override {refused} of the pretrained checkpoint {directory} (its weights fix them); "
            f"allowed: {', '.join(allowed)}"
        )
