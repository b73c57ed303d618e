"""Matrix products of bfloat16 operands that XLA's CPU backend runs on AMX (JAX).

On a CPU with AMX, XLA's CPU backend (JAX 0.10) runs a bfloat16 product on
the matrix unit only when the product accumulates to float32
(`preferred_element_type=float32`) and its left operand is not transposed.
Keras' `ops.matmul` of two bfloat16 tensors asks for a bfloat16 result, and
XLA then converts both operands to float32 and multiplies in float32; the
gradient of a product (`x^T g`) transposes its left operand. Measured on a
2-core CPU with AMX (2026-12-07), 2048^3: 217 GFLOP/s as Keras asks, 1,310
GFLOP/s accumulated to float32; `[256, 2000] x [2000, 1024]` with the left
operand transposed, 180-206 GFLOP/s however the transpose is written (XLA
folds it back into the product), 535-749 GFLOP/s with the transpose made
by `rows_first` below.

`matmul` is Keras' `ops.matmul(x, kernel)` with a gradient whose three
products take those forms. Everywhere else (float32, TensorFlow, PyTorch,
JAX on GPU) the functions here are Keras' ops.
"""

import functools

import keras
from keras import ops

from keras_transformer.utils import cpu_flags


@functools.cache
def jax_cpu_with_amx():
    """Whether Keras runs on JAX's CPU backend, on a CPU with AMX's bfloat16 products (`amx_bf16`)."""
    if keras.backend.backend() != "jax" or "amx_bf16" not in cpu_flags():
        return False
    import jax

    return jax.default_backend() == "cpu"


def on_amx_path(*tensors):
    """Whether the products of these tensors take the forms here: `jax_cpu_with_amx()`, bfloat16 operands.

    Only there: elsewhere XLA's CPU backend may not take a bfloat16 product
    that accumulates to float32 (`DotThunk` refuses `BF16 x BF16 = F32`).
    """
    if not all(keras.backend.standardize_dtype(t.dtype) == "bfloat16" for t in tensors):
        return False
    return jax_cpu_with_amx()


def _product(a, b, a_axis, b_axis):
    from jax import lax

    return lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())), preferred_element_type="float32")


def rows_first(a):
    """`a.T` of a 2-D array, written to memory in that order, out of XLA's reach.

    XLA folds a transpose into the product that reads it (its `dot`'s
    dimension numbers, or a column-major layout), whatever elementwise work
    sits between them, and then runs the bfloat16 product in float32. A 1-D
    array has one layout only, and an optimization barrier keeps the
    reshapes around it from being folded: the transpose is written out.
    """
    from jax import lax

    rows, columns = a.shape
    return lax.optimization_barrier(a.T.reshape(-1)).reshape(columns, rows)


def nn(a, b, dtype):
    """`a @ b` for `a [..., K]`, `b [K, N]`, in `dtype`."""
    if not on_amx_path(a, b):
        return ops.cast(ops.matmul(a, b), dtype)
    return _product(a, b, a.ndim - 1, 0).astype(dtype)


def nt(a, b, dtype):
    """`a @ b.T` for `a [..., K]`, `b [N, K]`, in `dtype`."""
    if not on_amx_path(a, b):
        return ops.cast(ops.matmul(a, ops.transpose(b)), dtype)
    return _product(a, b, a.ndim - 1, 1).astype(dtype)


def tn(a, b, dtype):
    """`a.T @ b` for `a [M, K]`, `b [M, N]` (a sum over the rows: a weight's gradient), in `dtype`.

    On AMX's path the smaller operand is transposed (`rows_first`; XLA's
    CPU transpose of a `[1944, 8001]` bfloat16 array took 27 ms, longer than
    the product), and the `[K, N]` result then, where it was `b`.
    """
    if not on_amx_path(a, b):
        return ops.cast(ops.matmul(ops.transpose(a), b), dtype)
    from jax import lax

    if a.shape[0] == 0:
        return ops.zeros((a.shape[1], b.shape[1]), dtype)
    if a.shape[1] <= b.shape[1]:
        return _product(rows_first(a), b, 1, 0).astype(dtype)
    # The barrier keeps XLA from folding the result's transpose into the product (both operands transposed).
    return lax.optimization_barrier(_product(rows_first(b), a, 1, 0)).T.astype(dtype)


def column_sums(a, dtype):
    """`sum(a, axis=0)` of a 2-D `a [M, N]`, accumulated in float32, in `dtype` (a bias's gradient).

    Keras' gradient of a bias added to `[B, T, N]` sums over two axes, which
    XLA's CPU backend does by a tree of 32 x 32 windows (`reduce-window`):
    11 ms for `[54, 36, 1024]`, against 0.3 ms for the same sum over the
    rows of `[1944, 1024]`.
    """
    return ops.cast(ops.sum(ops.cast(a, "float32"), axis=0), dtype)


@functools.cache
def _matmul_with_gradient():
    import jax

    def product(x, kernel, bias):
        y = nn(x, kernel, x.dtype)
        return y if bias is None else y + bias

    def forward(x, kernel, bias):
        return product(x, kernel, bias), (x, kernel, bias)

    def backward(saved, upstream):
        x, kernel, bias = saved
        upstream = upstream.astype(x.dtype)
        rows = upstream.reshape(-1, upstream.shape[-1])
        return (nt(upstream, kernel, x.dtype), tn(x.reshape(-1, x.shape[-1]), rows, kernel.dtype),
                None if bias is None else column_sums(rows, bias.dtype))

    product = jax.custom_vjp(product)
    product.defvjp(forward, backward)
    return product


def matmul(x, kernel, bias=None):
    """`x @ kernel (+ bias)` for `x [..., K]`, a 2-D `kernel [K, N]` and `bias [N]`, its gradient on AMX's forms."""
    kernel = ops.cast(kernel, x.dtype)
    bias = None if bias is None else ops.cast(bias, x.dtype)
    if not on_amx_path(x, kernel):
        y = ops.matmul(x, kernel)
        return y if bias is None else ops.add(y, bias)
    return _matmul_with_gradient()(x, kernel, bias)
