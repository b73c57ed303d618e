"""`TransformerModel`'s constructor arguments: the allowed values and `check_model_args`."""

import itertools
import math

import numpy as np

from keras_transformer.layers.arguments import check_layer_args, check_positive_int, head_dims
from keras_transformer.utils import is_integer, is_real

# "sinusoidal" is the paper's interleaved table; "sinusoidal_halves" puts the
# sines in the first half of the features (Marian / OPUS-MT checkpoints);
# "sinusoidal_fairseq" is fairseq's table (NLLB-200, M2M-100): halves, other
# frequencies, positions from 2 (`layers.position.sinusoidal_table`).
POSITION_ENCODINGS = ("sinusoidal", "sinusoidal_halves", "sinusoidal_fairseq", "learned")
# The `sinusoidal_table` layout of each sinusoidal position encoding.
SINUSOID_LAYOUT = {"sinusoidal": "interleaved", "sinusoidal_halves": "halves", "sinusoidal_fairseq": "fairseq"}
# The feed-forward activation: ReLU in the paper (equation 2); the others
# for imported checkpoints (Marian's "swish" is `silu`).
ACTIVATIONS = ("relu", "gelu", "silu")


def check_model_args(
    vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim, key_dim, value_dim, dropout,
    attention_dropout, max_sequence_length, position_encoding, normalize_first, attention_window,
    layer_norm_epsilon, num_encoder_layers, num_decoder_layers, use_fused_attention, special_ids,
    activation="relu", logits_bias=False, exclude_start_logit=False, source_vocabulary_size=None,
):
    """Raises a `ValueError` naming the first bad `TransformerModel` argument; returns `(d_k, d_v)` per head.

    `special_ids` maps pad_id, unk_id, start_id and end_id to their values.
    """
    for name, value in (
        ("vocabulary_size", vocabulary_size),
        ("num_layers", num_layers),
        ("hidden_dim", hidden_dim),
        ("max_sequence_length", max_sequence_length),
    ):
        check_positive_int(name, value)
    check_positive_int("num_encoder_layers", num_encoder_layers, optional=True)
    check_positive_int("num_decoder_layers", num_decoder_layers, optional=True)
    check_positive_int("source_vocabulary_size", source_vocabulary_size, optional=True)
    check_layer_args(intermediate_dim, num_heads, dropout, attention_dropout, key_dim, value_dim, attention_window)
    if not is_real(layer_norm_epsilon) or not 0.0 < layer_norm_epsilon < math.inf:
        raise ValueError(f"layer_norm_epsilon={layer_norm_epsilon!r} must be a positive number")
    for name, value in (
        ("normalize_first", normalize_first), ("use_fused_attention", use_fused_attention), ("logits_bias", logits_bias),
        ("exclude_start_logit", exclude_start_logit),
    ):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name}={value!r} must be True or False")
    key_dim_resolved, value_dim_resolved = head_dims(hidden_dim, num_heads, key_dim, value_dim)
    if position_encoding not in POSITION_ENCODINGS:
        raise ValueError(
            f"position_encoding={position_encoding!r} must be one of {', '.join(map(repr, POSITION_ENCODINGS))}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {', '.join(map(repr, ACTIVATIONS))}")
    if position_encoding.startswith("sinusoidal") and hidden_dim % 2:
        raise ValueError(f"hidden_dim={hidden_dim} must be even for sinusoidal positions")
    if position_encoding == "sinusoidal_fairseq" and hidden_dim < 4:
        raise ValueError(f"hidden_dim={hidden_dim} must be at least 4 for fairseq's sinusoids")
    for name, value in special_ids.items():
        if not is_integer(value) or not 0 <= value < vocabulary_size:
            raise ValueError(f"{name}={value!r} must be an integer in [0, vocabulary_size={vocabulary_size})")
    for (name, value), (other, other_value) in itertools.combinations(special_ids.items(), 2):
        # start_id == end_id would end every output at its first token.
        if value == other_value:
            raise ValueError(
                f"{name}={value} and {other}={other_value} must differ: the special ids "
                "pad_id, unk_id, start_id and end_id are four distinct tokens"
            )
    if special_ids["pad_id"] != 0:
        raise ValueError(f"pad_id={special_ids['pad_id']}: only 0 is supported (masks are built from ids > 0)")
    return key_dim_resolved, value_dim_resolved
