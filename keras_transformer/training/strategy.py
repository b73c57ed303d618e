"""Where and how a model trains: the distribution strategy, mixed precision, and `compile_model`.

Distribution (`strategy=`):
- "none": the default device.
- "mirrored" (TensorFlow backend): `tf.distribute.MirroredStrategy` over all
  local GPUs (or logical CPU devices). XLA is turned off under it: with
  `jit_compile=True`, TF 2.21 / Keras 3.15 fail with "Trying to access
  resource ... located in device CPU:1 from device CPU:0" (a known XLA
  limitation with mirrored variables), while `jit_compile=False` works.
- "multi_worker" (JAX backend): `keras.distribution.DataParallel` over
  `jax.distributed` processes. Keras 3.15's `model.fit` does not work under
  TensorFlow's `MultiWorkerMirroredStrategy` (keras-team/keras#20585:
  "Attempt to convert a value (PerReplica ...) to a Tensor"), so several
  machines train on JAX.
- "auto": "mirrored" on TensorFlow with more than one GPU, else "none".
"""

import contextlib
import logging

import keras
import numpy as np

from keras_transformer.layers.products import jax_cpu_with_amx
from keras_transformer.losses import LabelSmoothedCrossEntropy, vocabulary_argmax
from keras_transformer.optimizers import InPlaceAdam
from keras_transformer.schedules import WarmupSchedule
from keras_transformer.utils import cpu_flags

logger = logging.getLogger("keras_transformer.training")  # one logger for the whole package

STRATEGIES = ("auto", "mirrored", "multi_worker", "none")
MIXED_PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")


def native_bfloat16():
    """`(bool, why)`: whether this machine multiplies bfloat16 matrices natively, and what says so.

    The accelerator Keras' backend trains on (a CUDA GPU of compute
    capability 8.0 or later, a TPU), else the CPU's own instructions
    (`avx512_bf16` or `amx_bf16` in Linux's /proc/cpuinfo) on TensorFlow
    and PyTorch (oneDNN), and `amx_bf16` on JAX's CPU backend (XLA, through
    `layers.products`). Elsewhere bfloat16 is emulated or no faster than
    float32.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.is_bf16_supported(), f"GPU {torch.cuda.get_device_name()}"
    elif backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform == "tpu":
            return True, "TPU"
        if device.platform == "gpu":
            capability = getattr(device, "compute_capability", "0.0")
            return float(capability) >= 8.0, f"GPU compute capability {capability}"
        if jax_cpu_with_amx():
            return True, "JAX's CPU backend on a CPU with amx_bf16 (the products of keras_transformer.layers.products)"
        # Without AMX, XLA's CPU backend multiplies bfloat16 no faster than float32 (Keras' own bfloat16 products
        # ran at 0.85x float32's rate even with AMX: `layers.products` says why).
        return False, "JAX's CPU backend without amx_bf16 multiplies bfloat16 no faster than float32"
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0))
            return tuple(capability) >= (8, 0), f"GPU compute capability {capability}"
    flags = cpu_flags()
    found = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]
    return bool(found), f"CPU with {found[0]}" if found else "CPU without avx512_bf16 or amx_bf16"


def resolve_mixed_precision(mixed_precision):
    """The Keras policy a run uses for `mixed_precision` (`MIXED_PRECISIONS` or None), None for float32.

    "auto" is "mixed_bfloat16" where `native_bfloat16()` says so, else
    float32; the choice is logged.
    """
    if mixed_precision == "auto":
        native, why = native_bfloat16()
        resolved = "mixed_bfloat16" if native else None
        logger.info("mixed_precision=auto: %s (%s)", resolved or "float32", why)
        return resolved
    return None if mixed_precision == "float32" else mixed_precision


def resolve_strategy(strategy="auto"):
    """Returns `(name, scope)`: the strategy actually used and a context manager.

    Build and compile the model inside the scope.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    backend = keras.backend.backend()
    if strategy == "auto":
        strategy = "none"
        if backend == "tensorflow":
            import tensorflow as tf

            if len(tf.config.list_logical_devices("GPU")) > 1:
                strategy = "mirrored"
    if strategy == "none":
        return "none", contextlib.nullcontext()
    if strategy == "mirrored":
        if backend != "tensorflow":
            raise ValueError(f"strategy='mirrored' needs the TensorFlow backend, the backend is {backend!r}")
        import tensorflow as tf

        mirrored = tf.distribute.MirroredStrategy()
        logger.info("MirroredStrategy over %d replicas", mirrored.num_replicas_in_sync)
        return "mirrored", mirrored.scope()
    # multi_worker
    if backend != "jax":
        raise ValueError(
            "strategy='multi_worker' runs on the JAX backend (Keras 3's model.fit does not "
            "work under TensorFlow's MultiWorkerMirroredStrategy, keras-team/keras#20585); "
            f"the backend is {backend!r}. Set KERAS_BACKEND=jax."
        )
    import jax

    if jax.process_count() == 1:
        logger.warning("multi_worker: jax.distributed is not initialised; running as one process")
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    logger.info("DataParallel over %d devices in %d processes", len(devices), jax.process_count())
    return "multi_worker", contextlib.nullcontext()


def masked_accuracy(y_true, y_pred):
    """Token accuracy over non-padding targets (pad id 0) of one batch.

    `y_pred`: logits `[B, T, V]`, or the predicted ids `[B, T]` (what a fused
    training step hands its metrics, `fused_training`).
    """
    ops = keras.ops
    mask = ops.cast(ops.not_equal(y_true, 0), "float32")
    predicted = y_pred if len(y_pred.shape) == len(y_true.shape) else vocabulary_argmax(y_pred)
    correct = ops.cast(ops.equal(ops.cast(predicted, y_true.dtype), y_true), "float32")
    return ops.sum(correct * mask) / ops.maximum(ops.sum(mask), 1.0)


def compile_model(
    model,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    label_smoothing=0.1,
    gradient_accumulation_steps=None,
    jit_compile="auto",
    strategy_name="none",
):
    """Adam(0.9, 0.98, 1e-9) with the paper's warmup schedule and label-smoothed loss.

    Args:
        model: a `TransformerModel`.
        warmup_steps: int, the schedule's warmup (4000 in the paper).
        learning_rate_scale: float, multiplies the paper's learning rate.
        label_smoothing: float, epsilon_ls (0.1 in the paper).
        gradient_accumulation_steps: optional int k: one update every k
            batches, from their mean gradient (the paper's ~25k-token batches
            on one device). The schedule counts updates (`WarmupSchedule`
            is told k); 1 or None: no accumulation.
        jit_compile: "auto" (Keras' choice, but off under MirroredStrategy,
            see the module docstring, and off on CPU TensorFlow, where it
            was slower here), or a bool.
        strategy_name: the name returned by `resolve_strategy`.
    """
    accumulation = accumulation_steps(gradient_accumulation_steps)
    if jit_compile == "auto":
        if strategy_name == "mirrored":
            jit_compile = False
        elif keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            jit_compile = bool(tf.config.list_logical_devices("GPU"))
    # Keras' Adam, updating in place (`InPlaceAdam`: the same formula and variables).
    optimizer = InPlaceAdam(
        learning_rate=WarmupSchedule(
            model.hidden_dim, warmup_steps=warmup_steps, scale=learning_rate_scale,
            gradient_accumulation_steps=accumulation,
        ),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9,
        gradient_accumulation_steps=accumulation,
    )
    model.compile(
        optimizer=optimizer,
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing),
        metrics=[masked_accuracy],
        jit_compile=jit_compile,
    )
    return model


def accumulation_steps(gradient_accumulation_steps):
    """Micro-batches per update as Keras' optimizer takes it: None for 1 (Keras refuses 1)."""
    k = gradient_accumulation_steps
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
        raise ValueError(f"gradient_accumulation_steps={k!r} must be None or an integer >= 1")
    return int(k) if k and k > 1 else None
