#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; docs/operations.md "The GPU check") on a machine with
# CUDA GPUs, Python and torch, but no network and no Java. Prepare the wheels here first (needs
# the registries): `make gpu-wheels` fills benchmarks/wheels with what the check imports besides
# torch, and with a Java runtime and the Kafka jars for the pipeline row's local broker
# (gpu_broker.sh; without them that row says n/a unless --bootstrap names a broker). Then, on the
# GPU machine:
#   bash benchmarks/gpu_check.sh                      # every visible GPU; under 10 minutes
#   bash benchmarks/gpu_check.sh --devices cuda:0     # one GPU
# Exit 0: every row ok or n/a; 1: a fault (its row says which batch and output); 2: no CUDA GPU.
# Where the clone has its .venv (make venv), that is used and no wheels are needed: `--device cpu`
# runs the same checks on two logical CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import confluent_kafka, torch' 2>/dev/null; then
  PYTHONPATH=. exec .venv/bin/python benchmarks/gpu_check.py "$@"
fi
case " $* " in
  *" --device cpu "* | *" --device=cpu "*) ;;
  *)
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
      echo "gpu_check: $PY has no torch, or torch sees no CUDA GPU (nvidia-smi -L: $(nvidia-smi -L 2>/dev/null | head -1 || echo "not found")); run it on a GPU machine, or pass --device cpu" >&2
      exit 2
    fi
    ;;
esac
if ! ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
  echo "gpu_check: benchmarks/wheels has no wheels; run 'make gpu-wheels' where the registries are reachable and copy the folder over" >&2
  exit 2
fi
if [[ -x benchmarks/wheels/jre/bin/java ]]; then # the pipeline row's broker (gpu_broker.sh)
  PATH="$PWD/benchmarks/wheels/jre/bin:$PATH"
  export STREAMPROC_CACHE_DIR="$PWD/benchmarks/wheels/cache"
fi
venv=$(mktemp -d)/venv
"$PY" -m venv --system-site-packages "$venv" # torch comes from the machine
"$venv/bin/pip" install --quiet --no-index --find-links benchmarks/wheels --no-deps \
  benchmarks/wheels/*.whl
PYTHONPATH=. exec "$venv/bin/python" benchmarks/gpu_check.py "$@"
