"""Checks of the layers' constructor arguments, written once.

`TransformerModel`, the encoder and decoder layers and `MultiHeadAttention`
all call these, so a bad value gets the same one-line message wherever it
enters: `ValueError("num_heads=0 must be a positive integer")`.
"""

from keras_transformer.utils import is_integer, is_real


def check_positive_int(name, value, optional=False):
    """Refuses anything but an integer >= 1 (or None when `optional`); bools are not sizes."""
    if optional and value is None:
        return
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if optional else ""))


def check_rate(name, value):
    """Refuses a dropout rate outside [0, 1) (or not a number)."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be a number in [0, 1)")


def check_attention_window(attention_window):
    """Refuses an `attention_window` that is not None or an odd integer >= 1.

    The window is the paper's r (Table 1): the r positions centered on the
    query, (r - 1) / 2 on each side, so r must be odd; an even width has no
    center.
    """
    if attention_window is None:
        return
    if not is_integer(attention_window) or attention_window < 1:
        raise ValueError(f"attention_window={attention_window!r} must be None or an odd positive integer")
    if attention_window % 2 == 0:
        raise ValueError(
            f"attention_window={attention_window} must be odd: the window is the r positions centered "
            f"on the query, (r - 1) / 2 on each side; use {attention_window - 1} or {attention_window + 1}"
        )


def check_layer_args(intermediate_dim, num_heads, dropout, attention_dropout, key_dim, value_dim, attention_window):
    """The arguments that the encoder and decoder layers (and the model) share."""
    check_positive_int("intermediate_dim", intermediate_dim)
    check_positive_int("num_heads", num_heads)
    check_rate("dropout", dropout)
    check_rate("attention_dropout", attention_dropout)
    check_positive_int("key_dim", key_dim, optional=True)
    check_positive_int("value_dim", value_dim, optional=True)
    check_attention_window(attention_window)


def head_dims(hidden_dim, num_heads, key_dim, value_dim):
    """Per-head (d_k, d_v); each defaults to hidden_dim // num_heads, independently of the other."""
    if (key_dim is None or value_dim is None) and hidden_dim % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide hidden_dim={hidden_dim} "
            "(or pass key_dim and value_dim explicitly)"
        )
    default = hidden_dim // num_heads
    return (key_dim or default), (value_dim or default)
