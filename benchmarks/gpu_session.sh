#!/usr/bin/env bash
# Everything a session with the GPU machine runs, in one command, results under $OUT (or ./gpu-out).
# The GPU machine has torch with CUDA and most dependencies but no network: bring the mnist1d wheel
# (pure Python) in .whl/ and install it first, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -m gputrain info --json > "$OUT/info.json"
$PY -m gputrain doctor --json > "$OUT/doctor.json"
$PY -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
$PY benchmarks/train_speed.py --json "$OUT/train_speed.json" 2>&1 | tee "$OUT/train_speed.log"
$PY -m gputrain bench all --out "$OUT/bench" 2>&1 | tail -40 > "$OUT/bench.log"
for p in fp32 bf16 fp16; do
  $PY -m gputrain fit mnist1d-cnn --precision $p --no-save --json --quiet > "$OUT/mnist1d_$p.json"
done
