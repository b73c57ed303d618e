"""Attention heatmaps with the tokens on the axes, as the paper's Figures 3-5.

The weights come from `TransformerModel.attention_scores`; the functions
draw one head, or a grid of heads of one layer, and return a
`matplotlib.figure.Figure` (built without pyplot, so nothing is shown or kept
open; in a notebook the returned figure displays itself).

Example:

```python
model = kt.TransformerModel.from_preset("runs/small")
tok = model.tokenizer
src = np.array(tok.encode(["The cat sat on the mat."]))
tgt = model.generate(src)[:, :-1]
scores = model.attention_scores(src, tgt)
fig = plot_attention_heads(
    scores["cross_attention"][-1][0],                  # last layer, first sentence: [N, T, S]
    query_tokens=token_labels(tok, tgt[0]),
    key_tokens=token_labels(tok, src[0]),
)
fig.savefig("cross_attention.png")
```
"""

import math

import numpy as np

def token_labels(tokenizer, token_ids, drop_padding=True):
    """Axis labels for a sequence of ids: each id's text, specials as `<s>`, `</s>`, `<pad>`.

    Args:
        tokenizer: a `keras_transformer.tokenizers.sentencepiece.Tokenizer`.
        token_ids: 1D ids.
        drop_padding: bool, drop pad ids (0).

    Returns:
        list of str.
    """
    specials = {
        tokenizer.pad_id: "<pad>",
        tokenizer.unk_id: "<unk>",
        tokenizer.start_id: "<s>",
        tokenizer.end_id: "</s>",
    }
    labels = []
    for token in np.asarray(token_ids).reshape(-1).tolist():
        if drop_padding and token == tokenizer.pad_id:
            continue
        labels.append(specials[token] if token in specials else tokenizer.decode([[token]])[0] or "▁")
    return labels


def _check_weights(weights, rank, name):
    weights = np.asarray(weights, dtype="float32")
    if weights.ndim != rank:
        expected = "[query, key]" if rank == 2 else "[heads, query, key]"
        raise ValueError(f"{name} must have shape {expected}, received shape {weights.shape}")
    return weights


def _crop(weights, query_tokens, key_tokens):
    """Crops `[..., Q, K]` weights to the labelled tokens (drops trailing padding)."""
    queries = weights.shape[-2] if query_tokens is None else len(query_tokens)
    keys = weights.shape[-1] if key_tokens is None else len(key_tokens)
    if queries > weights.shape[-2] or keys > weights.shape[-1]:
        raise ValueError(
            f"Received {queries} query and {keys} key tokens for weights of shape {weights.shape}; "
            "at most one label per row and column"
        )
    return weights[..., :queries, :keys]


def _draw(ax, weights, query_tokens, key_tokens, title, cmap):
    image = ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    if key_tokens is not None:
        ax.set_xticks(range(len(key_tokens)))
        ax.set_xticklabels(key_tokens, rotation=90, fontsize=8)
    if query_tokens is not None:
        ax.set_yticks(range(len(query_tokens)))
        ax.set_yticklabels(query_tokens, fontsize=8)
    ax.xaxis.tick_top()
    if title:
        ax.set_title(title, fontsize=9, pad=4)
    return image


def plot_attention(weights, query_tokens=None, key_tokens=None, title=None, cmap="Blues", figsize=None):
    """One head's attention weights as a heatmap.

    Rows are queries (the attending positions), columns keys (the attended
    ones): for encoder self-attention both are source tokens, for
    cross-attention rows are target and columns source tokens.

    Args:
        weights: `[Q, K]` weights (each row sums to 1), e.g.
            `scores["cross_attention"][layer][example, head]`.
        query_tokens: optional list of str for the rows; weights are cropped
            to its length (dropping padding).
        key_tokens: optional list of str for the columns; likewise.
        title: optional str.
        cmap: matplotlib colormap name.
        figsize: optional `(width, height)` in inches; by default from the
            number of tokens.

    Returns:
        `matplotlib.figure.Figure`.

    Example:
    >>> fig = plot_attention(np.eye(3), ["a", "b", "c"], ["x", "y", "z"], title="layer 1, head 1")
    """
    from matplotlib.figure import Figure

    weights = _crop(_check_weights(weights, 2, "weights"), query_tokens, key_tokens)
    queries, keys = weights.shape
    figsize = figsize or (max(3.0, 0.3 * keys + 1.5), max(2.5, 0.3 * queries + 1.0))
    figure = Figure(figsize=figsize, layout="constrained")
    ax = figure.add_subplot()
    image = _draw(ax, weights, query_tokens, key_tokens, title, cmap)
    figure.colorbar(image, ax=ax, shrink=0.8)
    return figure


def plot_attention_heads(
    weights,
    query_tokens=None,
    key_tokens=None,
    heads=None,
    columns=4,
    title=None,
    cmap="Blues",
    panel_size=None,
):
    """A grid of heatmaps, one per head of one layer (the paper's Figures 4-5).

    Args:
        weights: `[N, Q, K]` weights of one layer and one example, e.g.
            `scores["encoder_self_attention"][4][0]`.
        query_tokens, key_tokens: optional lists of str (see `plot_attention`).
        heads: optional list of head indices to draw; default all.
        columns: int, panels per row.
        title: optional str for the whole figure.
        cmap: matplotlib colormap name.
        panel_size: optional `(width, height)` of one panel in inches.

    Returns:
        `matplotlib.figure.Figure`.

    Example:
    >>> fig = plot_attention_heads(np.full((8, 3, 3), 1 / 3), ["a", "b", "c"], ["a", "b", "c"])
    >>> len(fig.axes)  # 8 panels
    8
    """
    from matplotlib.figure import Figure

    weights = _crop(_check_weights(weights, 3, "weights"), query_tokens, key_tokens)
    heads = list(range(weights.shape[0])) if heads is None else list(heads)
    for head in heads:
        if not 0 <= head < weights.shape[0]:
            raise ValueError(f"head {head} is outside [0, {weights.shape[0]}) for weights of shape {weights.shape}")
    if not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns={columns!r} must be a positive integer")
    columns = min(columns, len(heads))
    rows = math.ceil(len(heads) / columns)
    queries, keys = weights.shape[1:]
    panel_size = panel_size or (max(2.0, 0.25 * keys + 1.0), max(2.0, 0.25 * queries + 1.0))
    figure = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for panel, ax in enumerate(axes.flat):
        if panel >= len(heads):
            ax.remove()
            continue
        # Labels only on the outer panels, as in the paper's grids.
        _draw(
            ax,
            weights[heads[panel]],
            query_tokens if panel % columns == 0 else None,
            key_tokens if panel < columns else None,
            f"head {heads[panel] + 1}",
            cmap,
        )
        if panel % columns:
            ax.set_yticks([])
        if panel >= columns:
            ax.set_xticks([])
    if title:
        figure.suptitle(title)
    return figure
