"""Training steps that never build the `[B, T, V]` logits: the output projection fused with the loss.

In a step of `model.fit` / `train_on_batch`, Keras calls the model, then
`compute_loss(y, y_pred)`, then `compute_metrics(y, y_pred)`. With the
paper's loss (`LabelSmoothedCrossEntropy`) and metric (`masked_accuracy`),
`TransformerModel` turns that step into:

1. the model returns the decoder's last hidden states `[B, T, D]` instead of
   logits (only inside the step: every other call gives logits);
2. `compute_loss` projects them onto the shared embedding matrix and takes the
   loss chunk by chunk (`losses.fused_output_losses`), with the gradients of
   the projection written out, and keeps the argmax predictions `[B, T]`;
3. `compute_metrics` receives those predictions, which `masked_accuracy` reads
   as they are.

The logits and their gradient, the two largest tensors of a step (0.45 GB
each at an OPUS-MT vocabulary of 58k and 2,000 target tokens), are never
made; the loss, its gradients and the accuracy are the same.

A step takes Keras' own path (`why_not_fused` says why) when the model was
compiled with another loss or metric, a reduction of `"none"`, a quantized or
soft-capped embedding, under a `keras.distribution` (the chunks would cut
across its sharded batch), or when `model.fuse_output_loss` is False. Its
default, "auto", fuses wherever it can, as True does: the fused step was faster
on every backend and 0.7-1.0 GB smaller at the OPUS-MT base shape on PyTorch
and JAX; on TensorFlow, once its chunk loop ran one chunk at a time, 3-17% faster
at `small` and base (2026-12-07, benchmarks/README.md), its peak within 0.1 GB of
Keras' path at 2,000 tokens and 0.3-0.4 GB below it at 8,000.
"""

import contextlib
import contextvars

import keras
from keras import ops

from keras_transformer.losses import LabelSmoothedCrossEntropy, fused_output_losses


class _Step:
    """One training step being traced or run: the model, and the predictions its loss made."""

    def __init__(self, model):
        self.model = model
        self.predictions = None


# The step of the model whose `train_step` is being traced (or, on PyTorch, run) in this thread.
_STEP = contextvars.ContextVar("keras_transformer_fused_step", default=None)


def active_step(model):
    """The fused step `model` is in, or None."""
    step = _STEP.get()
    return step if step is not None and step.model is model else None


def _metrics_read_predictions(metrics):
    from keras_transformer.training import masked_accuracy

    if not metrics:
        return True
    if isinstance(metrics, dict):
        metrics = list(metrics.values())
    return all(metric is masked_accuracy for metric in metrics)


def why_not_fused(model):
    """Why `model`'s training step does not fuse the projection and the loss, or None when it does."""
    fuse = getattr(model, "fuse_output_loss", "auto")
    if fuse is False:
        return "fuse_output_loss is False"
    if not isinstance(getattr(model, "loss", None), LabelSmoothedCrossEntropy):
        return "the compiled loss is not LabelSmoothedCrossEntropy"
    if model.loss.reduction in (None, "none"):
        return "the loss's reduction is 'none'"
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is not None and not (
        _metrics_read_predictions(compiled._user_metrics) and _metrics_read_predictions(compiled._user_weighted_metrics)
    ):
        return "a compiled metric other than masked_accuracy needs the logits"
    embedding = model.token_embedding
    if any(x is not None for x in (embedding.quantization_mode, embedding.logit_soft_cap, embedding.reverse_dtype)):
        return "the embedding is quantized or has its own output product"
    if keras.distribution.distribution() is not None:
        return "a keras.distribution is set"
    return None


@contextlib.contextmanager
def step_scope(model):
    """Wraps Keras' `train_step`: the step inside is fused when `why_not_fused(model)` is None."""
    if why_not_fused(model) is not None:
        yield
        return
    token = _STEP.set(_Step(model))
    try:
        yield
    finally:
        _STEP.reset(token)


def compute_loss(model, step, y, hidden, sample_weight):
    """The compiled `LabelSmoothedCrossEntropy` of the step, from the hidden states; keeps the predictions.

    Args:
        model: the `TransformerModel`.
        step: its `active_step`.
        y: int `[B, T]` (or `[B, T, 1]`) target ids.
        hidden: `[B, T, D]`, what the model returned in the step.
        sample_weight: None, `[B]`, `[B, 1]` or `[B, T]`.
    """
    loss = model.loss
    labels = ops.convert_to_tensor(y)
    if len(labels.shape) == 3:
        labels = ops.squeeze(labels, axis=-1)
    labels = ops.cast(labels, "int32")  # [B, T]
    mask, weights = loss.token_weights(labels, sample_weight)
    weights = ops.broadcast_to(weights, ops.shape(labels))
    embeddings = model.token_embedding.embeddings
    with keras.name_scope(loss.name):
        total, _, predictions = fused_output_losses(
            ops.reshape(hidden, (-1, model.hidden_dim)),
            embeddings,
            model.logits_bias_weight if model.logits_bias else None,
            ops.reshape(labels, (-1,)),
            ops.reshape(weights, (-1,)),
            ops.reshape(mask, (-1,)),
            loss.label_smoothing,
            embedding_gradient=embeddings.trainable,
        )
        value = loss.reduce_total(total, ops.sum(mask), ops.sum(weights))
    step.predictions = ops.reshape(predictions, ops.shape(labels))
    losses = [value] + [model._aggregate_additional_loss(extra) for extra in model.losses]
    return losses[0] if len(losses) == 1 else ops.sum(losses)
