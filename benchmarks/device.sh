#!/usr/bin/env bash
# One-GPU proof on JAX and PyTorch, without TensorFlow: training steps of the paper's base and
# big models (bf16, ~25k-token batches, MFU against the bf16 matmul rate measured in the same
# run, peak memory, beside the paper's 8 P100s), fused against plain attention at source
# lengths 64-1024, generation (batch 1 and 64, greedy and beam 4) and float32 logits GPU vs
# CPU. benchmarks/device.py says what each figure is. Writes device.json and one log per
# backend into $OUT (else $KT_DEVICE_RESULTS, else benchmarks/results/device/), a table last.
#
# Made for the GPU machine the `device` tool lends (one H200; Python 3.12, JAX 0.11 + CUDA
# plugin, PyTorch 2.11 CUDA, h5py, sentencepiece; no TensorFlow, no network). Keras and its
# two missing dependencies travel as wheels in .whl/ (ignored by git, about 3 MB);
# keras_transformer and benchmarks/ come from the working tree, which travels anyway.
#
#   1. Here, once per checkout (needs PyPI):
#        bash benchmarks/device.sh wheels
#   2. Here, to check the script end to end on the CPU (about a minute, nothing installed):
#        KT_DEVICE_SMOKE=1 bash benchmarks/device.sh
#   3. With a lent GPU, one `run` call of the device tool (about 8 minutes of its 15; the
#      script keeps to KT_DEVICE_BUDGET_S=420 s for both backends, then prints the table):
#        run(command="bash benchmarks/device.sh", carry=[".whl"], timeout_s=590)
#      device.json, device_jax.log and device_torch.log come back from $OUT. Then
#      call give_back unless you rerun at once. To rerun a part only:
#        run(command="bash benchmarks/device.sh --backends torch --sections attention",
#            carry=[".whl"], timeout_s=300)
#      Reprint a table here: python -m benchmarks.device --table path/to/device.json
#
# Extra arguments go to `python -m benchmarks.device` (--backends, --sections, --budget).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${KT_DEVICE_PYTHON:-python3}

if [[ "${1:-}" == wheels ]]; then
  # Pure-Python Keras and namex; optree (Keras' tree library on JAX) for CPython 3.12 on
  # x86-64 Linux. Everything else Keras needs (numpy, h5py, ml-dtypes, rich, absl-py,
  # packaging) is on the device image.
  rm -rf .whl
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    keras==3.15.1 namex==0.1.0 optree==0.20.0
  ls -l .whl
  exit 0
fi

export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
smoke=()
if [[ "${KT_DEVICE_SMOKE:-0}" == 1 ]]; then
  smoke=(--smoke)  # this machine's Keras, JAX and PyTorch; the wheels are for the device's Python
elif compgen -G ".whl/*.whl" >/dev/null; then
  site=${KT_DEVICE_SITE:-/tmp/kt-device-site}
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
versions="import importlib.metadata as m, sys; print('python', sys.version.split()[0], '| keras', m.version('keras'))"
if ! "$python" -c "$versions"; then
  echo "benchmarks/device.sh: no Keras here. Run 'bash benchmarks/device.sh wheels' on the development machine" \
    "and carry .whl (run(..., carry=[\".whl\"]))." >&2
  exit 2
fi
exec "$python" -m benchmarks.device "${smoke[@]}" "$@"
