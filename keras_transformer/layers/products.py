"""The projections' products and gradients in the forms XLA's CPU backend runs fastest (JAX).

Keras' `x @ kernel + bias` on JAX's CPU backend (JAX 0.10) leaves three
costs in a training step that the same arithmetic written otherwise avoids:

- **bfloat16 products off AMX.** On a CPU with AMX, XLA runs a bfloat16
  product on the matrix unit only when it accumulates to float32
  (`preferred_element_type=float32`) and its left operand is not
  transposed. Keras asks for a bfloat16 result, and XLA then converts both
  operands to float32 and multiplies in float32. 2048^3 on a 2-core CPU
  with AMX (2026-12-07): 217 GFLOP/s as Keras asks, 1,310 accumulated to
  float32.
- **The weight's gradient `x^T g`** transposes its left operand. XLA folds
  any transpose written before the product back into it (its dimension
  numbers or a column-major layout), and then multiplies bfloat16 in
  float32 and float32 off its fast path: `[256, 2000] x [2000, 1024]` in
  bfloat16, 180-206 GFLOP/s however the transpose is written, 535-749 with
  the transpose made by `rows_first` below.
- **The bias's gradient** sums `[B, T, N]` over two axes, which XLA does by
  a tree of 32 x 32 windows (`reduce-window`): 11 ms for `[54, 36, 1024]`
  against 0.3 ms for the same sum over the rows of `[1944, 1024]`.

`matmul(x, kernel, bias)` is Keras' product with a gradient written out in
the fast forms (`nn`, `nt`, `tn`, `column_sums`). The `small` shape's
training step at 2,000 tokens (`benchmarks.finetune`, 2026-12-07) took
0.58 s against 0.65 s in float32, and 0.33 s against 0.67 s in bfloat16.
The forms are taken on JAX's CPU backend for float32 operands, and for
bfloat16 ones on a CPU with `amx_bf16` only: elsewhere XLA's CPU backend may
refuse a bfloat16 product that accumulates to float32 (`DotThunk`:
`BF16 x BF16 = F32` is unimplemented). Everywhere else (TensorFlow,
PyTorch, JAX on a GPU) the functions here are Keras' ops.
"""

import functools

import keras
from keras import ops

from keras_transformer.utils import cpu_flags


@functools.cache
def jax_cpu():
    """Whether Keras runs on JAX's CPU backend."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


@functools.cache
def jax_cpu_with_amx():
    """Whether Keras runs on JAX's CPU backend, on a CPU with AMX's bfloat16 products (`amx_bf16`)."""
    return jax_cpu() and "amx_bf16" in cpu_flags()


def in_fast_forms(*tensors):
    """Whether products of these tensors take the forms here: float32 on `jax_cpu()`, bfloat16 with AMX.

    Not under a `keras.distribution`: `rows_first` flattens the rows, which
    a batch sharded across devices would have to gather.
    """
    if not jax_cpu() or keras.distribution.distribution() is not None:
        return False
    dtypes = {keras.backend.standardize_dtype(t.dtype) for t in tensors}
    return dtypes == {"float32"} or (dtypes == {"bfloat16"} and jax_cpu_with_amx())


def _product(a, b, a_axis, b_axis):
    from jax import lax

    return lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())), preferred_element_type="float32")


def rows_first(a):
    """`a.T` of a 2-D array, written to memory in that order, out of XLA's reach.

    XLA folds a transpose into the product that reads it (its `dot`'s
    dimension numbers, or a column-major layout), whatever elementwise work
    sits between them, and then runs the product off its fast path (a
    bfloat16 one converted to float32). A 1-D
    array has one layout only, and an optimization barrier keeps the
    reshapes around it from being folded: the transpose is written out.
    """
    from jax import lax

    rows, columns = a.shape
    return lax.optimization_barrier(a.T.reshape(-1)).reshape(columns, rows)


def nn(a, b, dtype):
    """`a @ b` for `a [..., K]`, `b [K, N]`, in `dtype`."""
    if not in_fast_forms(a, b):
        return ops.cast(ops.matmul(a, b), dtype)
    return _product(a, b, a.ndim - 1, 0).astype(dtype)


def nt(a, b, dtype):
    """`a @ b.T` for `a [..., K]`, `b [N, K]`, in `dtype`."""
    if not in_fast_forms(a, b):
        return ops.cast(ops.matmul(a, ops.transpose(b)), dtype)
    return _product(a, b, a.ndim - 1, 1).astype(dtype)


def tn(a, b, dtype):
    """`a.T @ b` for `a [M, K]`, `b [M, N]` (a sum over the rows: a weight's gradient), in `dtype`.

    In the fast forms the narrower operand is transposed (`rows_first`; XLA's
    CPU transpose of a `[1944, 8001]` bfloat16 array took 27 ms, longer than
    the product), and the `[K, N]` result then, where it was `b`.
    """
    if not in_fast_forms(a, b):
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
    rows of `[1944, 1024]`. A float32 sum in the fast forms is a product
    with a row of ones: XLA's own reduction of the fused loss's `[278,
    58102]` chunk took 129 ms, the product 3 ms (op time, 2026-12-07).
    """
    if in_fast_forms(a) and keras.backend.standardize_dtype(a.dtype) == "float32":
        return _product(ops.ones((1, a.shape[0]), "float32"), a, 1, 0).reshape(a.shape[1]).astype(dtype)
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
    """`x @ kernel (+ bias)` for `x [..., K]`, a 2-D `kernel [K, N]` and `bias [N]`, its gradient in the fast forms."""
    kernel = ops.cast(kernel, x.dtype)
    bias = None if bias is None else ops.cast(bias, x.dtype)
    if not in_fast_forms(x, kernel):
        y = ops.matmul(x, kernel)
        return y if bias is None else ops.add(y, bias)
    return _matmul_with_gradient()(x, kernel, bias)
