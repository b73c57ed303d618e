#!/usr/bin/env bash
# Runs the test suite once per Keras backend; extra arguments go to pytest.
# Usage: bash tests/run.sh [pytest args]    (BACKENDS="jax" bash tests/run.sh to pick)
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for backend in ${BACKENDS:-tensorflow jax torch}; do
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND=$backend python -m pytest -q "$@" || status=1
done
exit $status
