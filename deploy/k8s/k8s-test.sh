#!/usr/bin/env bash
# `make k8s-test`: the Helm chart on a real single-node Kubernetes cluster, end to end.
#
#  1. builds the cluster's binaries (deploy/k8s/build.sh; cached by version) and helm
#     (deploy/tools.sh);
#  2. takes the images of `make images` (STREAMPROC_IMAGE, KAFKA_IMAGE) from the Docker engine,
#     and wraps KEDA's operator and metrics server into images FROM scratch;
#  3. starts the cluster (deploy/k8s/cluster.sh up), loads the images into the node, deploys one
#     Apache Kafka broker (deploy/k8s/manifests/kafka.yaml);
#  4. runs tests/k8s (helm install with deploy/k8s/values/*.yaml, replay, crash, roll, scale,
#     probes, securityContext, exactly-once StatefulSet, KEDA, scale to zero and back under
#     exactly-once, a share group scaled by KEDA's prometheus scaler from 1 to 6 pods on a
#     2-partition topic (with an in-cluster Prometheus, deploy/k8s/manifests/prometheus.yaml), a
#     rolling update with static membership, the consumer group protocol under kill -9, helm
#     test, helm uninstall), each verified from the broker;
#  5. tears the cluster down and fails if any process, mount, network device, iptables chain or
#     cgroup of it is left; prints the time of every phase.
# KEEP=1 leaves the cluster up (deploy/k8s/cluster.sh down removes it). PYTEST_ARGS passes on.
# K8S_CHECKS=all (default) runs every check; K8S_CHECKS=ci (what .ci/run uses) runs the subset
# CI has time for on a fresh machine: install + replay of the three workloads, securityContext,
# a pod force-deleted mid-stream, liveness, a model update without a restart, exactly-once with
# kills, a share group scaled 1 -> 6 pods by KEDA (the one KEDA check of the subset), helm test,
# uninstall (the others are deselected, not skipped). K8S_CHECKS=gaps runs the rebalance-gap
# table alone (per group protocol, with and without static membership; about 25 min, no KEDA).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
LOG_PREFIX='[k8s-test]'
# shellcheck source=deploy/lib.sh
source deploy/lib.sh
HERE=deploy/k8s
# shellcheck source=/dev/null
source "$HERE/versions.env"
PYTHON="${PY:-.venv/bin/python}"
STREAMPROC_IMAGE="${STREAMPROC_IMAGE:-streamproc:cpu}"
export KAFKA_IMAGE="${KAFKA_IMAGE:-streamproc/kafka:4.4.0}"
export PROMETHEUS_IMAGE="${PROMETHEUS_IMAGE:-streamproc/prometheus:2.42}"
KEDA_IMAGE="streamproc.local/keda:$KEDA_VERSION"
KEDA_ADAPTER_IMAGE="streamproc.local/keda-metrics-apiserver:$KEDA_VERSION"
export KAFKA_IP=10.96.0.100
export K8S_CHECKS="${K8S_CHECKS:-all}"
# the subsets are pytest markers (tests/k8s/conftest.py), never substrings of test names: a name
# filter once picked a KEDA check into the ci run, which builds no KEDA
case "$K8S_CHECKS" in
  all | ci) build_what=all ;;
  gaps) build_what=cluster ;;
  *) log "K8S_CHECKS must be all, ci or gaps, not $K8S_CHECKS"; exit 2 ;;
esac

declare -A took
phase_start=$SECONDS
phase() {
  local name="$1"
  took[$name]=$((SECONDS - phase_start))
  phase_start=$SECONDS
}
report_times() {
  local name times="" total=0
  for name in build images cluster-up load kafka tests teardown; do
    [[ -n "${took[$name]:-}" ]] || continue
    times+=" $name ${took[$name]}s,"
    total=$((total + took[$name]))
  done
  log "times:$times total ${total}s ($1, K8S_CHECKS=$K8S_CHECKS)"
}

# --- 1. binaries ----------------------------------------------------------------------------------
cold=warm
[[ -f "${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}/k8s/kubernetes-$KUBERNETES_VERSION/.complete" ]] || cold=cold
env_file="$("$HERE/build.sh" "$build_what")"
# shellcheck source=/dev/null
source "$env_file"
# shellcheck source=/dev/null
source "$(deploy/tools.sh)"
export PATH="$KUBE_BIN:$PATH" HELM
phase build

# --- 2. images --------------------------------------------------------------------------------------
docker info >/dev/null 2>&1 || die "no Docker engine answers (make images starts one)"
needed=("$STREAMPROC_IMAGE" "$KAFKA_IMAGE")
# the share group's scaling check (KEDA's prometheus scaler) scrapes the pods with Prometheus
[[ "$K8S_CHECKS" == gaps ]] || needed+=("$PROMETHEUS_IMAGE")
for image in "${needed[@]}"; do
  docker image inspect "$image" >/dev/null 2>&1 && continue
  grep -q '^images:' Makefile || die "no image $image (and no \`make images\` to build it)"
  log "no image $image: make images ..."
  make images
  docker image inspect "$image" >/dev/null 2>&1 || die "make images did not build $image"
done
scratch_image() {
  local tag="$1" binary="$2" dir
  temp_dir dir
  cp "$binary" "$dir/"
  printf 'FROM scratch\nCOPY %s /%s\nUSER 65532:65532\nENTRYPOINT ["/%s"]\n' \
    "$(basename "$binary")" "$(basename "$binary")" "$(basename "$binary")" >"$dir/Dockerfile"
  docker build --quiet --tag "$tag" "$dir" >"$dir/build.log" 2>&1 ||
    { cat "$dir/build.log" >&2; die "docker build of $tag failed"; }
}
extra_images=()
if [[ "$K8S_CHECKS" != gaps ]]; then
  scratch_image "$KEDA_IMAGE" "$KEDA_BIN/keda"
  scratch_image "$KEDA_ADAPTER_IMAGE" "$KEDA_BIN/keda-adapter"
  extra_images=("$KEDA_IMAGE" "$KEDA_ADAPTER_IMAGE" "$PROMETHEUS_IMAGE")
fi
phase images

# --- 3. cluster -------------------------------------------------------------------------------------
status=1
cleanup() {
  ((EXIT_STATUS == 0)) || status=1
  if [[ "${KEEP:-0}" == 1 ]]; then
    log "KEEP=1: the cluster stays up; $(deploy/k8s/cluster.sh env | tr '\n' ' ')"
    return
  fi
  phase_start=$SECONDS
  if deploy/k8s/cluster.sh down; then
    phase teardown
  else
    status=1
  fi
  report_times "$cold"
  if ((status == 0)); then
    log "PASS"
  else
    log "FAIL"
    EXIT_STATUS=1
  fi
}
at_exit cleanup
deploy/k8s/cluster.sh up
eval "$(deploy/k8s/cluster.sh env)"
phase cluster-up
deploy/k8s/cluster.sh load "$STREAMPROC_IMAGE" "$KAFKA_IMAGE" "${extra_images[@]}"
phase load

# shellcheck disable=SC2016 # the variables envsubst may replace
envsubst '${KAFKA_IP} ${KAFKA_IMAGE}' <"$HERE/manifests/kafka.yaml" | kubectl apply -f - >/dev/null
if ! kubectl -n kafka rollout status deployment/kafka --timeout=180s >/dev/null; then
  # what a reader of CI's log needs to tell a slow start from a pod that cannot run: the node's
  # taints and conditions (disk pressure), the free disk, and the checks' own diagnosis of a
  # namespace (pods, events, unready pods described, their logs)
  log "the Kafka broker was not ready in 180 s; the node, the disk, the pod and its events:"
  kubectl describe node | sed -n '/^Taints:/p;/^Conditions:/,/^Addresses:/p' >&2 || true
  df -h "$ROOT" >&2 || true
  "$PYTHON" -c 'import sys; from tests.k8s.kube import diagnosis; print(diagnosis(sys.argv[1]))' \
    kafka >&2 || true
  die "the Kafka broker in the cluster did not become ready"
fi
log "Kafka broker ready at $KAFKA_IP:9092"
phase kafka

# --- 4. the checks --------------------------------------------------------------------------------
read -ra pytest_args <<<"${PYTEST_ARGS:-}"
STREAMPROC_K8S=1 KAFKA_BOOTSTRAP="$KAFKA_IP:9092" STREAMPROC_IMAGE="$STREAMPROC_IMAGE" \
  KEDA_IMAGE="$KEDA_IMAGE" KEDA_ADAPTER_IMAGE="$KEDA_ADAPTER_IMAGE" KEDA_CONFIG="$KEDA_CONFIG" \
  "$PYTHON" -m pytest tests/k8s/test_chart_on_cluster.py -p no:cacheprovider -v -s \
  "${pytest_args[@]}"
phase tests
status=0
