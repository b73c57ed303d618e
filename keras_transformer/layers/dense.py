"""The projections of the attention and feed-forward sub-layers."""

import keras


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dense(keras.layers.Dense):
    """`keras.layers.Dense`, with the bias added inside the product on PyTorch.

    Keras' Dense computes `x @ kernel` and then `+ bias`: two passes over the
    `[B, T, units]` output and, in training, two nodes of the backward
    graph. On PyTorch this layer calls `torch.nn.functional.linear` instead,
    one fused product (`addmm`), as `torch.nn.Linear` and Hugging Face's
    models do. The weights, their names and every other path (TensorFlow,
    JAX, quantized kernels, LoRA's merged `kernel`) are Keras'.
    """

    def call(self, inputs, training=None):
        if keras.backend.backend() != "torch" or self.bias is None:
            return super().call(inputs, training=training)
        import torch

        kernel = keras.ops.convert_to_tensor(self.kernel)  # [D_in, units]; LoRA's sum when enabled
        bias = keras.ops.convert_to_tensor(self.bias)
        x = torch.nn.functional.linear(inputs, kernel.t(), bias.to(kernel.dtype))  # x @ kernel + bias
        if self.activation is not None:
            x = self.activation(x)
        return x
