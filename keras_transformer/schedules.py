"""The paper's learning-rate schedule: linear warmup, then inverse square root.

The formula lives once, in `warmup_learning_rate`. `WarmupSchedule` hands it
to a Keras optimizer as a `LearningRateSchedule`; `WarmupScheduleCallback`
applies the same function from a callback, for optimizers built with a float
learning rate, and logs the rate as `lr`.
"""

import logging

import keras
from keras import ops

logger = logging.getLogger(__name__)


def _validate(hidden_dim, warmup_steps, scale, gradient_accumulation_steps=None):
    if isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim <= 0:
        raise ValueError(f"hidden_dim={hidden_dim!r} must be a positive int")
    if (
        isinstance(warmup_steps, bool)
        or not isinstance(warmup_steps, int)
        or warmup_steps <= 0
    ):
        raise ValueError(f"warmup_steps={warmup_steps!r} must be a positive int")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"scale={scale!r} must be a positive number")
    k = gradient_accumulation_steps
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"gradient_accumulation_steps={k!r} must be None or a positive int")


def warmup_learning_rate(step, hidden_dim, warmup_steps=4000, scale=1.0):
    """The paper's learning rate at a 1-based training step.

    `lrate = scale * hidden_dim^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`
    (Vaswani et al., 2017, Eq. 3 with an extra `scale`): it grows linearly for
    `warmup_steps` steps, peaks at `step == warmup_steps` with
    `scale * (hidden_dim * warmup_steps)^-0.5`, then decays as `step^-0.5`.

    Written with `keras.ops`, so `step` may be a Python number, a NumPy array
    or a backend tensor (also inside a compiled graph); the result is a float32
    backend tensor of the shape of `step` (use `float(...)` or
    `keras.ops.convert_to_numpy` for a NumPy value).

    Args:
        step: int, array or tensor. The 1-based step: the first update is
            step 1. Steps below 1 are clamped to 1.
        hidden_dim: int. The model width (the paper's `d_model`).
        warmup_steps: int. Steps of linear warmup. Defaults to `4000`.
        scale: float. Multiplier on the paper's rate. Defaults to `1.0`.

    Returns:
        float32 tensor: the learning rate.

    Example:

    ```python
    warmup_learning_rate(4000, hidden_dim=512)   # peak, about 7.0e-4
    warmup_learning_rate(np.arange(1, 10), hidden_dim=512)
    ```
    """
    step = ops.maximum(ops.cast(step, "float32"), 1.0)
    factor = scale * float(hidden_dim) ** -0.5
    return factor * ops.minimum(ops.rsqrt(step), step * float(warmup_steps) ** -1.5)


@keras.saving.register_keras_serializable(package="keras_transformer")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The paper's warmup schedule as a Keras `LearningRateSchedule`.

    `lrate = scale * hidden_dim^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`,
    computed by `warmup_learning_rate`, where `step` counts optimizer
    updates from 1 (the paper's "training steps").

    Keras calls a schedule with the optimizer's 0-based counter of the
    batches it has been given (`optimizer._iterations`): without gradient
    accumulation that is the number of updates already applied, so the
    formula is evaluated at `step = counter + 1`. With
    `gradient_accumulation_steps=k` the counter advances once per
    micro-batch (Keras 3.15, `BaseOptimizer._get_current_learning_rate`), so
    the schedule must be told `k` to count updates: `step = counter // k + 1`.
    Without it, update u would get the rate of step u*k: k times too high in
    warmup, warmup over after `warmup_steps / k` updates. Pass the same `k` as
    the optimizer's `gradient_accumulation_steps` (`compile_model` does).
    The rate follows the optimizer's counter, so it resumes at the right step
    when a checkpoint restores the optimizer.

    Args:
        hidden_dim: int. The model width (`d_model`; 512 for "base").
        warmup_steps: int. Updates of linear warmup. Defaults to `4000`.
        scale: float. Multiplier on the paper's rate. Defaults to `1.0`.
        gradient_accumulation_steps: optional int, the optimizer's
            `gradient_accumulation_steps` (micro-batches per update).
            Defaults to `None` (one batch per update).

    Example:

    ```python
    schedule = keras_transformer.WarmupSchedule(hidden_dim=512)
    optimizer = keras.optimizers.Adam(
        learning_rate=schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9
    )
    # Four micro-batches per update: tell the schedule too.
    optimizer = keras.optimizers.Adam(
        learning_rate=keras_transformer.WarmupSchedule(512, gradient_accumulation_steps=4),
        beta_1=0.9, beta_2=0.98, epsilon=1e-9, gradient_accumulation_steps=4,
    )
    ```

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), Sec. 5.3.
    """

    def __init__(self, hidden_dim, warmup_steps=4000, scale=1.0, gradient_accumulation_steps=None):
        _validate(hidden_dim, warmup_steps, scale, gradient_accumulation_steps)
        self.hidden_dim = hidden_dim
        self.warmup_steps = warmup_steps
        self.scale = float(scale)
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def __call__(self, step):
        # `step` is Keras' 0-based count of batches (micro-batches under
        # accumulation); the paper's step is the 1-based count of updates.
        step = ops.cast(step, "int32")
        if self.gradient_accumulation_steps:
            step = ops.floor_divide(step, self.gradient_accumulation_steps)
        return warmup_learning_rate(step + 1, self.hidden_dim, self.warmup_steps, self.scale)

    def get_config(self):
        return {
            "hidden_dim": self.hidden_dim,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }


class WarmupScheduleCallback(keras.callbacks.Callback):
    """Sets the paper's warmup learning rate before every training batch.

    The same formula as `WarmupSchedule` (`warmup_learning_rate`), for an
    optimizer built with a float learning rate (a schedule-built optimizer's
    rate cannot be set; Keras raises a `TypeError`). Before each batch it reads
    `model.optimizer.iterations` (updates already applied) and sets
    `model.optimizer.learning_rate` to the rate of step `iterations + 1`, so
    training resumes at the right rate after a checkpoint restores the
    optimizer. It writes the rate used as `lr` into the batch logs and the
    epoch logs, so `lr` appears in `History`, TensorBoard and the progress bar.

    On JAX, Keras trains on a copy of the variables; the callback syncs them
    back (`model.jax_state_sync()`) before each batch so that `iterations` is
    current and the new rate reaches the next step. Passing `WarmupSchedule`
    to the optimizer avoids that per-batch sync. With `steps_per_execution >
    1`, batch hooks run once per execution and the rate changes only then.

    Args:
        hidden_dim: int. The model width (`d_model`).
        warmup_steps: int. Steps of linear warmup. Defaults to `4000`.
        scale: float. Multiplier on the paper's rate. Defaults to `1.0`.

    Example:

    ```python
    model.compile(optimizer=keras.optimizers.Adam(beta_2=0.98), loss=...)
    history = model.fit(
        data, callbacks=[keras_transformer.WarmupScheduleCallback(512)]
    )
    history.history["lr"]
    ```

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), Sec. 5.3.
    """

    def __init__(self, hidden_dim, warmup_steps=4000, scale=1.0):
        super().__init__()
        _validate(hidden_dim, warmup_steps, scale)
        self.hidden_dim = hidden_dim
        self.warmup_steps = warmup_steps
        self.scale = float(scale)
        self.lr = None  # The rate set for the latest batch.

    def _iterations(self):
        if hasattr(self.model, "jax_state_sync"):
            # JAX: pull the training state back into the variables (a no-op
            # before the first step) so that `iterations` is current, and so
            # that the trainer re-reads the learning rate we set below.
            self.model.jax_state_sync()
        return int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_begin(self, batch, logs=None):
        step = self._iterations() + 1  # 0-based iterations -> 1-based step
        self.lr = float(
            ops.convert_to_numpy(
                warmup_learning_rate(step, self.hidden_dim, self.warmup_steps, self.scale)
            )
        )
        self.model.optimizer.learning_rate = self.lr
        if step == 1 or step == self.warmup_steps:
            logger.info("step %d: learning rate %.3g", step, self.lr)

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None and self.lr is not None:
            logs["lr"] = self.lr

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self.lr is not None:
            logs["lr"] = self.lr
