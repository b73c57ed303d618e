"""Checks of token ids, batch sizes and cache positions, shared by the model and the search.

Errors name the argument, what was received and what is allowed; values are
checked wherever they are concrete (eager calls, NumPy inputs) and skipped
inside tracing.
"""

import keras
import numpy as np
from keras import ops

from keras_transformer.token_ids import check_id_range


def _is_symbolic(x):
    """True inside tracing (tf.function, jax.jit, torch.compile) or for KerasTensors."""
    if isinstance(x, keras.KerasTensor):
        return True
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly() or tf.is_symbolic_tensor(x)
    if backend == "jax":
        import jax

        return isinstance(x, jax.core.Tracer)
    if backend == "torch":
        import torch

        return torch.compiler.is_compiling() or torch.jit.is_tracing()
    return False


def check_token_ids(token_ids, name, vocabulary_size):
    """Validates a `[B, L]` integer id tensor; returns it as int32.

    Rank is checked always; dtype and range whenever the values are concrete
    (eager calls, numpy inputs): JAX clamps out-of-range
    gather indices silently and TensorFlow fails deep inside a kernel, so a
    bad id would otherwise corrupt results or give an unreadable error.
    """
    if isinstance(token_ids, (list, tuple)):
        token_ids = np.asarray(token_ids)
    shape = tuple(token_ids.shape)
    if len(shape) != 2:
        raise ValueError(
            f"{name} must have rank 2 [batch, length], received shape {shape}"
        )
    if _is_symbolic(token_ids):
        # Inside tracing, Keras itself may build the model with float
        # placeholders (e.g. under MirroredStrategy); concrete inputs are checked.
        return ops.cast(token_ids, "int32")
    dtype = keras.backend.standardize_dtype(token_ids.dtype)
    if "int" not in dtype:
        raise ValueError(f"{name} must be an integer tensor of token ids, received dtype {dtype}")
    if 0 not in shape:
        check_id_range(ops.convert_to_numpy(token_ids), name, vocabulary_size)
    return ops.cast(token_ids, "int32")


def check_batch_sizes(**tensors):
    """Refuses tensors whose batch sizes (axis 0) differ, wherever they are known.

    The encoder and decoder inputs are never broadcast against each other:
    left to the backends, a batch of 1 against a batch of 2 broadcasts on
    PyTorch and JAX and fails inside an einsum on TensorFlow.

    Args:
        **tensors: name -> tensor or array; unknown (traced) sizes are skipped.
    """
    sizes = {name: _batch_size(x) for name, x in tensors.items()}
    sizes = {name: size for name, size in sizes.items() if size is not None}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise ValueError(f"Batch sizes differ ({listed}); every input must have the same batch size")


def _batch_size(x):
    """`x.shape[0]`, or None where it is unknown (traced) or `x` has no axes."""
    shape = getattr(x, "shape", None)
    try:
        size = None if shape is None or len(shape) == 0 else shape[0]
    except (TypeError, ValueError):  # TensorFlow shape of unknown rank
        return None
    # A traced size is no int: a tensor under torch.jit.trace (Keras' ONNX
    # export on PyTorch), a symbolic dimension under jax2tf or torch.export.
    return int(size) if isinstance(size, (int, np.integer)) else None


def check_cache_index(index, cache_length):
    """Refuses a `decode_step` position outside `[0, cache_length)` when it is concrete.

    Without it a position past the cache is clamped or dropped, differently
    on each backend, and decoding goes on with wrong keys and values.
    """
    if isinstance(index, (int, np.integer)):
        value = int(index)
    elif _is_symbolic(index):
        return
    else:
        value = int(ops.convert_to_numpy(index))
    if cache_length is not None and not 0 <= value < cache_length:
        raise ValueError(f"index={value} is outside the cache of length {cache_length} (init_cache max_length)")
