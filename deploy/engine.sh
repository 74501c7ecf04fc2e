#!/usr/bin/env bash
# Makes a Docker engine with the compose v2 plugin available, or says exactly what is missing.
#
#   deploy/engine.sh            # used by `make images` and `make compose-test`
#
# 1. `docker` client and `dockerd`: as root on Debian/Ubuntu, installs `docker.io` and `iptables`
#    with apt-get when missing (plus `debootstrap`, which `make images` needs for the base image).
# 2. The engine: starts `dockerd` in the background (log: /var/log/streamproc-dockerd.log) when
#    nobody answers on the default socket and we are root; waits up to 60 s for it.
# 3. The compose v2 plugin (Debian ships none): builds github.com/docker/compose/v2 at
#    COMPOSE_VERSION from the Go module proxy (about 3 min the first time) into
#    /usr/local/lib/docker/cli-plugins/docker-compose.
# Without root, nothing is installed: the script names what is missing and exits 1.
# A warm run (everything present) takes well under a second.
set -euo pipefail

COMPOSE_VERSION="${COMPOSE_VERSION:-v2.29.7}"
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
CACHE="${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}"
DOCKERD_LOG=/var/log/streamproc-dockerd.log

LOG_PREFIX=engine:
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
missing() { die_as MISSING "$@"; }
is_root() { [[ "$(id -u)" == 0 ]]; }

# --- 1. packages --------------------------------------------------------------------------------
"$(dirname "${BASH_SOURCE[0]}")/packages.sh" dockerd:docker.io docker:docker.io iptables:iptables \
  debootstrap:debootstrap || exit 1

# --- 2. the engine ------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  is_root || missing "a running Docker engine (start it: sudo dockerd, or sudo systemctl start docker)"
  if [[ -S /var/run/docker.sock ]] && pgrep -x dockerd >/dev/null; then
    log "dockerd is running but does not answer yet; waiting ..."
  else
    log "starting dockerd (log: $DOCKERD_LOG) ..."
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  poll 60 quiet docker info || missing "dockerd did not answer within 60 s; see $DOCKERD_LOG"
  log "dockerd answers"
fi

# --- 3. the compose v2 plugin -------------------------------------------------------------------
if ! docker compose version 2>/dev/null | grep -q "${COMPOSE_VERSION#v}"; then
  is_root || missing "the docker compose v2 plugin ($PLUGIN_DIR/docker-compose)"
  command -v go >/dev/null || missing "Go (to build the compose plugin from the module proxy)"
  log "building docker compose $COMPOSE_VERSION from the Go module proxy (first time only) ..."
  declare gobin
  temp_dir gobin
  (
    go_caches "$CACHE/engine/go"
    export GOBIN="$gobin"
    go install -trimpath \
      -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
      "github.com/docker/compose/v2/cmd@$COMPOSE_VERSION"
  )
  mkdir -p "$PLUGIN_DIR"
  install -m 0755 "$gobin/cmd" "$PLUGIN_DIR/docker-compose"
  docker compose version >&2
fi
