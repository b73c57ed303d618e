"""Label-smoothed cross-entropy over target tokens, ignoring padding.

Shape legend: B batch, T target length, V vocabulary size.
"""

import functools

import keras
from keras import ops

from keras_transformer.layers import products

_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum", "none", None)


def _scale_loss_for_distribution(loss):
    """Divides a replica's mean loss by the number of `tf.distribute` replicas.

    Keras' TensorFlow trainer sums gradients across replicas, so every
    `keras.losses.Loss` divides its mean by the replica count; this does the
    same for our own reduction. A no-op on JAX and PyTorch and with one replica.
    """
    if keras.backend.backend() != "tensorflow":
        return loss
    import tensorflow as tf

    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if num_replicas > 1:
        loss = loss / num_replicas
    return loss


def smoothed_token_losses(logits, labels, eps):
    """Per-token label-smoothed cross-entropy `[B, T]` with its gradient written out.

    `-(1 - eps) log p(gold) - eps * mean_v log p(v)` with
    `log p(v) = z_v - logsumexp(z)` is `logsumexp(z) - (1 - eps) z_gold -
    eps * mean_v z_v`: no `log_softmax` is built. The gradient with respect
    to the logits is `softmax(z) - (1 - eps) onehot(gold) - eps / V` times
    the upstream gradient. Written by hand (`keras.ops.custom_gradient`)
    because automatic differentiation of the three terms builds several
    `[B, T, V]` tensors (logsumexp's exp, the mean's broadcast, the gold
    pick's scatter, their sums): the largest tensors of a training step,
    where V is 58k for an OPUS-MT model. Here the backward pass makes one:
    the softmax, recomputed from the logits (not kept from the forward pass,
    which would hold a second `[B, T, V]` tensor between the passes), into
    which the rest is written (in place on PyTorch). Loss + gradient at
    [2000, 58102] on the project's 2-core CPU: TensorFlow 1.86 -> 0.85 s,
    PyTorch 2.56 -> 1.22 s. JAX keeps the automatic gradient, which XLA fuses.

    Args:
        logits: float32 `[B, T, V]`.
        labels: int32 `[B, T]`, each in `[0, V)`.
        eps: float, the smoothing.

    Returns:
        float32 `[B, T]`.
    """
    vocabulary_size = logits.shape[-1]
    backend = keras.backend.backend()

    def forward(z):
        log_normalizer = ops.logsumexp(z, axis=-1)  # [B, T]
        gold = ops.squeeze(ops.take_along_axis(z, ops.expand_dims(labels, -1), axis=-1), -1)  # [B, T]
        losses = log_normalizer - (1.0 - eps) * gold
        if eps > 0.0:
            losses = losses - eps * ops.mean(z, axis=-1)
        return losses, log_normalizer

    if backend == "jax":
        # XLA fuses the automatic gradient of these terms into one pass already;
        # the hand-written one was slower there (0.58 -> 0.88 s at [2000, 58102]).
        return forward(logits)[0]

    @ops.custom_gradient
    def token_losses(z):
        losses, log_normalizer = forward(z)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            upstream = ops.cast(upstream, z.dtype)  # [B, T]
            if backend == "torch":
                probs = (z - log_normalizer.unsqueeze(-1)).exp_()  # the one [B, T, V] tensor
                if eps > 0.0:
                    probs.sub_(eps / vocabulary_size)
                probs.mul_(upstream.unsqueeze(-1))
                return probs.scatter_add_(-1, labels.long().unsqueeze(-1), -(1.0 - eps) * upstream.unsqueeze(-1))
            import tensorflow as tf

            probs = tf.exp(z - log_normalizer[..., None])  # [B, T, V]
            probs = (probs - eps / vocabulary_size) * upstream[..., None]
            # The gold entries, written into that tensor (no one-hot or mask).
            shape = tf.shape(labels, out_type="int64")
            rows = tf.stack(tf.meshgrid(tf.range(shape[0]), tf.range(shape[1]), indexing="ij"), -1)  # [B, T, 2]
            indices = tf.concat([rows, tf.cast(labels, "int64")[..., None]], -1)  # [B, T, 3]
            return tf.tensor_scatter_nd_add(probs, indices, -(1.0 - eps) * upstream)

        return losses, grad

    return token_losses(logits)


# Rows of a chunk of the fused loss: a chunk's logits are about this many floats (64 MB).
FUSED_CHUNK_ELEMENTS = 2**24


def fused_output_losses(hidden, embeddings, bias, labels, weights, mask, eps, chunk_rows=None,
                        embedding_gradient=True):
    """The pre-softmax projection and the label-smoothed loss together, over chunks of rows.

    Equal to `smoothed_token_losses(hidden @ embeddings.T + bias, labels,
    eps)` weighted and summed, without the `[N, V]` logits: the rows are
    taken `chunk_rows` at a time, and each chunk's logits are made, reduced
    to its losses and turned at once into that chunk's share of the three
    gradients (`dz @ embeddings` for the rows, `dz.T @ hidden` for the
    embedding matrix and `sum(dz)` for the bias, with `dz = (softmax(z) -
    (1 - eps) onehot(gold) - eps / V) * weight`). The backward pass then only
    scales them by the upstream gradient of the scalar sum. This is the
    "fused linear cross-entropy" of Liger-Kernel and Cut Cross-Entropy,
    written for this loss: the logits and their gradient, `[N, V]` each
    (0.45 GB apiece at an OPUS-MT vocabulary of 58k and 2,000 tokens), are
    the largest tensors of a training step and never exist here; the
    arithmetic is the same three products as the unfused step.

    Args:
        hidden: `[N, D]` decoder outputs (after any final norm), compute dtype.
        embeddings: `[V, D]` the output projection (the shared embedding
            matrix); the products run in `hidden`'s dtype (a float32
            matrix under mixed precision is cast here, and its gradient
            is float32).
        bias: float32 `[V]` logits bias, or None.
        labels: int32 `[N]`, each in `[0, V)`.
        weights: float32 `[N]`: each token's weight in the sum (0 for
            padding; the sample weight otherwise).
        mask: float32 `[N]`: 1 for the tokens whose accuracy counts.
        eps: float, the label smoothing.
        chunk_rows: int, the most rows per chunk; by default about
            `FUSED_CHUNK_ELEMENTS / V`. The rows are split into equal
            chunks of at most that many.
        embedding_gradient: bool; False skips the `[V, D]` gradient of
            `embeddings` (a frozen matrix, as under LoRA) and gives zeros.

    Returns:
        `(loss_sum, correct, predictions)`: float32 scalar `sum(weights *
        token_losses)` (differentiable with respect to `hidden`,
        `embeddings` and `bias`), float32 scalar `sum(mask * (argmax z ==
        label))` and int32 `[N]` argmax predictions (neither differentiable).
    """
    vocabulary_size = embeddings.shape[0]
    if chunk_rows is None:
        chunk_rows = max(16, FUSED_CHUNK_ELEMENTS // vocabulary_size)
    if keras.backend.backend() == "torch":
        hidden, embeddings, labels, weights, mask = (
            ops.convert_to_tensor(x) for x in (hidden, embeddings, labels, weights, mask))
        bias = None if bias is None else ops.convert_to_tensor(bias)
        return _fused_output_losses_torch().apply(
            hidden, embeddings, bias, labels, weights, mask, eps, chunk_rows, embedding_gradient)
    return _fused_output_losses_graph(hidden, ops.cast(embeddings, hidden.dtype), bias, labels, weights, mask, eps,
                                      chunk_rows, embedding_gradient)


# Under mixed precision (PyTorch), the embedding gradient's chunks are summed in the compute dtype, each
# product accumulating in float32 inside, and this many of them at a time are added to the float32 gradient.
MIXED_GRADIENT_CHUNKS = 4


@functools.cache
def _fused_output_losses_torch():
    """PyTorch: a `torch.autograd.Function` whose forward pass computes the gradients, in place per chunk.

    The chunks' `[C, V]` tensors live in buffers made once per call: a fresh tensor that size per chunk is a
    fresh mapping of memory each time (it is over glibc's mmap threshold), whose page faults cost more than the
    product that fills it (58k x 288 bfloat16, this CPU: 53 ms as a new tensor, 19 ms into a buffer).

    `embeddings` may be float32 under mixed precision: it is cast to `hidden`'s dtype here, once, and its
    gradient comes back in its own dtype, with no `[V, D]` cast recorded for autograd. That gradient, `dz.T @
    hidden` summed over the chunks, is summed in the compute dtype `MIXED_GRADIENT_CHUNKS` chunks at a time
    and then added to a float32 sum: PyTorch's CPU products have no bfloat16 x bfloat16 = float32 form, and
    converting each chunk's `[V, D]` product to float32 cost more than the product (base shape, 2,000 target
    tokens: 16% of the step). Against float64, the relative error is 0.24% at 2,000 rows and 0.26% at 8,000
    (one product rounded once, as `torch.autocast` computes `lm_head`'s gradient: 0.14%; every chunk summed in
    bfloat16: 0.30% and 0.56%).
    """
    import torch

    class FusedOutputLosses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, embeddings, bias, labels, weights, mask, eps, chunk_rows, embedding_gradient):
            rows_total, vocabulary_size = hidden.shape[0], embeddings.shape[0]
            compute, device = hidden.dtype, hidden.device
            mixed = compute != torch.float32
            ctx.embeddings_dtype = embeddings.dtype
            embeddings = embeddings.to(compute)
            labels = labels.long()
            weights, mask = weights.float(), mask.float()
            dh = torch.empty_like(hidden)
            dw = torch.zeros(embeddings.shape if embedding_gradient else (), dtype=torch.float32, device=device)
            db = None if bias is None else torch.zeros(vocabulary_size, dtype=torch.float32, device=device)
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            correct = torch.zeros((), dtype=torch.float32, device=device)
            predictions = torch.empty(rows_total, dtype=torch.int32, device=device)
            # The bias in the dtype its sum is taken in: the product's (float32), or the float32 logits' under mixed.
            bias_compute = None if bias is None else bias.to(torch.float32 if mixed else compute)
            # mean_v z_v = h . mean_v w_v + mean_v b_v: the smoothing term's mean logit without a pass over [C, V].
            mean_row = torch.mean(embeddings, dim=0, dtype=torch.float32) if eps > 0.0 else None  # [D]
            mean_bias = 0.0 if bias_compute is None or eps == 0.0 else bias_compute.float().mean()
            buffer_rows = min(chunk_rows, rows_total)
            logits_buffer = torch.empty((buffer_rows, vocabulary_size), dtype=torch.float32, device=device)
            compute_buffer = (torch.empty((buffer_rows, vocabulary_size), dtype=compute, device=device)
                              if mixed else None)
            partial = (torch.empty(embeddings.shape, dtype=compute, device=device)
                       if mixed and embedding_gradient else None)
            pending = 0  # chunks summed in `partial` and not yet in `dw`
            for start in range(0, rows_total, chunk_rows):
                rows = slice(start, start + chunk_rows)
                hc, yc, wc = hidden[rows], labels[rows], weights[rows]
                z = logits_buffer[: hc.shape[0]]  # [C, V] float32
                if not mixed:
                    if bias_compute is None:
                        torch.mm(hc, embeddings.t(), out=z)
                    else:
                        torch.addmm(bias_compute, hc, embeddings.t(), out=z)
                else:
                    zc = compute_buffer[: hc.shape[0]]
                    torch.mm(hc, embeddings.t(), out=zc)
                    z.copy_(zc)
                    if bias_compute is not None:
                        z += bias_compute
                peak, best = z.max(dim=-1)  # one pass: each row's maximum and the first id holding it
                gold = z.gather(1, yc.unsqueeze(1)).squeeze(1)
                predictions[rows] = best.int()
                correct += (mask[rows] * (best == yc).float()).sum()
                dz = z.sub_(peak.unsqueeze(1)).exp_()  # exp(z - peak), in the logits' memory: the one exp
                total = dz.sum(dim=-1)
                losses = peak + total.log() - (1.0 - eps) * gold
                if eps > 0.0:
                    losses -= eps * (torch.mv(hc.float() if mixed else hc, mean_row) + mean_bias)
                loss_sum += (wc * losses).sum()
                dz.mul_((wc / total).unsqueeze(1))  # softmax(z) * weight
                if eps > 0.0:
                    dz.sub_((eps / vocabulary_size * wc).unsqueeze(1))
                dz.scatter_add_(1, yc.unsqueeze(1), (-(1.0 - eps) * wc).unsqueeze(1))
                if db is not None:
                    db += dz.sum(dim=0)
                if mixed:
                    dz = zc.copy_(dz)
                torch.mm(dz, embeddings, out=dh[rows])
                if not embedding_gradient:
                    continue
                if not mixed:
                    dw.addmm_(dz.t(), hc)
                    continue
                partial.addmm_(dz.t(), hc, beta=1 if pending else 0)
                pending += 1
                if pending == MIXED_GRADIENT_CHUNKS or start + chunk_rows >= rows_total:
                    dw.add_(partial)
                    pending = 0
            ctx.save_for_backward(dh, dw, *(() if db is None else (db,)))
            ctx.mark_non_differentiable(correct, predictions)
            return loss_sum, correct, predictions

        @staticmethod
        def backward(ctx, upstream, *_):
            dh, dw, *db = ctx.saved_tensors
            dw = (dw * upstream).to(ctx.embeddings_dtype) if dw.dim() else None
            return (dh * upstream.to(dh.dtype), dw, (db[0] * upstream) if db else None) + (None,) * 6

    return FusedOutputLosses


def _add_at_gold(values, labels, amounts):
    """`values[r, labels[r]] += amounts[r]` for every row r of a `[C, V]` tensor (no one-hot)."""
    if keras.backend.backend() == "jax":
        rows = ops.arange(values.shape[0])
        return values.at[rows, labels].add(amounts)
    import tensorflow as tf

    rows = tf.range(tf.shape(labels)[0])
    return tf.tensor_scatter_nd_add(values, tf.stack([rows, labels], -1), amounts)


def vocabulary_argmax(z, peak=None):
    """`argmax(z, axis=-1)` as int32 (the first of equal maxima): the predicted ids of logits `[..., V]`.

    The one home of the accuracy metric's and the fused loss's argmax, each
    written for its backend because the generic `keras.ops.argmax` is slow
    on the two compiled ones at a vocabulary's width:

    - TensorFlow: `tf.argmax` itself. Keras' `ops.argmax` first rewrites
      every -0.0 to the smallest negative float (a fix for a flush-to-zero
      quirk of JAX's, jax-ml/jax#24280): five more passes over `[B, T, V]`
      (`Equal`, the sign bit, `LogicalAnd`, `SelectV2`). In the Quick
      start's bfloat16 step on a 2-core CPU (2026-12-07) they took 104 ms of
      op time per step, with the `ArgMax` itself 37 ms: 9% of the step's
      ops. A logit of exactly -0.0 tying a row's maximum of 0.0 is the only
      case where the two differ, and no accuracy depends on it.
    - JAX: the largest of `-j` over the columns j where `z` equals its
      row's maximum (`peak = max(z, axis=-1, keepdims=True)`, computed here
      when not given): an elementwise pass and a max-reduction. XLA's CPU
      backend compiles `argmax` (a reduction over value-index pairs) to a
      scalar loop: on a `[1944, 8001]` chunk of the `small` fine-tuning step
      it took 85 ms against 16 ms this way (2-core CPU, 2026-12-06). A row
      with a NaN (whose maximum is NaN) gives the last id rather than the
      NaN's; its loss is NaN either way.
    - PyTorch: `torch.argmax` (Keras' `ops.argmax`).
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.argmax(z, axis=-1, output_type="int32")
    if backend != "jax":
        return ops.cast(ops.argmax(z, axis=-1), "int32")
    import jax.numpy as jnp

    if peak is None:
        peak = jnp.max(z, axis=-1, keepdims=True)
    vocabulary_size = z.shape[-1]
    negated_ids = -jnp.arange(vocabulary_size, dtype="float32")  # exact below 2**24 ids
    first = -jnp.max(jnp.where(z == peak, negated_ids, -float(vocabulary_size)), axis=-1)
    return jnp.minimum(first, vocabulary_size - 1).astype("int32")


def _fused_output_losses_graph(hidden, embeddings, bias, labels, weights, mask, eps, chunk_rows, embedding_gradient):
    """TensorFlow and JAX: one `while_loop` over the chunks, in a custom gradient."""
    vocabulary_size, width = embeddings.shape
    count = ops.shape(hidden)[0]  # an int, or a scalar tensor where TensorFlow traced an unknown row count
    chunks = (count + chunk_rows - 1) // chunk_rows
    # Equal chunks of at most `chunk_rows` rows, so that the padding is under one row per chunk: one
    # chunk of `chunk_rows` would pad a small batch to 2^24 / V rows (838,860 rows of a 20-entry
    # vocabulary: a tiny model's step ran 20x slower on JAX).
    if isinstance(count, int):
        chunk_rows = (count + chunks - 1) // chunks if chunks else chunk_rows
    else:
        chunk_rows = ops.maximum((count + chunks - 1) // ops.maximum(chunks, 1), 1)
    padding = chunks * chunk_rows - count
    # Padded rows weigh 0, so they add nothing to the sums or the gradients.
    labels = ops.pad(ops.cast(labels, "int32"), [[0, padding]])
    weights = ops.pad(ops.cast(weights, "float32"), [[0, padding]])
    mask = ops.pad(ops.cast(mask, "float32"), [[0, padding]])

    # JAX's CPU backend: the products in `layers.products`' fast forms, the embedding's gradient summed as
    # [D, V] (the narrower operand transposed) and transposed once after the loop.
    fast = products.in_fast_forms(hidden, embeddings)

    def chunk_terms(h, w, b, start, mean_row, mean_bias):
        """One chunk: loss sum, correct count, predictions, and its gradients' terms."""
        hc = ops.slice(h, [start, 0], [chunk_rows, width])  # [C, D]
        yc = ops.slice(labels, [start], [chunk_rows])
        wc = ops.slice(weights, [start], [chunk_rows])
        mc = ops.slice(mask, [start], [chunk_rows])
        z = products.nt(hc, w, "float32")  # [C, V]
        if b is not None:
            z = z + b
        peak = ops.max(z, axis=-1, keepdims=True)  # [C, 1]
        shifted = ops.exp(z - peak)  # [C, V], the one exp: the softmax below is it over its row sum
        total = ops.sum(shifted, axis=-1)  # [C]
        log_normalizer = ops.squeeze(peak, -1) + ops.log(total)
        gold = ops.squeeze(ops.take_along_axis(z, ops.expand_dims(yc, -1), axis=-1), -1)
        losses = log_normalizer - (1.0 - eps) * gold
        if eps > 0.0:
            # mean(z) over the vocabulary as a [C, D] x [D] product, not a pass over [C, V].
            losses = losses - eps * (ops.matmul(ops.cast(hc, "float32"), mean_row) + mean_bias)
        predictions = vocabulary_argmax(z, peak)
        correct = ops.sum(mc * ops.cast(ops.equal(predictions, yc), "float32"))
        dz = shifted * ops.expand_dims(wc / total, -1)  # softmax(z) * weight
        if eps > 0.0:
            dz = dz - ops.expand_dims(eps / vocabulary_size * wc, -1)
        dz = _add_at_gold(dz, yc, -(1.0 - eps) * wc)  # [C, V]
        dz_compute = ops.cast(dz, h.dtype)
        dw = 0.0
        if embedding_gradient:
            dw = products.tn(hc, dz_compute, "float32") if fast else products.tn(dz_compute, hc, "float32")
        return (ops.sum(wc * losses), correct, predictions, products.nn(dz_compute, w, h.dtype), dw,
                products.column_sums(dz, "float32") if b is not None else 0.0)

    def forward(h, w, b):
        h = ops.pad(h, [[0, padding], [0, 0]])
        # mean_v z_v = h . mean_v w_v + mean_v b_v: the smoothing term's mean logit from a [D] vector.
        mean_row = ops.mean(ops.cast(w, "float32"), axis=0) if eps > 0.0 else None  # [D]
        mean_bias = ops.mean(b) if eps > 0.0 and b is not None else 0.0

        def body(i, loss_sum, correct, predictions, dh, dw, db):
            start = i * chunk_rows
            terms = chunk_terms(h, w, b, start, mean_row, mean_bias)
            predictions = ops.slice_update(predictions, [start], terms[2])
            dh = ops.slice_update(dh, [start, 0], terms[3])
            return (i + 1, loss_sum + terms[0], correct + terms[1], predictions, dh, dw + terms[4],
                    db + terms[5])

        initial = (
            ops.convert_to_tensor(0, "int32"), ops.zeros((), "float32"), ops.zeros((), "float32"),
            ops.zeros((chunks * chunk_rows,), "int32"), ops.zeros_like(h),
            ops.zeros(((width, vocabulary_size) if fast else (vocabulary_size, width)) if embedding_gradient else (),
                      "float32"),
            ops.zeros((vocabulary_size,) if b is not None else (), "float32"),
        )
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            # One chunk at a time: with `tf.while_loop`'s default of 10 iterations in flight (Keras' `while_loop`),
            # the next chunks' [C, V] logits were made while one was reduced.
            outputs = tf.while_loop(lambda i, *_: i < chunks, lambda *state: tuple(body(*state)), initial,
                                    parallel_iterations=1)
        else:
            outputs = ops.while_loop(lambda i, *_: i < chunks, body, initial)
        _, loss_sum, correct, predictions, dh, dw, db = outputs
        if fast and embedding_gradient:
            dw = ops.transpose(dw)
        return loss_sum, correct, predictions[:count], dh[:count], dw, db

    def embedding_grad(dw, upstream, w):
        return ops.cast(dw * upstream, w.dtype) if embedding_gradient else ops.zeros_like(w)

    if bias is None:
        @ops.custom_gradient
        def fused(h, w):
            loss_sum, correct, predictions, dh, dw, _ = forward(h, w, None)

            def grad(*args, upstream=None):
                upstream = args[0] if upstream is None else upstream
                upstream = upstream[0] if isinstance(upstream, (tuple, list)) else upstream
                return dh * ops.cast(upstream, dh.dtype), embedding_grad(dw, upstream, w)

            return (loss_sum, ops.stop_gradient(correct), ops.stop_gradient(predictions)), grad

        return fused(hidden, embeddings)

    @ops.custom_gradient
    def fused_with_bias(h, w, b):
        loss_sum, correct, predictions, dh, dw, db = forward(h, w, b)

        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            upstream = upstream[0] if isinstance(upstream, (tuple, list)) else upstream
            return dh * ops.cast(upstream, dh.dtype), embedding_grad(dw, upstream, w), db * upstream

        return (loss_sum, ops.stop_gradient(correct), ops.stop_gradient(predictions)), grad

    return fused_with_bias(hidden, embeddings, ops.cast(bias, "float32"))


@keras.saving.register_keras_serializable(package="keras_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Label-smoothed cross-entropy averaged over non-padding target tokens.

    The paper trains with label smoothing of value `eps = 0.1` (Section 5.4).
    Keras 3's `SparseCategoricalCrossentropy` has no label smoothing and
    `CategoricalCrossentropy` needs a one-hot `[B, T, V]` target, so this loss
    takes integer targets and never builds a one-hot tensor. Per token:

    ```
    logp = log_softmax(logits)                               # [B, T, V]
    loss = -(1 - eps) * logp[gold] - eps * mean_v(logp[v])   # [B, T]
    ```

    i.e. the smoothed target puts `1 - eps + eps / V` on the gold token and
    `eps / V` on every token, the gold one included. This is exactly
    `keras.losses.CategoricalCrossentropy(label_smoothing=eps)` on the one-hot
    target, `torch.nn.CrossEntropyLoss(label_smoothing=eps)` and the original
    fairseq/tensor2tensor formulation (current fairseq spreads `eps / (V - 1)`
    over the non-gold tokens only; the difference is O(eps / V)).

    Reduction. Targets equal to `pad_id` get loss 0 and do not count. With the
    default `reduction="sum_over_batch_size"` the value is the sum of token
    losses divided by the number of non-padding target tokens in the batch:
    the per-token loss the paper reports, independent of how much padding a
    batch carries. `model.compile(loss=LabelSmoothedCrossEntropy())` followed
    by `model.fit` therefore optimizes this token mean on every backend. To
    get it exactly (Keras' base class would divide by `B * T`), this class
    overrides `__call__` and reduces itself:

    - `"sum_over_batch_size"` / `"mean"`: `sum(w * loss) / num_tokens`
      (Keras' convention for masked losses: sample weights scale tokens, the
      divisor counts non-padding tokens);
    - `"mean_with_sample_weight"`: `sum(w * loss) / sum(w * non_pad)`;
    - `"sum"`: `sum(w * loss)`;
    - `None` / `"none"`: per-token losses `[B, T]`, 0 at padding.

    `sample_weight` may be `[B]`, `[B, 1]` or `[B, T]`. Under a
    `tf.distribute` strategy each replica averages over its own tokens (as any
    Keras mean loss does), so the step optimizes the mean of the replicas'
    token means; with token-bucketed batches these are nearly equal. A Keras
    mask carried by `y_pred` is not used: the targets define the mask.

    Logits are cast to float32 before the softmax, so mixed-precision
    (`float16`/`bfloat16`) logits are accepted and the loss is float32.

    Args:
        label_smoothing: float in `[0, 1)`. The smoothing `eps`; `0` gives
            plain sparse categorical cross-entropy. Defaults to `0.1`.
        pad_id: int or `None`. Target id that is ignored; `None` counts every
            target. Defaults to `0`.
        from_logits: bool. Must be `True`: `y_pred` holds logits (the model's
            output), never probabilities. Defaults to `True`.
        reduction: str or `None`. See above. Defaults to
            `"sum_over_batch_size"`.
        name: str. Name of the loss. Defaults to
            `"label_smoothed_cross_entropy"`.

    Example:

    ```python
    loss = keras_transformer.LabelSmoothedCrossEntropy(label_smoothing=0.1)
    y_true = np.array([[5, 7, 3, 0]])                 # [B, T], 0 = padding
    logits = np.random.normal(size=(1, 4, 16))        # [B, T, V]
    value = loss(y_true, logits)                      # mean over 3 tokens
    model.compile(optimizer="adam", loss=loss)
    ```

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), Sec. 5.4.
        - [Szegedy et al., 2016](https://arxiv.org/abs/1512.00567), Sec. 7.
    """

    def __init__(
        self,
        label_smoothing=0.1,
        pad_id=0,
        from_logits=True,
        reduction="sum_over_batch_size",
        name="label_smoothed_cross_entropy",
    ):
        if not isinstance(label_smoothing, (int, float)) or not (
            0.0 <= label_smoothing < 1.0
        ):
            raise ValueError(
                f"label_smoothing={label_smoothing!r} must be a float in [0, 1)"
            )
        if pad_id is not None and (
            isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0
        ):
            raise ValueError(f"pad_id={pad_id!r} must be a non-negative int or None")
        if from_logits is not True:
            raise ValueError(
                f"from_logits={from_logits!r} is not supported: "
                "LabelSmoothedCrossEntropy takes logits only (from_logits=True)"
            )
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction={reduction!r} must be one of {_REDUCTIONS}")
        # Always float32: mixed-precision logits are upcast before the softmax.
        super().__init__(name=name, reduction=reduction, dtype="float32")
        self.label_smoothing = float(label_smoothing)
        self.pad_id = pad_id
        self.from_logits = from_logits

    def call(self, y_true, y_pred):
        """Per-token losses.

        Args:
            y_true: int tensor `[B, T]` (or `[B, T, 1]`) of target ids.
            y_pred: float tensor `[B, T, V]` of logits.

        Returns:
            float32 tensor `[B, T]`; 0 where `y_true == pad_id`.
        """
        y_true = ops.convert_to_tensor(y_true)
        y_pred = ops.cast(y_pred, "float32")
        if len(y_true.shape) == len(y_pred.shape):
            y_true = ops.squeeze(y_true, axis=-1)  # [B, T, 1] -> [B, T]
        y_true = ops.cast(y_true, "int32")

        losses = smoothed_token_losses(y_pred, y_true, self.label_smoothing)  # [B, T]
        return ops.where(self._token_mask(y_true), losses, 0.0)

    def _token_mask(self, y_true):
        """Boolean `[B, T]`: which targets count."""
        if self.pad_id is None:
            return ops.ones_like(y_true, dtype="bool")
        return ops.not_equal(y_true, self.pad_id)

    def __call__(self, y_true, y_pred, sample_weight=None):
        with keras.name_scope(self.name):
            y_true = ops.convert_to_tensor(y_true)
            y_pred = ops.convert_to_tensor(y_pred)
            if len(y_true.shape) == len(y_pred.shape):
                y_true = ops.squeeze(y_true, axis=-1)  # [B, T, 1] -> [B, T]
            losses = self.call(y_true, y_pred)  # [B, T], 0 at padding
            mask, weights = self.token_weights(y_true, sample_weight)  # [B, T]
            num_tokens = ops.sum(mask)
            if sample_weight is not None:
                losses = losses * weights
            if self.reduction in (None, "none"):
                return losses
            return self.reduce_total(ops.sum(losses), num_tokens, ops.sum(weights))

    def reduce_total(self, total, num_tokens, weight_sum):
        """The reduced loss from the weighted sum of token losses (any reduction but `"none"`).

        Args:
            total: float32 scalar, `sum(sample_weight * token_losses)`.
            num_tokens: float32 scalar, the number of non-padding targets.
            weight_sum: float32 scalar, `sum(sample_weight * non_pad)`.
        """
        if self.reduction == "sum":
            return total
        if self.reduction == "mean_with_sample_weight":
            loss = ops.divide_no_nan(total, weight_sum)
        else:  # "sum_over_batch_size", "mean": the token mean.
            loss = ops.divide_no_nan(total, num_tokens)
        return _scale_loss_for_distribution(loss)

    def token_weights(self, y_true, sample_weight=None):
        """`(mask, weights)`, float32 `[B, T]`: which targets count, and each one's weight in the sum."""
        mask = ops.cast(self._token_mask(y_true), "float32")
        if sample_weight is None:
            return mask, mask
        sample_weight = ops.cast(sample_weight, "float32")
        if len(sample_weight.shape) == 1:
            sample_weight = ops.expand_dims(sample_weight, -1)  # [B, 1]
        return mask, mask * sample_weight

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "label_smoothing": self.label_smoothing,
                "pad_id": self.pad_id,
                "from_logits": self.from_logits,
            }
        )
        return config
