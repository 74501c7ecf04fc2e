#!/usr/bin/env bash
# GPU check for a machine with CUDA GPUs, Python 3.12 and torch, but no Java and no network.
# Prepare the wheels here first (needs the registries): `make gpu-wheels` fills
# benchmarks/wheels with what the check imports besides torch (nvidia-ml-py included). Then, on
# the GPU machine:
#   bash benchmarks/gpu_check.sh            # every visible GPU; about 5-10 minutes
#   bash benchmarks/gpu_check.sh --devices cuda:0,cuda:1 --instances-per-gpu 2
# It also compares worker.precision fp32, bf16 and fp16 on the real frames (agreement with fp32,
# model-only ceiling, device-worker throughput and P99): pass e.g. `--precisions fp32,fp16` or
# `--precision-batch 64` through.
# Without a CUDA GPU it stops at once (exit 2) and says why; `--device cpu` is a smoke run of
# the same code paths on two logical CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case " $* " in
  *" --device cpu "* | *" --device=cpu "*) ;;
  *)
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
      echo "gpu_check: $PY has no torch, or torch sees no CUDA GPU (nvidia-smi -L: $(nvidia-smi -L 2>/dev/null | head -1 || echo "not found")); run it on a GPU machine, or pass --device cpu for a smoke run" >&2
      exit 2
    fi
    ;;
esac
if ! ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
  echo "gpu_check: benchmarks/wheels has no wheels; run 'make gpu-wheels' where the registries are reachable and copy the folder over" >&2
  exit 2
fi
venv=$(mktemp -d)/venv
"$PY" -m venv --system-site-packages "$venv"      # torch comes from the machine
"$venv/bin/pip" install --quiet --no-index --find-links benchmarks/wheels --no-deps \
  benchmarks/wheels/*.whl
PYTHONPATH=. "$venv/bin/python" benchmarks/gpu_check.py "$@"
