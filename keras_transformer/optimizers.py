"""Adam with its update written in place (the paper's optimizer, Keras' formula)."""

import keras


@keras.saving.register_keras_serializable(package="keras_transformer")
class InPlaceAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, the same update, without temporaries the size of the weights.

    Keras' Adam writes the update as tensor expressions,
    `m += (g - m)(1 - b1)`, `v += (g^2 - v)(1 - b2)`,
    `w -= m * alpha / (sqrt(v) + eps)` with
    `alpha = lr * sqrt(1 - b2^t) / (1 - b1^t)`: on TensorFlow without XLA
    each step allocates about nine tensors the size of each weight, and on
    PyTorch five the size of all the weights together. On a CPU a fresh
    allocation of that size is paid in page faults: for a 72M-parameter
    OPUS-MT model that is gigabytes per step. This class computes the same
    formula in place:

    - TensorFlow: the fused `ResourceApplyAdam` kernel (one pass; the formula
      above exactly), except under a `tf.distribute` strategy or for sparse
      (`IndexedSlices`) gradients, where Keras' own update runs;
    - PyTorch: in-place `torch._foreach_*` ops, one temporary (the
      denominator);
    - JAX: Keras' own update, which XLA compiles into fused in-place loops.

    The variables (`m`, `v`, `iterations`) are Keras Adam's, so checkpoints
    and resume points are interchangeable with `keras.optimizers.Adam`'s.
    `amsgrad` is not supported (the paper does not use it).

    Args:
        *args, **kwargs: as `keras.optimizers.Adam`, without `amsgrad`.

    Example:
    >>> optimizer = InPlaceAdam(learning_rate=1e-4, beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    >>> model.compile(optimizer=optimizer, loss=LabelSmoothedCrossEntropy())
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("amsgrad"):
            raise ValueError("InPlaceAdam does not support amsgrad=True; use keras.optimizers.Adam")
        kwargs.setdefault("name", "adam")  # Keras Adam's variable paths
        super().__init__(*args, **kwargs)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if keras.backend.backend() == "torch":
            return self._torch_update(grads, trainable_variables, learning_rate)
        return super()._backend_update_step(grads, trainable_variables, learning_rate)

    def _torch_update(self, grads, variables, learning_rate):
        import torch

        with torch.no_grad():
            weights = [v.value for v in variables]
            m = [self._momentums[self._get_variable_index(v)].value for v in variables]
            v = [self._velocities[self._get_variable_index(v)].value for v in variables]
            step = float(keras.ops.convert_to_numpy(self.iterations)) + 1
            alpha = float(keras.ops.convert_to_numpy(learning_rate)) * (1 - self.beta_2**step) ** 0.5 / (
                1 - self.beta_1**step
            )
            torch._foreach_lerp_(m, grads, 1 - self.beta_1)  # m + (g - m)(1 - b1)
            torch._foreach_mul_(v, self.beta_2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - self.beta_2)  # b2 v + (1 - b2) g^2
            denominators = torch._foreach_sqrt(v)
            torch._foreach_add_(denominators, self.epsilon)
            torch._foreach_addcdiv_(weights, m, denominators, value=-alpha)

    def update_step(self, gradient, variable, learning_rate):
        if keras.backend.backend() != "tensorflow":
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf

        if isinstance(gradient, tf.IndexedSlices) or tf.distribute.has_strategy():
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        local_step = tf.cast(self.iterations + 1, dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        handle = variable.value.handle if isinstance(variable, keras.Variable) else variable.handle
        tf.raw_ops.ResourceApplyAdam(
            var=handle, m=m.value.handle, v=v.value.handle,
            beta1_power=tf.pow(tf.cast(self.beta_1, dtype), local_step),
            beta2_power=tf.pow(tf.cast(self.beta_2, dtype), local_step),
            lr=tf.cast(learning_rate, dtype), beta1=tf.cast(self.beta_1, dtype),
            beta2=tf.cast(self.beta_2, dtype), epsilon=tf.cast(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype), use_locking=False,
        )
