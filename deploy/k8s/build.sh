#!/usr/bin/env bash
# Builds, from the Go module proxy and Debian's gcc only, everything a single-node Kubernetes
# cluster needs for `make k8s-test`, at the versions of deploy/k8s/versions.env, into
#   ${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}/k8s/
#     kubernetes-<v>/bin/  kube-apiserver kube-controller-manager kube-scheduler kubelet
#                          kube-proxy kubectl kubeadm    (scratch module, see build_kubernetes;
#                          kubeadm only generates the certificates and kubeconfigs)
#     kubernetes-<v>/pause pause (gcc -static of build/pause/linux/pause.c)
#     etcd-<v>/bin/        etcd
#     cni-<v>/bin/         bridge host-local loopback portmap firewall
#     keda-<v>/bin/        keda (operator), keda-adapter (metrics API server);
#                          keda-<v>/config/ (KEDA's kustomize manifests)
#     go/                  module and build caches (safe to delete)
# Each component is skipped when its folder is complete, so a warm run takes about a second.
# Prints the path of an env file (KEY=VALUE) naming all of the above.
#
#   deploy/k8s/build.sh [kubernetes|etcd|cni|keda|cluster|all]   (default: all; cluster: all but KEDA)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_PREFIX='[k8s-build]'
# shellcheck source=deploy/lib.sh
source "$HERE/../lib.sh"
# shellcheck source=/dev/null
source "$HERE/versions.env"
CACHE="${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}"
K8S_CACHE="$CACHE/k8s"
mkdir -p "$K8S_CACHE"

go_caches "$K8S_CACHE/go"

KUBE_DIR="$K8S_CACHE/kubernetes-$KUBERNETES_VERSION"
ETCD_DIR="$K8S_CACHE/etcd-$ETCD_VERSION"
CNI_DIR="$K8S_CACHE/cni-$CNI_PLUGINS_VERSION"
KEDA_DIR="$K8S_CACHE/keda-$KEDA_VERSION"

# The local directory of MODULE@VERSION (downloaded through the proxy when missing).
module_dir() {
  go mod download -json "$1@$2" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}

# Runs the build function FN into DIR.partial and renames it to DIR on success. DIR is complete
# when its .complete holds the hash of FN's current text (a changed recipe rebuilds).
build_into() {
  local dir="$1" what="$2" fn="$3" start=$SECONDS recipe
  recipe="$(declare -f "$fn" | sha256sum | cut -c1-16)"
  [[ "$(cat "$dir/.complete" 2>/dev/null)" == "$recipe" ]] && return
  # One builder per component at a time; a second one waits and then finds it built.
  exec 8>"$dir.lock"
  flock 8
  [[ "$(cat "$dir/.complete" 2>/dev/null)" == "$recipe" ]] && return
  log "building $what (first time only) ..."
  rm -rf "$dir.partial"
  mkdir -p "$dir.partial"
  "$fn" "$dir.partial"
  echo "$recipe" >"$dir.partial/.complete"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  log "built $what in $((SECONDS - start)) s"
}

# Kubernetes cannot be `go install`ed (its go.mod replaces every staging module k8s.io/* with a
# folder of its own repository, and the module zip leaves those folders out). A scratch module
# requires k8s.io/kubernetes and pins every staging module to its published v0.<minor>.<patch>;
# the proxy lacks a few patch releases of some of them, so the nearest patch that exists is taken.
build_kubernetes() {
  local out="$1" src="$1/src" kdir minor patch ldflags staging version p
  kdir="$(module_dir k8s.io/kubernetes "$KUBERNETES_VERSION")"
  minor="$(cut -d. -f2 <<<"$KUBERNETES_VERSION")"
  patch="$(cut -d. -f3 <<<"$KUBERNETES_VERSION")"
  mkdir -p "$src" "$out/bin"
  {
    printf 'module streamproc.local/k8s-build\n\ngo 1.22.0\n\nrequire k8s.io/kubernetes %s\n\n' \
      "$KUBERNETES_VERSION"
    awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$kdir/go.mod" | while read -r staging; do
      version=""
      for p in "$patch" $((patch - 1)) $((patch + 1)) $((patch - 2)) $((patch + 2)); do
        ((p >= 0)) || continue
        if go mod download "$staging@v0.$minor.$p" >/dev/null 2>&1; then
          version="v0.$minor.$p"
          break
        fi
      done
      # Not on the proxy at all (the sample-* modules): no binary here imports them, and
      # without a replace the pruned module graph never needs their go.mod.
      [[ -n "$version" ]] || { log "  $staging: no release near v0.$minor.$patch, left out"; continue; }
      [[ "$version" == "v0.$minor.$patch" ]] || log "  $staging: v0.$minor.$patch unavailable, using $version"
      printf 'replace %s => %s %s\n' "$staging" "$staging" "$version"
    done
  } >"$src/go.mod"
  # Version stamps as Kubernetes' own build sets them (hack/lib/version.sh): kubectl, helm's
  # kubeVersion checks and the node report the real version instead of v0.0.0-master.
  ldflags="-s -w"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  (
    cd "$src"
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$out/bin/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
      k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubeadm
  )
  # The pause container: the init process of every pod sandbox.
  gcc -Os -static -DVERSION="$KUBERNETES_VERSION" -o "$out/pause" "$kdir/build/pause/linux/pause.c"
  strip "$out/pause"
}

build_etcd() {
  local out="$1" src="$1/src"
  mkdir -p "$src"
  printf 'module streamproc.local/etcd-build\n\ngo 1.22\n' >"$src/go.mod"
  cat >"$src/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (
    cd "$src"
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null 2>&1
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "-s -w" -o "$out/bin/etcd" .
  )
}

build_cni() {
  local out="$1" plugin
  for plugin in main/bridge ipam/host-local main/loopback meta/portmap meta/firewall; do
    GOBIN="$out/bin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
      "github.com/containernetworking/plugins/plugins/$plugin@$CNI_PLUGINS_VERSION"
  done
}

# The operator (cmd/manager) and the metrics API server (cmd/adapter) that serves
# external.metrics.k8s.io to the HPA. `go install` is refused for the replace directive in
# KEDA's go.mod; the scratch module repeats it.
build_keda() {
  local out="$1" src="$1/src" kdir pkg="github.com/kedacore/keda/v2" ldflags
  kdir="$(module_dir "$pkg" "$KEDA_VERSION")"
  mkdir -p "$src" "$out/bin"
  {
    printf 'module streamproc.local/keda-build\n\n%s\n\nrequire %s %s\n\n' \
      "$(grep -m1 '^go ' "$kdir/go.mod")" "$pkg" "$KEDA_VERSION"
    awk '/^replace \(/ { block = 1; next } block && /^\)/ { block = 0; next }
         block { print "replace " $0; next } /^replace / { print }' "$kdir/go.mod"
  } >"$src/go.mod"
  ldflags="-s -w -X $pkg/version.Version=${KEDA_VERSION#v}"
  (
    cd "$src"
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$out/bin/keda" "$pkg/cmd/operator"
    CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$out/bin/keda-adapter" "$pkg/cmd/adapter"
  )
  # KEDA's own manifests (kustomize), deployed by tests/k8s with the images swapped for local ones.
  cp -r "$kdir/config" "$out/config"
  chmod -R u+w "$out/config"
}

what="${1:-all}"
case "$what" in
  cluster | kubernetes | etcd | cni | keda | all) ;;
  *) log "usage: $0 [kubernetes|etcd|cni|keda|cluster|all]"; exit 2 ;;
esac
case "$what" in
  cluster) "$0" kubernetes >/dev/null && "$0" etcd >/dev/null && "$0" cni >/dev/null ;;
  kubernetes | all) build_into "$KUBE_DIR" "Kubernetes $KUBERNETES_VERSION" build_kubernetes ;;&
  etcd | all) build_into "$ETCD_DIR" "etcd $ETCD_VERSION" build_etcd ;;&
  cni | all) build_into "$CNI_DIR" "CNI plugins $CNI_PLUGINS_VERSION" build_cni ;;&
  keda | all) build_into "$KEDA_DIR" "KEDA $KEDA_VERSION" build_keda ;;
esac

env_file="$K8S_CACHE/build-$KUBERNETES_VERSION-$ETCD_VERSION-$CNI_PLUGINS_VERSION-$KEDA_VERSION.env"
cat >"$env_file.partial" <<ENV
KUBE_BIN=$KUBE_DIR/bin
PAUSE_BIN=$KUBE_DIR/pause
ETCD_BIN=$ETCD_DIR/bin
CNI_BIN=$CNI_DIR/bin
KEDA_BIN=$KEDA_DIR/bin
KEDA_CONFIG=$KEDA_DIR/config
ENV
mv "$env_file.partial" "$env_file"
echo "$env_file"
