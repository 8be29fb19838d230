#!/usr/bin/env bash
# GPU check, under 5 minutes on one CUDA GPU, no network: the CUDA-relevant tests (greedy equality
# with transformers for every family and tree, batching, chunked prefill, stop rules) on the GPU, then plain vs Medusa
# speed, the cost curve c(n) and compiled decoding (scripts/gpu_check.py). Results go to the folder given.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Needs a python with CUDA torch and this project's dependencies. Where transformers is older than
# the project needs and nothing can be installed from the network, put wheels in .whl/ first
# (here: pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0 ...): they are
# installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
MEDUSA_TEST_DEVICE=cuda timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_generate.py \
  -m "not integration" 2>&1 | tee "$OUT/tests.log" | tail -5
tests=${PIPESTATUS[0]}
timeout 170 "$PYTHON" scripts/gpu_check.py "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench (results in $OUT)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
