# shellcheck shell=bash
# Helpers shared by the deploy scripts; sourced, never run. The script names its log prefix first:
#
#   LOG_PREFIX='[k8s]'
#   source "$ROOT/deploy/lib.sh"
#
# log MESSAGE...                    prints "LOG_PREFIX MESSAGE" on stderr.
# die MESSAGE...                    logs "FAIL: MESSAGE" and exits 1.
# die_as LABEL MESSAGE...           logs "LABEL: MESSAGE" and exits 1 (e.g. die_as MISSING ...).
# quiet COMMAND...                  runs COMMAND with its stdout and stderr discarded.
# poll TIMEOUT_S COMMAND...         runs COMMAND (stdout discarded, stderr kept) every
#                                   WAIT_INTERVAL_S seconds (default 0.5) until it succeeds:
#                                   returns 0; returns 1 once TIMEOUT_S seconds have passed.
# wait_until WHAT TIMEOUT_S COMMAND...
#                                   poll, or die "timed out after TIMEOUT_Ss waiting for WHAT".
# at_exit COMMAND...                runs COMMAND when the script exits (normal end, exit, die,
#                                   set -e), the last registered first, with errexit off.
#                                   EXIT_STATUS holds the script's exit status; an action may
#                                   change it (the script then exits with the new value). An
#                                   action that calls exit ends the cleanup there. Registrations
#                                   made in a subshell ($(...), a pipeline) are lost with it.
# temp_dir VAR [MKTEMP_ARG...]      creates a directory (mktemp -d), stores its path in VAR and
#                                   removes it at exit (at_exit).
# go_caches DIR                     exports the Go settings of every build here: module and build
#                                   caches under DIR, writable module cache, no VCS stamping, the
#                                   local toolchain only, static binaries (CGO_ENABLED=0).

log() { printf '%s %s\n' "${LOG_PREFIX:-${0##*/}:}" "$*" >&2; }

die() { die_as FAIL "$@"; }

die_as() {
  local label="$1"
  shift
  log "$label: $*"
  exit 1
}

quiet() { "$@" >/dev/null 2>&1; }

poll() {
  local timeout_s="$1" deadline
  shift
  deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep "${WAIT_INTERVAL_S:-0.5}"
  done
}

wait_until() {
  local what="$1" timeout_s="$2"
  shift 2
  poll "$timeout_s" "$@" || die "timed out after ${timeout_s}s waiting for $what"
}

_LIB_EXIT_ACTIONS=()

at_exit() {
  ((${#_LIB_EXIT_ACTIONS[@]} > 0)) || trap _lib_run_exit_actions EXIT
  _LIB_EXIT_ACTIONS+=("$(printf '%q ' "$@")")
}

_lib_run_exit_actions() {
  EXIT_STATUS=$?
  trap - EXIT
  set +e
  local i
  for ((i = ${#_LIB_EXIT_ACTIONS[@]} - 1; i >= 0; i--)); do
    eval "${_LIB_EXIT_ACTIONS[i]}"
  done
  exit "$EXIT_STATUS"
}

temp_dir() {
  local _lib_var="$1" _lib_path
  shift
  _lib_path="$(mktemp -d "$@")"
  at_exit rm -rf "$_lib_path"
  printf -v "$_lib_var" '%s' "$_lib_path"
}

go_caches() {
  export GOMODCACHE="$1/mod" GOCACHE="$1/build" GOFLAGS="-modcacherw -buildvcs=false"
  export GOTOOLCHAIN=local CGO_ENABLED=0
}
