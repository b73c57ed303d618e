#!/usr/bin/env bash
# Runs the test suite once per Keras backend; extra arguments go to pytest.
# Usage: bash tests/run.sh [pytest args]    (BACKENDS="jax" bash tests/run.sh to pick)
#
# On a machine with two cores or more, the first backend (TensorFlow, the
# longest run: the exports run there only) runs beside
# the others (JAX, then PyTorch), each lane in its own pytest process with its
# output kept in a log and printed when the lane ends: the CI machine's two
# cores then halve the wall time. KT_TEST_LANES=1 runs the backends one after
# another, printing as they go. Slow artifacts shared by the lanes (the Marian
# stand-ins) are built once, under a lock (tests/conftest.py, build_once).
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -a backends <<< "${BACKENDS:-tensorflow jax torch}"
cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))" 2>/dev/null || echo 1)
lanes=${KT_TEST_LANES:-$(( cores >= 2 ? 2 : 1 ))}

# Each backend's run is a few pytest processes, each over the next group of
# test files in order (KT_TEST_PROCESSES, default 4; 1: one process). In one
# long process the TensorFlow tests late in the run ran 6-9x slower than the
# same tests alone or after a few files (2026-12-06: the bundled test split's
# translate_file 207 s against 35 s, the MirroredStrategy test 150 s against
# 17 s, test_search_options' Keras comparison 124 s against 17 s). The slow
# artifacts are shared through pytest's cache (tests/conftest.py, build_once),
# so a later process reuses them. With test paths or other positional
# arguments, one process per backend, as before.
processes=${KT_TEST_PROCESSES:-4}
# XLA (JAX's every computation, TensorFlow's compiled searches) without LLVM's costly optimization passes, as
# `jax_disable_most_optimizations` does: the tests' models are tiny, so compiling is most of their time (JAX's
# fused-training and LoRA tests: 303 s, 79 s with every program already compiled, 209 s with these flags; AMD
# EPYC, 2026-12-08; JAX's third group of files 15.5 min instead of 25.5). The numbers agree to float32's
# rounding, not bit for bit with other flags (a sum of log probabilities near -119 moved by 3e-5). A caller's
# XLA_FLAGS stand.
export XLA_FLAGS=${XLA_FLAGS:---xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true}
run_backend() {
  local backend=$1 status=0 code argument
  shift
  echo "=== KERAS_BACKEND=$backend ==="
  local value=0
  for argument in "$@"; do
    # The value of an option given apart (`-o cache_dir=DIR`, `-k EXPR`, `-m MARK`, `-p PLUGIN`) is not a path.
    if [[ $value == 1 ]]; then value=0; continue; fi
    case "$argument" in
      -o|-k|-m|-p|-c|-W|--override-ini|--deselect|--ignore|--rootdir|--maxfail|--durations) value=1 ;;
      -*) ;;
      *) processes=1 ;;
    esac
  done
  if [[ "$processes" -le 1 ]]; then
    KERAS_BACKEND=$backend python -m pytest -q "$@"
    return
  fi
  local files=() group=() size index
  mapfile -t files < <(find tests -name 'test_*.py' | LC_ALL=C sort)
  size=$(( (${#files[@]} + processes - 1) / processes ))
  for (( index = 0; index < ${#files[@]}; index += size )); do
    group=("${files[@]:index:size}")
    KERAS_BACKEND=$backend python -m pytest -q "${group[@]}" "$@"
    code=$?
    # 5: nothing collected in the group (every test there deselected by -k / -m).
    [[ $code == 0 || $code == 5 ]] || status=1
  done
  return $status
}

if [[ "$lanes" -lt 2 || "${#backends[@]}" -lt 2 ]]; then
  status=0
  for backend in "${backends[@]}"; do
    run_backend "$backend" "$@" || status=1
  done
  exit $status
fi

# The tests that run their own processes (tests/conftest.py: the notebooks,
# the device smoke run) go to the second lane's last backend, and with them
# the backend-independent tests (PyTorch runs their small models without
# compiling), so that the lanes take about as long: TensorFlow runs the
# exports, JAX then PyTorch the rest. A caller's value stands.
export KT_PROCESS_TESTS_BACKEND=${KT_PROCESS_TESTS_BACKEND:-${backends[-1]}}
# A few of them (FIRST_LANE_PROCESS_TESTS in tests/conftest.py: notebook 04) go to the first lane's
# backend instead, so that the lanes end together. A caller's value stands.
export KT_FIRST_LANE_BACKEND=${KT_FIRST_LANE_BACKEND:-${backends[0]}}
# Two lanes share the cores: OpenMP threads (PyTorch's) that spin while they
# wait take the core from the other lane's work. Passive waiting: PyTorch's
# reversal test beside a TensorFlow run took 108 s instead of 148 s, and the
# TensorFlow run 76 s instead of 87 s (one pair each, 2-core machine). The
# thread counts, so the numbers, are unchanged. A caller's value stands.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
first=${backends[0]}
rest=("${backends[@]:1}")
echo "Running $first beside ${rest[*]} (two lanes; KT_TEST_LANES=1 for one); each lane prints when it ends."
( run_backend "$first" "$@" > "$logs/lane1.log" 2>&1; echo $? > "$logs/lane1.status" ) &
lane1=$!
(
  status=0
  for backend in "${rest[@]}"; do
    run_backend "$backend" "$@" || status=1
  done
  exit $status
) > "$logs/lane2.log" 2>&1
echo $? > "$logs/lane2.status"
cat "$logs/lane2.log"
wait "$lane1"
cat "$logs/lane1.log"
status=0
for lane in 1 2; do
  [[ "$(cat "$logs/lane$lane.status")" == 0 ]] || status=1
done
exit $status
