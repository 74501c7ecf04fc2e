#!/usr/bin/env bash
# The CPU dry run of the GPU machine's command (make gpu-dry-run; .ci/run; docs/operations.md
# "The GPU check"), under the GPU machine's constraints:
# * carried files only: the tracked and untracked-not-ignored files (what the device tool sends)
#   and .gpu-bundle/cp311 + .gpu-bundle/frames.bin copied to a scratch folder; the run happens
#   there. Fails when tree + .gpu-bundle/cp312 + frames.bin (what a GPU run carries) or tree +
#   cp311 pass the tool's 64 MiB;
# * no registry: PIP_NO_INDEX=1, PIP_INDEX_URL on a closed loopback port, no find-links, no
#   proxies, no pip configuration; gpu_check.sh itself passes --no-index;
# * the machine's Python: a fresh venv of DEPS's base Python 3.11 that sees only torch,
#   torchvision, numpy, pillow and what they require (benchmarks/gpu_bundle.py machine-site:
#   links into the shared environment DEPS), as the GPU machine's python3 has its own torch.
# Then, in the scratch copy: bash benchmarks/gpu_check.sh --device cpu --smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DEPS:?the shared dependency environment (make gpu-dry-run sets it)}"
limit=$((64 * 1024 * 1024))
for part in .gpu-bundle/cp312 .gpu-bundle/cp311 .gpu-bundle/frames.bin .gpu-bundle/requirements.txt; do
  [[ -e $part ]] || { echo "gpu_dry_run: no $part: run 'make gpu-bundle' first" >&2; exit 2; }
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tree=$scratch/tree
mkdir -p "$tree"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [[ -e $f ]] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$tree"
size() { du -sb "$@" | awk '{ s += $1 } END { print s }'; }
tree_bytes=$(size "$tree")
for tag in cp312 cp311; do
  bytes=$((tree_bytes + $(size .gpu-bundle/$tag .gpu-bundle/frames.bin .gpu-bundle/requirements.txt)))
  echo "gpu_dry_run: working tree + .gpu-bundle/$tag + frames.bin: $((bytes / 1024 / 1024)) MiB of 64" >&2
  ((bytes <= limit)) || { echo "gpu_dry_run: over the device tool's 64 MiB" >&2; exit 1; }
done
mkdir -p "$tree/.gpu-bundle"
cp -r .gpu-bundle/cp311 .gpu-bundle/frames.bin .gpu-bundle/requirements.txt "$tree/.gpu-bundle/"
# the machine's Python: its own torch & co., nothing else of this environment
base=$(sed -n 's/^home = //p' "$DEPS/pyvenv.cfg")/python3.11
"$base" -m venv "$scratch/machine"
PYTHONPATH=. "$DEPS/bin/python" -m benchmarks.gpu_bundle machine-site "$scratch/machine-site"
echo "$scratch/machine-site" >"$scratch/machine/lib/python3.11/site-packages/machine.pth"
cd "$tree"
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u http_proxy -u https_proxy -u HTTP_PROXY \
  -u HTTPS_PROXY -u PYTHONPATH PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/ \
  PIP_CONFIG_FILE=/dev/null PYTHON="$scratch/machine/bin/python" \
  bash benchmarks/gpu_check.sh --device cpu --smoke
