#!/usr/bin/env bash
# Everything a session with the GPU machine runs, results under $OUT (or ./gpu-out); started as
# `bash benchmarks/gpu_session.sh PART`, which runs this file. One device
# command may run 10 minutes, so the work is split: `gpu_session.sh smoke|tests|speed|iris|bench`
# (also speed-compile|probe|real-resnet|real-gpt; each fits one command; `all` runs them in a row where there is no such limit).
# Start with `day` (< 9 min on an H100; benchmarks/gpu_day/day.py): (a) every `gpu` test and a smoke of
# every CLI command, (b) the conformance zoo, (c) steady host syncs, (d) the speed table, (e) the
# time to the first step, whole vs regional compile (first_step.py), (f) bf16 vs float8 (torchao),
# each part with its own budget; $OUT/gpu_day.json, gpu_day.md, gpu_day_logs.tar.gz
# and gpu_day.log (4 of the 8 files a device command returns). `day --device cpu` runs the same code
# at tiny sizes without a GPU (CI does). Arguments after `day` go to gpu_day/day.py.
# The GPU machine has torch with CUDA, Lightning, Accelerate and most dependencies but no network:
# bring the mnist1d wheel (pure Python) and, for part (f), torchao's, in .whl/:
#   bash benchmarks/gpu_session.sh wheels      # here, with pip and the network; .whl/ is git-ignored
# and carry .whl; this script installs them into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
part=${1:-all}
if [[ $part == wheels ]]; then   # the wheels the GPU machine lacks (Python 3.12, x86-64), into .whl/
  for w in mnist1d torchao; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "$w" || exit 1
  done
  ls .whl
  exit 0
fi
if [[ $part == day ]]; then   # the GPU day: one command, < 9 min on an H100 (benchmarks/gpu_day/day.py)
  shift
  $PY -m benchmarks.gpu_day.day --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_day.log"
  exit "${PIPESTATUS[0]}"
fi
if [[ $part == smoke || $part == all ]]; then   # the gpu tests and a smoke of every command: 480 s budget
  $PY -m benchmarks.gpu_day.smoke --out "$OUT" > "$OUT/gpu_smoke.log" 2>&1
  cp "$OUT/smoke/logs/gpu-tests.log" "$OUT/pytest_gpu.log" 2>/dev/null
  tail -3 "$OUT/gpu_smoke.log"
  grep -E '^\| `' "$OUT/gpu_smoke.md" | grep -v '| pass |'
fi
if [[ $part == tests ]]; then   # ~45 s on an H100 (also the first line of `smoke`)
  $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs > "$OUT/pytest_gpu.log" 2>&1
  tail -5 "$OUT/pytest_gpu.log"
fi
if [[ $part == speed || $part == all ]]; then   # ~130 s: four cases, 10 contenders, 3 repeats
  $PY -m benchmarks.train_speed --workloads synthetic-cifar@64,digits-cnn@64,mnist1d-cnn@64,synthetic-cifar@512 \
      --repeats 3 --json "$OUT/train_speed.json" > "$OUT/train_speed.log" 2>&1
  tail -8 "$OUT/train_speed.log"
fi
if [[ $part == speed-compile || $part == all ]]; then   # issue 14: seed CNN >= 10x the seed GPU loop; not yet timed
  $PY -m benchmarks.train_speed --workloads synthetic-cifar@64 --compile-contenders \
      --only seed-gpu,hand,gputrain-default,gputrain-compile,gputrain-autotuned \
      --repeats 3 --json "$OUT/train_speed-compile.json" > "$OUT/train_speed-compile.log" 2>&1
  tail -12 "$OUT/train_speed-compile.log"
fi
if [[ $part == iris || $part == all ]]; then    # ~490 s: 20000 epochs, 8 contenders, 2 repeats
  $PY -m benchmarks.train_speed --workloads iris-mlp --repeats 2 --json "$OUT/train_speed-iris.json" \
      > "$OUT/train_speed-iris.log" 2>&1
  tail -4 "$OUT/train_speed-iris.log"
fi
if [[ $part == bench || $part == all ]]; then
  $PY -m gputrain bench all --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  tar -C "$OUT" -czf "$OUT/bench.tgz" bench && rm -rf "$OUT/bench"
  tail -30 "$OUT/bench.log"
fi
if [[ $part == probe || $part == all ]]; then   # graphed step vs replay alone (issue 14's step_probe bar)
  $PY -m benchmarks.step_probe --steps 3000 > "$OUT/step_probe.log" 2>&1
  tail -12 "$OUT/step_probe.log"
fi
if [[ $part == real-resnet || $part == all ]]; then   # one workload per device command (10-minute limit)
  $PY -m benchmarks.real_models --workloads resnet18-cifar > "$OUT/real_models-resnet.log" 2>&1
  tail -20 "$OUT/real_models-resnet.log"
fi
if [[ $part == real-gpt || $part == all ]]; then
  $PY -m benchmarks.real_models --workloads gpt-mini > "$OUT/real_models-gpt.log" 2>&1
  tail -20 "$OUT/real_models-gpt.log"
fi
