#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, from the binaries of deploy/k8s/build.sh:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy as host
# processes, pods in real containers through a containerd instance of its own (Debian's
# containerd 1.6 with its built-in CRI, runc, cgroupfs), CNI bridge networking.
#
#   deploy/k8s/cluster.sh up        starts it (fresh etcd) and waits for the node to be Ready
#   deploy/k8s/cluster.sh down      stops it and removes every trace (see `down` below)
#   deploy/k8s/cluster.sh leftovers prints what of the cluster is still on the machine (exit 1 if any)
#   deploy/k8s/cluster.sh load IMAGE...   copies images from the Docker engine into the node
#   deploy/k8s/cluster.sh env       prints KUBECONFIG=... and PATH=... for a shell
#
# Nothing listens on or advertises the machine's own interfaces: the API server, the kubelet and
# the node address live on a bridge this script creates (NODE_IP on BRIDGE), etcd and the other
# components on loopback. Everything runs as root (kubelet and containerd need it). The
# containerd instance has its own config, root, state and socket, so a Docker engine on the same
# machine (with its own containerd) is neither used nor disturbed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_PREFIX='[k8s]'
# shellcheck source=deploy/lib.sh
source "$HERE/../lib.sh"
# shellcheck source=/dev/null
source "$HERE/versions.env"
CACHE="${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}"
K8S_CACHE="$CACHE/k8s"
STATE="${STREAMPROC_K8S_STATE:-$K8S_CACHE/cluster}"
# The image store outlives a cluster: a warm run re-imports only images whose id changed.
IMAGES="$K8S_CACHE/containerd-images"

NODE_NAME=streamproc-k8s
BRIDGE=spk8s0
POD_CIDR=10.244.0.0/24
NODE_IP=10.244.0.1
SERVICE_CIDR=10.96.0.0/16
CGROUP_ROOT=/streamproc-k8s
SOCK="$STATE/containerd.sock"
PAUSE_IMAGE="streamproc.local/pause:$KUBERNETES_VERSION"
# Global settings the kubelet changes (as on every kubeadm node) and `down` puts back.
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops net.bridge.bridge-nf-call-iptables
  net.bridge.bridge-nf-call-ip6tables net.ipv4.ip_forward)
STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-120}"

binaries() {
  local env_file
  env_file="$("$HERE/build.sh" cluster)"
  # shellcheck source=/dev/null
  source "$env_file"
  export PATH="$KUBE_BIN:$ETCD_BIN:$PATH"
}

kubectl() { command kubectl --kubeconfig "$STATE/admin.conf" "$@"; }
ctr_k8s() { ctr --address "$SOCK" --namespace k8s.io "$@"; }

# Starts NAME (a host process) in its own session, logging to $STATE/logs/NAME.log.
start() {
  local name="$1"
  shift
  setsid "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name"
}

# Stops the host process NAME (SIGTERM, then SIGKILL after TIMEOUT seconds).
stop() {
  local name="$1" timeout="${2:-20}" pid deadline
  pid="$(cat "$STATE/pids/$name" 2>/dev/null)" || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + timeout))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -f "$STATE/pids/$name"
}

write_configs() {
  mkdir -p "$STATE"/{logs,pids,pki,cni/net.d,cni/ipam,kubelet,pod-logs,containerd-state,runc} "$IMAGES"
  cat >"$STATE/kubeadm.yaml" <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint: {advertiseAddress: $NODE_IP, bindPort: 6443}
nodeRegistration: {name: $NODE_NAME}
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
clusterName: $NODE_NAME
kubernetesVersion: $KUBERNETES_VERSION
certificatesDir: $STATE/pki
controlPlaneEndpoint: $NODE_IP:6443
networking: {serviceSubnet: $SERVICE_CIDR, podSubnet: $POD_CIDR, dnsDomain: cluster.local}
apiServer: {certSANs: [127.0.0.1, $NODE_IP]}
etcd: {external: {endpoints: [http://127.0.0.1:2379]}}
EOF
  cat >"$STATE/containerd.toml" <<EOF
version = 2
root = "$IMAGES"
state = "$STATE/containerd-state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # These machines drop CAP_SYS_RESOURCE: without it every sandbox fails with
  # "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$STATE/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$STATE/cni/net.d"
EOF
  # firewall: accepts the pods' traffic in FORWARD (CNI-FORWARD), which a Docker engine on the
  # same machine sets to DROP; with br_netfilter even pod-to-pod traffic on the bridge passes it.
  cat >"$STATE/cni/net.d/10-streamproc.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$NODE_NAME",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$STATE/cni/ipam"
      }
    },
    {"type": "firewall", "backend": "iptables"}
  ]
}
EOF
  cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$SOCK
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
failSwapOn: false
staticPodPath: ""
podLogsDir: $STATE/pod-logs
rotateCertificates: false
serializeImagePulls: false
# The disk is shared with other work on the machine: a dip below the default 10-15 % made the
# kubelet delete every image (the pause image included) in the middle of a run.
evictionHard: {memory.available: 200Mi, nodefs.available: 1Gi, imagefs.available: 1Gi, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
EOF
  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $STATE/kube-proxy.conf}
hostnameOverride: $NODE_NAME
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: $POD_CIDR
# leave the host's conntrack table size alone
conntrack: {maxPerCore: 0}
EOF
}

certificates() {
  kubeadm init phase certs all --config "$STATE/kubeadm.yaml" >/dev/null
  kubeadm init phase kubeconfig all --config "$STATE/kubeadm.yaml" --kubeconfig-dir "$STATE" \
    >/dev/null
  # super-admin.conf carries system:masters (admin.conf's group is bound only by `kubeadm init`).
  mv "$STATE/super-admin.conf" "$STATE/admin.conf"
  kubeadm kubeconfig user --config "$STATE/kubeadm.yaml" --client-name system:kube-proxy \
    >"$STATE/kube-proxy.conf" 2>/dev/null
}

# The pause image (sandbox init), built FROM scratch around the static binary of build.sh.
pause_image() {
  ctr_k8s images check "name==$PAUSE_IMAGE" 2>/dev/null | grep -q complete && return
  local dir
  temp_dir dir
  cp "$PAUSE_BIN" "$dir/pause"
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$dir/Dockerfile"
  docker build --quiet --tag "$PAUSE_IMAGE" "$dir" >"$dir/build.log" 2>&1 ||
    { cat "$dir/build.log" >&2; die "docker build of the pause image failed"; }
  docker save "$PAUSE_IMAGE" | ctr_k8s images import - >/dev/null
}

# Removes every image the node holds under its id alone (sha256:..., the reference the CRI adds
# for an image a pod ran) whose manifest no named image points at any more: the copy a newer
# image of the same name replaced. Then collects garbage at once (rm --sync, with a throwaway tag
# so that it runs even when nothing was stale): the layers no image references any more go.
drop_unnamed_images() {
  local stale gc_tag=streamproc.local/gc:now
  stale="$(ctr_k8s images ls 2>/dev/null | awk 'NR > 1 {
      if ($1 ~ /^sha256:/) unnamed[$1] = $3; else named[$3] = 1 }
    END { for (ref in unnamed) if (!(unnamed[ref] in named)) print ref }')"
  [[ -z "$stale" ]] || log "removing the node's stale image copies: $(echo "$stale" | tr '\n' ' ')"
  ctr_k8s images tag --force "$PAUSE_IMAGE" "$gc_tag" >/dev/null
  # shellcheck disable=SC2086 # one argument per reference
  ctr_k8s images rm --sync $stale "$gc_tag" >/dev/null
}

# Copies IMAGE from the Docker engine into the node's image store unless it is there already
# with the same image id (recorded in a label at import); then drops the copies the new ones
# replaced (drop_unnamed_images) and fails, saying so, when the disk is too full for the kubelet.
# Kept, each rebuilt streamproc image left its layers in the store (about 8 GB of content and
# unpacked snapshot before the Dockerfile gave the dependencies a layer of their own), until the
# kubelet saw disk pressure and the Kafka pod never started.
load() {
  local image id name free_kib
  for image in "$@"; do
    id="$(docker image inspect --format '{{.Id}}' "$image")" || die "no image $image in Docker"
    # the name the kubelet asks for (Docker's normalisation)
    name="$image"
    if [[ "$name" != */* ]]; then
      name="docker.io/library/$name"
    elif [[ "${name%%/*}" != *[.:]* && "${name%%/*}" != localhost ]]; then
      name="docker.io/$name"
    fi
    if ctr_k8s images ls "name==$name" 2>/dev/null | grep -q "docker-id=$id"; then
      log "image $image: already in the node"
      continue
    fi
    log "loading image $image into the node ..."
    docker save "$image" | ctr_k8s images import - >/dev/null
    ctr_k8s images label "$name" "streamproc.io/docker-id=$id" >/dev/null
  done
  drop_unnamed_images
  # the kubelet evicts every pod below 1 GiB free (evictionHard above); the checks' broker data,
  # logs and emptyDirs need room above that
  free_kib="$(df --output=avail -k "$IMAGES" | tail -1)"
  if ((free_kib < 3 * 2 ** 20)); then
    die "only $((free_kib / 1024)) MiB free on the disk of $IMAGES: the kubelet evicts pods" \
      "below 1 GiB and the checks need 2 GiB above that; free space (docker builder prune," \
      "docker image prune) and run again"
  fi
}

up() {
  [[ "$(id -u)" == 0 ]] || die "run as root (kubelet and containerd need it)"
  for tool in containerd runc iptables ip docker; do
    command -v "$tool" >/dev/null || die "missing $tool (Debian: apt-get install containerd runc iptables iproute2; Docker: make images)"
  done
  [[ -z "$(leftovers 2>/dev/null)" ]] || die "a previous cluster is still here: run $0 down"
  ip route | grep -qE "^(${POD_CIDR%/*}|${SERVICE_CIDR%/*})" &&
    die "the routing table already has $POD_CIDR or $SERVICE_CIDR"
  binaries
  rm -rf "$STATE"
  write_configs
  certificates
  for s in "${SYSCTLS[@]}"; do printf '%s=%s\n' "$s" "$(sysctl -n "$s")"; done >"$STATE/sysctls.before"
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.ipv4.ip_forward=1
  # The bridge carries the node address before the first pod exists (the CNI plugin reuses it).
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_IP/${POD_CIDR#*/}" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # Service IPs from this host (the tests reach the broker's Service): through the bridge, from
  # the node address, never from the machine's own interface. Goes with the bridge.
  ip route add "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"
  local controller
  for controller in /sys/fs/cgroup/*/; do
    [[ -L "${controller%/}" ]] || mkdir -p "$controller${CGROUP_ROOT#/}"
  done

  start containerd containerd --config "$STATE/containerd.toml"
  wait_until "containerd" 30 quiet ctr_k8s version
  pause_image
  start etcd etcd --name "$NODE_NAME" --data-dir "$STATE/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster "$NODE_NAME=http://127.0.0.1:2380" --listen-metrics-urls "" \
    --quota-backend-bytes 2147483648
  local pki="$STATE/pki"
  start kube-apiserver kube-apiserver --etcd-servers http://127.0.0.1:2379 \
    --advertise-address "$NODE_IP" --bind-address "$NODE_IP" --secure-port 6443 \
    --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --client-ca-file "$pki/ca.crt" --tls-cert-file "$pki/apiserver.crt" \
    --tls-private-key-file "$pki/apiserver.key" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --requestheader-client-ca-file "$pki/front-proxy-ca.crt" \
    --requestheader-allowed-names front-proxy-client \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --requestheader-group-headers X-Remote-Group --requestheader-username-headers X-Remote-User \
    --proxy-client-cert-file "$pki/front-proxy-client.crt" \
    --proxy-client-key-file "$pki/front-proxy-client.key" \
    --enable-aggregator-routing --profiling=false
  wait_until "the API server" "$STARTUP_TIMEOUT_S" quiet kubectl get --raw /readyz
  # kubeadm's apiserver-kubelet-client certificate is in group kubeadm:cluster-admins, which
  # `kubeadm init` binds to cluster-admin (kubectl exec/logs go through it).
  kubectl create clusterrolebinding kubeadm:cluster-admins --clusterrole cluster-admin \
    --group kubeadm:cluster-admins >/dev/null
  start kube-controller-manager kube-controller-manager \
    --kubeconfig "$STATE/controller-manager.conf" --bind-address 127.0.0.1 \
    --authentication-kubeconfig "$STATE/controller-manager.conf" \
    --authorization-kubeconfig "$STATE/controller-manager.conf" \
    --use-service-account-credentials --service-account-private-key-file "$pki/sa.key" \
    --root-ca-file "$pki/ca.crt" --cluster-signing-cert-file "$pki/ca.crt" \
    --cluster-signing-key-file "$pki/ca.key" --service-cluster-ip-range "$SERVICE_CIDR" \
    --controllers '*,-nodeipam,-cloud-node-lifecycle' --profiling=false
  start kube-scheduler kube-scheduler --kubeconfig "$STATE/scheduler.conf" \
    --authentication-kubeconfig "$STATE/scheduler.conf" \
    --authorization-kubeconfig "$STATE/scheduler.conf" --bind-address 127.0.0.1 \
    --profiling=false
  start kubelet kubelet --config "$STATE/kubelet.yaml" --kubeconfig "$STATE/kubelet.conf" \
    --root-dir "$STATE/kubelet" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP"
  start kube-proxy kube-proxy --config "$STATE/kube-proxy.yaml"
  wait_until "node $NODE_NAME Ready" "$STARTUP_TIMEOUT_S" \
    quiet kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=2s
  wait_until "the default service account" 60 quiet kubectl get serviceaccount default
  log "node $NODE_NAME Ready (Kubernetes $KUBERNETES_VERSION, API https://$NODE_IP:6443)"
}

# Deletes every iptables rule and chain of the cluster (KUBE-* of kubelet and kube-proxy, CNI-*),
# IPv4 and IPv6, in one atomic restore per table; nothing else is touched.
iptables_cleanup() {
  local save restore table script
  for save in iptables-save ip6tables-save; do
    restore="${save/-save/-restore}"
    command -v "$save" >/dev/null || continue
    for table in filter nat mangle raw; do
      script="$("$save" -t "$table" 2>/dev/null | awk '
        /^:(KUBE|CNI)-/ { chains[++n] = substr($1, 2) }
        /^-A / && ($2 ~ /^(KUBE|CNI)-/ || / -j (KUBE|CNI)-/) { sub(/^-A /, "-D "); rules[++m] = $0 }
        END {
          if (n + m == 0) exit
          for (i = 1; i <= m; i++) print rules[i]
          for (i = 1; i <= n; i++) print "-X " chains[i]
        }')" || true
      [[ -n "$script" ]] || continue
      printf '*%s\n%s\nCOMMIT\n' "$table" "$script" | "$restore" --noflush || true
    done
  done
}

# Removes the cgroups under CGROUP_ROOT in every hierarchy, deepest first.
cgroups_cleanup() {
  local controller
  for controller in /sys/fs/cgroup/*/; do
    [[ -d "$controller${CGROUP_ROOT#/}" ]] || continue
    find "$controller${CGROUP_ROOT#/}" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

# Process ids of anything of the cluster still running: its daemons, containerd's shims, and
# every process in the pods' cgroups.
cluster_pids() {
  local pid cmdline
  for pid in /proc/[0-9]*; do
    pid="${pid#/proc/}"
    cmdline="$({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null)" || continue
    case "$cmdline" in
      *"$STATE/"* | *"$K8S_CACHE/kubernetes-$KUBERNETES_VERSION/bin/"* | *"$K8S_CACHE/etcd-$ETCD_VERSION/bin/"*)
        echo "$pid"
        ;;
    esac
  done
  cat /sys/fs/cgroup/pids"$CGROUP_ROOT"/kubepods/*/cgroup.procs \
    /sys/fs/cgroup/pids"$CGROUP_ROOT"/kubepods/*/*/cgroup.procs \
    /sys/fs/cgroup/pids"$CGROUP_ROOT"/kubepods/*/*/*/cgroup.procs 2>/dev/null || true
}

down() {
  local self=$$ pid mnt
  if [[ -f "$STATE/pids/kubelet" ]] && [[ -f "$STATE/admin.conf" ]]; then
    export PATH="$K8S_CACHE/kubernetes-$KUBERNETES_VERSION/bin:$PATH"
    # Pods first, through the API, so that the kubelet stops every sandbox (CNI DEL, netns gone).
    if kubectl get --raw /readyz >/dev/null 2>&1; then
      kubectl delete pods --all --all-namespaces --grace-period=0 --force --wait=false \
        >/dev/null 2>&1 || true
      local deadline=$((SECONDS + 60))
      while ((SECONDS < deadline)) && [[ -n "$(ctr_k8s tasks ls -q 2>/dev/null)" ]]; do
        kubectl delete pods --all --all-namespaces --grace-period=0 --force --wait=false \
          >/dev/null 2>&1 || true
        sleep 1
      done
    fi
  fi
  stop kubelet 30
  stop kube-proxy
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
  # Any container the kubelet did not stop: kill its task, then containerd itself.
  if [[ -S "$SOCK" ]]; then
    for id in $(ctr_k8s tasks ls -q 2>/dev/null); do
      ctr_k8s tasks kill --all --signal SIGKILL "$id" >/dev/null 2>&1 || true
      ctr_k8s tasks delete --force "$id" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  for pid in $(cluster_pids | sort -u); do
    [[ "$pid" == "$self" ]] || kill -KILL "$pid" 2>/dev/null || true
  done
  if [[ -x "$K8S_CACHE/kubernetes-$KUBERNETES_VERSION/bin/kube-proxy" ]]; then
    "$K8S_CACHE/kubernetes-$KUBERNETES_VERSION/bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
  fi
  iptables_cleanup
  # Mounts of the cluster (rootfs overlays, volumes, netns bind mounts), innermost first.
  awk -v a="$STATE" -v b="$IMAGES" 'index($5, a) == 1 || index($5, b) == 1 { print $5 }' \
    /proc/self/mountinfo | sort -r | while read -r mnt; do
    umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  done
  awk '$5 ~ "^/run/netns/cni-" { print $5 }' /proc/self/mountinfo | while read -r mnt; do
    if umount "$mnt" 2>/dev/null; then rm -f "$mnt"; fi
  done
  ip link delete "$BRIDGE" 2>/dev/null || true
  cgroups_cleanup
  if [[ -f "$STATE/sysctls.before" ]]; then
    while IFS='=' read -r key value; do sysctl -qw "$key=$value" || true; done <"$STATE/sysctls.before"
    rm -f "$STATE/sysctls.before"
  fi
  find /var/log/containers -maxdepth 1 -lname "$STATE/*" -delete 2>/dev/null || true
  rm -rf "${STATE:?}/etcd" "$STATE/kubelet" "$STATE/containerd-state" "$STATE/runc"
}

# Everything of the cluster that is still on the machine, one line each.
leftovers() {
  local pid
  for pid in $(cluster_pids | sort -u); do
    [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
    [[ -d "/proc/$pid" ]] || continue
    echo "process $pid: $({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | cut -c1-120)"
  done
  awk -v a="$STATE" -v b="$IMAGES" 'index($5, a) == 1 || index($5, b) == 1 ||
    $5 ~ "^/run/netns/cni-" { print "mount " $5 }' /proc/self/mountinfo
  ip -o link show 2>/dev/null | awk -F': ' -v br="$BRIDGE" '
    $2 == br || $0 ~ (" master " br " ") { print "network device " $2 }'
  local save table
  for save in iptables-save ip6tables-save; do
    command -v "$save" >/dev/null || continue
    for table in filter nat mangle raw; do
      "$save" -t "$table" 2>/dev/null | awk -v t="$table" -v s="$save" \
        '/^:(KUBE|CNI)-/ { print s " chain " t "/" substr($1, 2) }'
    done
  done
  local controller
  for controller in /sys/fs/cgroup/*/; do
    [[ -d "$controller${CGROUP_ROOT#/}" ]] && echo "cgroup $controller${CGROUP_ROOT#/}"
  done
  return 0
}

case "${1:-}" in
  up) up ;;
  down)
    down
    rest="$(leftovers)"
    [[ -z "$rest" ]] || { printf '%s\n' "$rest" >&2; die "teardown left the above behind"; }
    log "down: no process, mount, network device, iptables chain or cgroup of the cluster left"
    ;;
  leftovers)
    rest="$(leftovers)"
    [[ -z "$rest" ]] || { printf '%s\n' "$rest"; exit 1; }
    ;;
  load)
    shift
    load "$@"
    ;;
  env)
    # shellcheck disable=SC2016 # $PATH is for the shell that evaluates this
    printf 'export KUBECONFIG=%s\nexport PATH=%s:$PATH\nexport STREAMPROC_K8S_CONTAINERD=%s\n' \
      "$STATE/admin.conf" "$K8S_CACHE/kubernetes-$KUBERNETES_VERSION/bin" "$SOCK"
    ;;
  *)
    echo "usage: $0 up|down|leftovers|load IMAGE...|env" >&2
    exit 2
    ;;
esac
