#!/usr/bin/env bash
# Runs shellcheck on every shell script of the repository. This is the one list: `make shellcheck`,
# `make lint-deploy` (deploy/lint.sh) and tests/deploy all use it.
#
#   deploy/shellcheck.sh          runs shellcheck on them (exit status: shellcheck's)
#   deploy/shellcheck.sh --list   prints them, one path (relative to the repository) a line
#
# The scripts: every *.sh file under deploy/, benchmarks/ and scripts/, and every file there or in .ci/ whose first line
# is a bash or sh shebang (e.g. the Kafka image's entrypoint, .ci/run). Options and the sourcing
# of deploy/lib.sh: deploy/.shellcheckrc. The shellcheck binary: SHELLCHECK when set, else the
# pinned one of deploy/tools.sh (installed on first use).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

SHEBANG='^#!(/usr/bin/env )?(/bin/|/usr/bin/)?(ba)?sh( |$)'

scripts() {
  local file
  find deploy .ci benchmarks scripts -type f -not -path 'deploy/docker/ca-certificates/*' \
    -not -path '.gpu-bundle/*' | LC_ALL=C sort |
    while read -r file; do
      if [[ "$file" == *.sh ]] || head -n1 "$file" | grep -qE "$SHEBANG"; then
        printf '%s\n' "$file"
      fi
    done
}

if [[ "${1:-}" == --list ]]; then
  scripts
  exit 0
fi
if [[ -z "${SHELLCHECK:-}" ]]; then
  # shellcheck source=/dev/null
  source "$(deploy/tools.sh)"
fi
mapfile -t files < <(scripts)
"$SHELLCHECK" "${files[@]}"
