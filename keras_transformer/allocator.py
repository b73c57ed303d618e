"""glibc's allocator told to keep freed memory, so that JAX's CPU steps stop page-faulting.

XLA's CPU runtime allocates the temporaries of each execution of a compiled
function as fresh buffers and frees them at its end. Those of a training step
are large: one of about 470 MB for the `small` fine-tuning step of
`benchmarks.finetune` at 2,000 tokens. glibc serves any allocation over its
mmap threshold (at most 32 MiB) with a new `mmap` and unmaps it at `free`, so
every step the kernel maps the whole buffer in again, page by page: measured
on the project's 2-core CPU (2026-12-06), 456 MB of minor page faults and
0.21 s of system time per step of about 0.8 s on JAX, against 3 MB on
TensorFlow (whose allocator keeps its memory).

`keep_freed_memory()` sets three of glibc's `mallopt` parameters:

- `M_MMAP_MAX = 0`: no allocation is served by `mmap`; all come from the
  heap, whose freed chunks are reused;
- `M_TRIM_THRESHOLD = 2**31 - 1`: freed memory at the top of the heap is
  kept rather than given back to the kernel, up to 2 GiB. A freed top block
  larger than that still goes back: the base-shaped fine-tuning step at
  8,000 tokens (`benchmarks.finetune`, 2026-12-07) faults in 7 GB and spends
  4.5 s in the kernel a step of 23 s. Never trimming (-1, which glibc reads
  as the largest `size_t`) stops that, but there the kept heap grew past
  16 GB (the step's buffers of two batch shapes do not fit in each other's
  holes), against an 8.9 GB peak, and the process ran out of memory beside
  Hugging Face's;
- `M_ARENA_MAX = 1`: one heap for every thread. A thread's own arena (glibc
  gives threads their own) holds at most 64 MiB, and a larger allocation
  there is mapped with `mmap` whatever `M_MMAP_MAX` says; XLA allocates from
  its own threads.

The faults then stop (6 MB per step), and the step took 0.85-0.88x the time
on the same loaded machine. The cost: the process keeps its peak memory
(it does not shrink between steps or after a run), and the steady resident
size of that step was 2.2 GB against 1.9 GB.

It is done once, when `keras_transformer.model` is imported on the JAX
backend, and only before JAX has started its runtime (the threads that
allocate are made then; an arena once given to a thread stays with it).
`KERAS_TRANSFORMER_ALLOCATOR=system` leaves glibc's defaults. Other backends
are left alone: TensorFlow's allocator keeps its memory already; PyTorch's
CPU steps page-fault less (126 MB per step at the same shape), and the
setting was not shown to speed them up.
"""

import ctypes
import os
import platform

ENVIRONMENT_VARIABLE = "KERAS_TRANSFORMER_ALLOCATOR"

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))

_state = {"applied": None}


def keep_freed_memory():
    """Sets glibc's allocator to reuse freed memory instead of unmapping it; True when it did.

    False (and nothing changed) off Linux, on another C library, or with
    `KERAS_TRANSFORMER_ALLOCATOR=system`. Idempotent.
    """
    if _state["applied"] is not None:
        return _state["applied"]
    _state["applied"] = False
    if os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _state["applied"] = all(mallopt(parameter, value) == 1 for parameter, value in SETTINGS)
    return _state["applied"]


def configure_for_backend(backend):
    """`keep_freed_memory()` on the JAX backend before its runtime has started; False otherwise."""
    if backend != "jax":
        return False
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False  # too late: the runtime's threads already have their own arenas
    except (ImportError, AttributeError):
        pass
    return keep_freed_memory()
