#!/usr/bin/env bash
# The main job end to end on the bundled English-German corpus:
# train the small preset, translate, score on the test split, export to ONNX,
# translate with ONNX Runtime. Interrupted training resumes when run again.
# The training settings are keras_transformer/quickstart.py's (the notebook
# colab/01_quickstart.ipynb reads the same ones).
#   OUT=runs/small EPOCHS=18 bash scripts/quickstart.sh   (the longer setting: an estimated 75 minutes, a better model)
#   MIXED_PRECISION=float32 bash scripts/quickstart.sh   (the default is auto: bfloat16 where the CPU or GPU computes it natively)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/small}
SENTENCE=${SENTENCE:-"Select the cells that you want to delete."}

if [ ! -f "$OUT/config.json" ]; then
  TRAIN_OPTIONS=$(python keras_transformer/quickstart.py)
  mapfile -t TRAIN_OPTIONS <<< "$TRAIN_OPTIONS"
  python -m keras_transformer.train --output "$OUT" "${TRAIN_OPTIONS[@]}" ${EPOCHS:+--epochs "$EPOCHS"} \
    ${MIXED_PRECISION:+--mixed-precision "$MIXED_PRECISION"}
fi
echo "== Keras: $SENTENCE"
echo "$SENTENCE" | python -m keras_transformer.translate --preset "$OUT"
echo "== sacreBLEU on the bundled test split"
python -m keras_transformer.evaluate --preset "$OUT"
python -m export.onnx --preset "$OUT" --output "$OUT-onnx" --overwrite
echo "== ONNX Runtime: $SENTENCE"
echo "$SENTENCE" | python -m export.runtime --model "$OUT-onnx"
