#!/usr/bin/env bash
# GPU check for a machine with a CUDA GPU, Python 3.12 and torch, but no Java and no network.
# Prepare the wheels here first (needs the registries): `make gpu-wheels` fills
# benchmarks/wheels with what the check imports besides torch. Then, on the GPU machine:
#   bash benchmarks/gpu_check.sh            # about 3-6 minutes
# It also compares worker.precision fp32, bf16 and fp16 on the real frames (agreement with fp32,
# model-only ceiling, device-worker throughput and P99): pass e.g. `--precisions fp32,fp16` or
# `--precision-batch 64` through. Without a visible GPU it stops with one line saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=$(mktemp -d)/venv
"$PY" -m venv --system-site-packages "$venv"      # torch comes from the machine
"$venv/bin/pip" install --quiet --no-index --find-links benchmarks/wheels --no-deps \
  benchmarks/wheels/*.whl
PYTHONPATH=. "$venv/bin/python" benchmarks/gpu_check.py "$@"
