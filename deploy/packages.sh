#!/usr/bin/env bash
# Installs the Debian packages whose commands are missing, or says exactly what is missing.
#
#   deploy/packages.sh COMMAND:PACKAGE...    e.g. deploy/packages.sh iptables:iptables
#
# Each PACKAGE is installed with apt-get (as root, on Debian/Ubuntu) when COMMAND is not on the
# PATH; a package wanted by several commands is installed once. Without root or apt-get nothing
# is installed: the script names the packages and exits 1. Nothing missing: returns at once.
# Used by deploy/engine.sh (the Docker engine) and `make test-faults` (iptables, for the cut).
set -euo pipefail

LOG_PREFIX=packages:
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

want=()
for pair in "$@"; do
  command -v "${pair%%:*}" >/dev/null || want+=("${pair#*:}")
done
((${#want[@]} > 0)) || exit 0
mapfile -t want < <(printf '%s\n' "${want[@]}" | sort -u)
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  die_as MISSING "${want[*]} (install them: apt-get install ${want[*]})"
fi
log "installing ${want[*]} with apt-get ..."
export DEBIAN_FRONTEND=noninteractive
# A lock held by another apt run is waited for, not fought over.
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${want[@]}" >/dev/null
