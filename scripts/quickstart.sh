#!/usr/bin/env bash
# The main job end to end on the bundled English-German corpus:
# train the small preset, translate, score on the test split, export to ONNX,
# translate with ONNX Runtime. Interrupted training resumes when run again.
#   OUT=runs/small EPOCHS=6 bash scripts/quickstart.sh   (a quicker, worse model)
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/small}
EPOCHS=${EPOCHS:-18}
SENTENCE=${SENTENCE:-"Select the cells that you want to delete."}

if [ ! -f "$OUT/config.json" ]; then
  python -m keras_transformer.train --preset small --output "$OUT" --epochs "$EPOCHS" \
    --tokens-per-batch 4096 --warmup-steps 400 --learning-rate-scale 0.5 --checkpoint-every 100 \
    --keep-checkpoints 10 --average-last 3
fi
echo "== Keras: $SENTENCE"
echo "$SENTENCE" | python -m keras_transformer.translate --preset "$OUT"
echo "== sacreBLEU on the bundled test split"
python -m keras_transformer.evaluate --preset "$OUT"
python -m export.onnx --preset "$OUT" --output "$OUT-onnx" --overwrite
echo "== ONNX Runtime: $SENTENCE"
echo "$SENTENCE" | python -m export.runtime --model "$OUT-onnx"
