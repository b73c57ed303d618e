#!/usr/bin/env bash
# Training speed on one GPU: the bench-small harness (ours vs keras-hub on
# TensorFlow, JAX and PyTorch, MFU against the measured matmul peak) and the
# paper's big preset (target tokens/s beside the paper's figure, about 25,000
# on 8 P100s). Sized to finish in about 5 minutes on a recent GPU, most of it
# XLA compilation. Results: benchmarks/results/gpu/ (train.json, train.png,
# big.json) and a table on stdout.
#
#   bash benchmarks/gpu.sh
#   KT_GPU_SMOKE=1 bash benchmarks/gpu.sh   # tiny sizes on any machine, to check the script
#
# On a GPU machine, install the GPU extra first (it replaces [all]; CPU-only TensorFlow and
# jax[cpu] see no GPU):
#   python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[gpu]"
#   KT_GPU_INSTALL=1 bash benchmarks/gpu.sh   # does that install into the active environment first
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL=2

if [[ "${KT_GPU_INSTALL:-0}" == 1 ]]; then
  # The CPU onnxruntime of [all] and onnxruntime-gpu are one module: keep only the GPU one.
  python -m pip uninstall --quiet --yes onnxruntime >/dev/null 2>&1 || true
  python -m pip install --quiet -e ".[gpu]"
fi

if [[ "${KT_GPU_SMOKE:-0}" == 1 ]]; then
  out=${KT_GPU_RESULTS:-$(mktemp -d)}
  python -m benchmarks.train --backends tensorflow --variants ours,keras_hub --rounds 1 --steps 1 --results "$out"
  KERAS_BACKEND=tensorflow python -m benchmarks.train --big --batch-size 2 --sequence-length 8 --steps 1 \
    --results "$out"
  echo "smoke run written to $out"
  exit 0
fi

python - <<'EOF'
import sys
import tensorflow as tf
if not tf.config.list_physical_devices("GPU"):
    sys.exit("benchmarks/gpu.sh: TensorFlow sees no GPU. Install the GPU extra (pip install -e '.[gpu]', "
             "or KT_GPU_INSTALL=1 bash benchmarks/gpu.sh), or run KT_GPU_SMOKE=1 bash benchmarks/gpu.sh to check the script.")
EOF

out=benchmarks/results/gpu
python -m benchmarks.train --rounds 2 --steps 10 --results "$out"
# bfloat16 on GPUs that have it (Ampere and newer), float32 otherwise.
policy=$(python -c "import tensorflow as tf; d = tf.config.experimental.get_device_details(tf.config.list_physical_devices('GPU')[0]); print('mixed_bfloat16' if d.get('compute_capability', (0, 0)) >= (8, 0) else 'float32')")
KERAS_BACKEND=tensorflow python -m benchmarks.train --big --steps 20 --mixed-precision "$policy" --results "$out"
python - "$out/big.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"big preset ({r['mixed_precision']}, batch {r['batch_size']} x {r['sequence_length']}): "
      f"{r['target_tokens_per_second']:,.0f} target tokens/s on one GPU; the paper: about "
      f"{r['paper_target_tokens_per_second']:,} on {r['paper_gpus']} "
      f"({r['ratio_to_paper_per_gpu']:.1f}x the paper's per-GPU rate)")
EOF
