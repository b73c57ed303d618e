"""glibc kept from unmapping JAX's step buffers (`keras_transformer.allocator`)."""

import json
import os
import platform
import subprocess
import sys

import keras
import pytest

pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "jax", reason="the setting is made on the JAX backend only"),
    pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"),
]

# A compiled function whose temporaries (5,000 x 5,000 float32 products, 100 MB each) are
# allocated and freed by XLA's CPU runtime at each call; the minor page faults (MB of 4 KiB
# pages) of each of its last 4 calls out of 24. Kept, glibc's heap grows over the first few
# calls (a call's buffers are allocated before the last call's are freed) and then reuses them.
_PROBE = """
import json, resource, sys
import keras_transformer.model  # makes the setting, on JAX, before the runtime starts
import jax, jax.numpy as jnp
from keras_transformer import allocator

@jax.jit
def f(x):
    y = jnp.sin(jnp.outer(x, x))
    return jnp.sum(y * jnp.cos(y))

x = jnp.linspace(0.0, 1.0, 5000)
faulted = []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
print(json.dumps({"applied": allocator._state["applied"], "faulted_mb": faulted[-4:]}))
"""


def _probe(**environment):
    env = dict(os.environ, KERAS_BACKEND="jax", **environment)
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_freed_step_buffers_are_reused_rather_than_faulted_in_again():
    kept = _probe()
    system = _probe(KERAS_TRANSFORMER_ALLOCATOR="system")
    assert kept["applied"] is True and system["applied"] is False
    # glibc's default maps buffers that size anew at each call (~190 MB of faults); kept, they are reused.
    assert min(system["faulted_mb"]) > 50, system
    assert max(kept["faulted_mb"]) < 10, kept


def test_the_setting_is_skipped_once_the_runtime_has_started():
    from keras_transformer import allocator

    script = (
        "import jax, jax.numpy as jnp; jnp.ones(3).block_until_ready()\n"
        "from keras_transformer import allocator\n"
        "print(allocator.configure_for_backend('jax'), allocator.configure_for_backend('tensorflow'))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, KERAS_BACKEND="jax"))
    assert result.stdout.split() == ["False", "False"], result.stderr[-2000:]
    assert allocator.configure_for_backend("torch") is False
