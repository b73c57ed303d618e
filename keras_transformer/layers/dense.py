"""The projections of the attention and feed-forward sub-layers."""

import keras

from keras_transformer.layers import products


def product_with_bias(inputs, kernel, bias):
    """`inputs @ kernel + bias` as one PyTorch product (`torch.nn.functional.linear`, i.e. `addmm`).

    The one home of the fused bias on PyTorch: the projections (`Dense`) and
    the logits bias of `TransformerModel`. Keras' `x @ kernel` then `+ bias`
    makes a second tensor of the output's size for the sum.

    Args:
        inputs: `[..., D_in]` torch tensor.
        kernel: `[D_in, units]` (a transposed view is fine: no copy is made).
        bias: `[units]`.
    """
    import torch

    kernel = keras.ops.convert_to_tensor(kernel)
    bias = keras.ops.convert_to_tensor(bias)
    return torch.nn.functional.linear(inputs, kernel.t(), bias.to(kernel.dtype))


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dense(keras.layers.Dense):
    """`keras.layers.Dense`, with the bias added inside the product on PyTorch, its gradient written out on JAX.

    Keras' Dense computes `x @ kernel` and then `+ bias`: two passes over the
    `[B, T, units]` output and, in training, two nodes of the backward
    graph. On PyTorch this layer calls `torch.nn.functional.linear` instead,
    one fused product (`addmm`), as `torch.nn.Linear` and Hugging Face's
    models do. On JAX's CPU backend the product and its gradient take the
    forms of `layers.products` (float32, and bfloat16 on a CPU with AMX).
    The weights, their names and every other path (TensorFlow, JAX on a GPU,
    quantized kernels, LoRA's merged `kernel`) are Keras'.
    """

    def call(self, inputs, training=None):
        if products.in_fast_forms(inputs):
            x = products.matmul(inputs, self.kernel, self.bias)  # the kernel is LoRA's sum when enabled
        elif keras.backend.backend() != "torch" or self.bias is None:
            return super().call(inputs, training=training)
        else:
            x = product_with_bias(inputs, self.kernel, self.bias)  # the kernel is LoRA's sum when enabled
        if self.activation is not None:
            x = self.activation(x)
        return x

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras' `Dense.quantize`, which refuses subclasses (`type_check`): this one changes no weight.

        The int8 path (`Dense._int8_call`, dispatched by Keras for a
        quantized layer) never reaches `call` above, so the layer is Keras'
        own quantized Dense.
        """
        return super().quantize(mode, type_check=False, config=config)
