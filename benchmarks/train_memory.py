"""Where a fine-tuning process's memory goes: resident size at each stage of `benchmarks.finetune`'s worker.

One backend (or Hugging Face) in this process, on `benchmarks.finetune`'s
checkpoint and batches (`python -m benchmarks.finetune` builds them once).
At each stage it records the resident size (`VmRSS`), the peak since the
stage began (`VmHWM`, reset through `/proc/self/clear_refs`), and glibc's
own account of its heap (`mallinfo2`: bytes in use, bytes free but kept);
on JAX also the bytes of `jax.live_arrays()`. Stages: the interpreter, the
framework imported and started, the model loaded, compiled, the optimizer
built, then each training step (`train_on_batch`, as the benchmark's).

The step's rise above the resident size before it is its transient memory
(gradients, activations, temporaries); what stays after it is the kept part.
Weights, optimizer state and gradients are counted from the variables.

```
KERAS_BACKEND=jax python -m benchmarks.train_memory --shape base --budget 2000
python -m benchmarks.train_memory --contender huggingface --shape base
```

Prints one JSON line per stage and a table; `--output` writes the JSON list.
"""

import argparse
import ctypes
import json
import os
import re
import sys
import time

MB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    """glibc's heap: `(in_use_mb, free_kept_mb, mmapped_mb)`, or None off glibc."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    info = function()
    return info.uordblks / MB + info.hblkhd / MB, info.fordblks / MB, info.hblkhd / MB


def _status():
    text = open("/proc/self/status").read()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def _mappings():
    """Resident MB by kind of mapping: glibc's `[heap]`, other anonymous memory, files (libraries, mmapped weights)."""
    kinds = {"heap": 0, "anonymous": 0, "file": 0}
    kind = None
    with open("/proc/self/smaps") as handle:
        for line in handle:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                fields = line.split()
                name = fields[5] if len(fields) > 5 else ""
                kind = "heap" if name == "[heap]" else "file" if name.startswith("/") else "anonymous"
            elif line.startswith("Rss:"):
                kinds[kind] += int(line.split()[1]) / 1024
    return kinds


def reset_peak():
    """Starts a new `VmHWM` window (Linux's clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class Recorder:
    def __init__(self, live_bytes=None):
        self.rows = []
        self.live_bytes = live_bytes
        reset_peak()

    def __call__(self, stage, **extra):
        status = _status()
        row = {"stage": stage, "rss_mb": status["VmRSS"], "peak_mb": status["VmHWM"]}
        row.update({f"rss_{kind}_mb": mb for kind, mb in _mappings().items()})
        heap = _mallinfo()
        if heap is not None:
            row.update(heap_in_use_mb=heap[0], heap_free_kept_mb=heap[1], heap_mmapped_mb=heap[2])
        if self.live_bytes is not None:
            row["live_arrays_mb"] = self.live_bytes() / MB
        row.update(extra)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        reset_peak()


def _jax_live_bytes():
    import jax

    return sum(x.nbytes for x in jax.live_arrays())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contender", default="ours", choices=("ours", "huggingface"))
    parser.add_argument("--shape", default="base")
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=2, help="passes over the benchmark's batches")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc keeps freed memory (`allocator.keep_freed_memory`) on any backend, set first")
    parser.add_argument("--import-tensorflow", action="store_true",
                        help="seed with keras.utils.set_random_seed, which imports TensorFlow where installed")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.keep_freed_memory:
        from keras_transformer import allocator

        allocator.keep_freed_memory()
    import numpy as np

    record = Recorder()
    record("interpreter")
    from benchmarks import finetune

    batches, tables = finetune.load_batches(args.shape, args.budget)
    backend = "torch" if args.contender == "huggingface" else os.environ.get("KERAS_BACKEND", "tensorflow")
    if args.contender == "huggingface":
        import torch

        torch.ones(1) @ torch.ones(1)
        import transformers  # noqa: F401
    else:
        import keras

        import keras_transformer.model  # noqa: F401  (on JAX: the allocator setting, before the runtime starts)

        keras.ops.convert_to_numpy(keras.ops.matmul(keras.ops.ones((2, 2)), keras.ops.ones((2, 2))))
        if backend == "jax":
            record.live_bytes = _jax_live_bytes
    record("framework")
    if args.contender == "ours":
        if args.import_tensorflow:
            keras.utils.set_random_seed(0)
        else:
            finetune.set_random_seed(0)  # what `Ours` does first
        from keras_transformer import allocator

        record("seeded", tensorflow_imported="tensorflow" in sys.modules, allocator_kept=allocator._state["applied"])
    directory = finetune.checkpoint_dir(args.shape)
    contender = finetune._contender(args.contender, directory, tables, finetune.DROPOUT)
    if args.contender == "huggingface":
        parameters = sum(p.numel() for p in contender.model.parameters())
        record("model loaded", weights_mb=parameters * 4 / MB)  # AdamW's state is made at its first step
    else:
        model = contender.model

        def size(variables):
            return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)

        record("model loaded", weights_mb=size(model.weights) / MB)
        model.optimizer.build(model.trainable_variables)
        state = size(model.optimizer.variables)
        record("optimizer built", optimizer_mb=state / MB)
    prepared = [contender.batch(*b) for b in batches]
    for index in range(args.passes * len(prepared)):
        batch = prepared[index % len(prepared)]
        start = time.perf_counter()
        contender.step(batch)
        seconds = time.perf_counter() - start
        shape = list(batches[index % len(batches)][0].shape) + [batches[index % len(batches)][1].shape[1]]
        record(f"step {index + 1}", batch=shape, seconds=round(seconds, 2))
    rows = record.rows
    print(f"\n{args.contender} ({backend}), {args.shape} {args.budget}")
    print("| stage | RSS after (MB) | peak during (MB) | heap in use | heap free kept |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['stage']} | {row['rss_mb']:,.0f} | {row['peak_mb']:,.0f} | "
              f"{row.get('heap_in_use_mb', 0):,.0f} | {row.get('heap_free_kept_mb', 0):,.0f} |")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"contender": args.contender, "backend": backend, "shape": args.shape,
                       "budget": args.budget, "stages": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
