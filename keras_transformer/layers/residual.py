"""The residual connection around each sub-layer (paper section 5.4)."""

from keras import ops


def residual_connection(x, sublayer, norm, dropout, normalize_first=False, training=None):
    """`LayerNorm(x + Dropout(Sublayer(x)))`, the paper's post-LN (section 5.4).

    With `normalize_first=True`, the pre-LN variant (not the paper's):
    `x + Dropout(Sublayer(LayerNorm(x)))`.

    Args:
        x: `[B, T, D]`.
        sublayer: function `[B, T, D] -> [B, T, D]` (attention or FFN).
        norm: the sub-layer's `LayerNormalization`.
        dropout: the sub-layer's `Dropout` (P_drop on its output).
        normalize_first: bool, pre-LN instead of post-LN.
        training: passed to `dropout`.

    Returns:
        `[B, T, D]`.
    """
    y = norm(x) if normalize_first else x
    x = ops.add(x, dropout(sublayer(y), training=training))
    return x if normalize_first else norm(x)
