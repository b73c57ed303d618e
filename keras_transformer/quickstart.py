"""The Quick start's training settings, read by `scripts/quickstart.sh` and `colab/01_quickstart.ipynb`.

One source of truth: the notebook passes `SETTINGS` to `run_training`, the
script passes them to `python -m keras_transformer.train` as the options
this file prints (the same names, dashes for underscores):

```
python keras_transformer/quickstart.py     # --preset small --epochs 18 ... (one per line)
```

Standard library only, and run as a file rather than with `-m`, so that the
script reads it without importing Keras.
"""

import sys

SETTINGS = {
    "preset": "small",
    "epochs": 10,
    "tokens_per_batch": 4096,
    "warmup_steps": 400,
    "learning_rate_scale": 0.5,
    "checkpoint_every": 100,
    "keep_checkpoints": 10,
    "average_last": 3,
    "mixed_precision": "auto",
}
"""`run_training` arguments of the Quick start: the `small` preset on the bundled corpus,
10 passes over its 27,870 pairs (1,580 batches, rounded up to 1,600 updates: whole checkpoint
intervals) in batches of about 4,096 tokens a side, 400 warmup steps, half the paper's learning
rate (a small model on small data), a checkpoint every 100 steps and the average of the last 3
as the final weights, in bfloat16 where the CPU or GPU computes it natively (`"auto"`; float32
elsewhere: the same BLEU per update, benchmarks/README.md). On a 2-core CPU with AMX that is
20-25 minutes of training for about 27.8 test BLEU (40 minutes in float32;
benchmarks/README.md, "Quick start: BLEU against training time"); `"epochs": 18`
(`EPOCHS=18 bash scripts/quickstart.sh`) is the longer setting that scored 33.1."""

SMOKE_SETTINGS = {
    "preset": "tiny",
    "steps": 30,
    "tokens_per_batch": 2048,
    "warmup_steps": 10,
    "learning_rate_scale": 0.5,
    "checkpoint_every": 10,
    "keep_checkpoints": 10,
    "average_last": 3,
}
"""Every step of the Quick start in about a minute, not a model (`KT_NOTEBOOK_SMOKE=1`)."""


def train_arguments(settings=None):
    """`settings` (default `SETTINGS`) as arguments of `python -m keras_transformer.train`.

    Example:
    >>> train_arguments({"preset": "small", "warmup_steps": 400})
    ['--preset', 'small', '--warmup-steps', '400']
    """
    settings = SETTINGS if settings is None else settings
    arguments = []
    for name, value in settings.items():
        arguments += [f"--{name.replace('_', '-')}", str(value)]
    return arguments


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit(f"usage: python {sys.argv[0]} (prints the Quick start's training options, one per line)")
    print("\n".join(train_arguments()))
