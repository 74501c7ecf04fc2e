#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; docs/operations.md "The GPU check") on a lent GPU
# machine: its own Python with a CUDA torch, no registry, no Java. Prepare here first, where the
# registries are reachable: `make gpu-bundle` fills .gpu-bundle/ (ignored by git) with the wheels
# the check imports besides the machine's torch, numpy, pillow and torchvision, and the frames
# file. Carry .gpu-bundle/cp312 and .gpu-bundle/frames.bin; then, from the repository root there:
#   bash benchmarks/gpu_check.sh                      # every visible GPU; under 8 minutes
#   bash benchmarks/gpu_check.sh --devices cuda:0     # one GPU
# It installs the bundle with `pip install --no-index` into a scratch folder on PYTHONPATH (no
# virtual environment: a venv made from a venv's Python does not see that venv's torch), ahead of
# the machine's own packages, and runs the check under a deadline of GPU_CHECK_DEADLINE_S (480).
# Exit 0: every row ok or n/a; 1: a fault (its row says which); 2: no CUDA GPU, or no bundle for
# this Python, or a partial or broken one (no requirements.txt, a requirement with no wheel, an
# empty or unreadable frames.bin: one line saying which, and to rebuild it); 124: the deadline
# passed. The scratch folder the bundle is installed in is removed on exit. `--device cpu` runs the same checks on two logical CPU
# devices (make gpu-dry-run: the dry run, with no registry, over the cp311 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheels=.gpu-bundle/$tag
case " $* " in
  *" --device cpu "* | *" --device=cpu "*) ;;
  *)
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
      echo "gpu_check: $PY has no torch, or torch sees no CUDA GPU (nvidia-smi -L: $(nvidia-smi -L 2>/dev/null | head -1 || echo "not found")); run it on a GPU machine, or pass --device cpu" >&2
      exit 2
    fi
    ;;
esac
rebuild="run 'make gpu-bundle' where the registries are reachable and carry .gpu-bundle/$tag and .gpu-bundle/frames.bin"
bad_bundle() {
  echo "gpu_check: $1; $rebuild" >&2
  exit 2
}
if ! ls "$wheels"/*.whl >/dev/null 2>&1 || [[ ! -f .gpu-bundle/frames.bin ]]; then
  bad_bundle "no $wheels/*.whl or .gpu-bundle/frames.bin for $PY ($tag)"
fi
[[ -f .gpu-bundle/requirements.txt ]] || bad_bundle "partial bundle: no .gpu-bundle/requirements.txt"
[[ -s .gpu-bundle/frames.bin ]] || bad_bundle "partial bundle: .gpu-bundle/frames.bin is empty"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT # no exec below: the trap must run
site=$scratch/site
started=$SECONDS
# --no-index and --find-links only: nothing from a registry, the pinned set of the bundle alone
if ! pip_out=$(PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --quiet --disable-pip-version-check \
  --no-index --find-links "$wheels" --no-deps --no-compile --no-cache-dir --target "$site" \
  --requirement .gpu-bundle/requirements.txt 2>&1); then
  missing=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' <<<"$pip_out" | head -1)
  if [[ -n "$missing" ]]; then
    bad_bundle "partial bundle: no wheel in $wheels for $missing (.gpu-bundle/requirements.txt)"
  fi
  bad_bundle "the bundle's wheels do not install (pip: $(grep -v '^ *$' <<<"$pip_out" | tail -1))"
fi
echo "gpu_check: $(find "$wheels" -name "*.whl" | wc -l) wheels from $wheels installed in $((SECONDS - started)) s" >&2
status=0
PYTHONPATH="$site:$PWD" timeout "${GPU_CHECK_DEADLINE_S:-480}" "$PY" benchmarks/gpu_check.py \
  --frames .gpu-bundle/frames.bin "$@" || status=$?
exit "$status"
