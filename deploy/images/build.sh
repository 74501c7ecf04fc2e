#!/usr/bin/env bash
# Builds every image the compose stack needs without any container registry (`make images`):
#
#   streamproc/debian:bookworm         debootstrap --variant=minbase + docker import
#   streamproc/python:3.11-bookworm    Debian's python3.11 + venv on it (the Dockerfile's base)
#   streamproc/kafka:4.4.0             Apache Kafka from the Maven Central jars that
#                                      streamproc.tools.kafka_local resolves (+ kafka-tools),
#                                      Debian's JRE
#   streamproc/prometheus:2.42         Debian's prometheus (with promtool)
#   streamproc/apicurio-registry:2.6.13  Apicurio Registry (a Schema Registry) from the Maven
#                                      Central application streamproc.tools.registry_local
#                                      resolves, Debian's JRE
#   streamproc/zipkin:3.6.1            Zipkin (trace store, query API, UI): the Maven Central jar
#                                      streamproc.tools.tracing_local resolves, Debian's JRE
#   streamproc/otelcol:0.148.0         the OpenTelemetry Collector that tracing_local builds
#                                      with the Collector Builder (Go module proxy)
#   streamproc:cpu                     the Dockerfile, VARIANT=cpu, on the Python base above
#   streamproc:cuda                    the same with VARIANT=cuda (only with `build.sh cuda`)
#
# Usage: deploy/images/build.sh [base|kafka|prometheus|registry|tracing|streamproc|cuda|all]...
# (default: all but cuda). Images that exist are rebuilt through the layer cache (seconds); the debootstrap base
# is made once (REBUILD_BASE=1 remakes it). Works with the legacy builder and with BuildKit
# (DOCKER_BUILDKIT=1 and Debian's /usr/bin/docker).
#
# Network: Debian packages from the host's own Debian mirror (its apt sources; DEBIAN_MIRROR
# overrides it: deploy/images/debian-mirror.sh), PyPI through pip (PIP_INDEX_URL when set on the
# host, else pip's default), Maven Central through mvn. The host's extra CA certificates
# (/usr/local/share/ca-certificates/*.crt, e.g. of a TLS-inspecting proxy) are handed to the pip
# step of the build through deploy/docker/ca-certificates/ (git-ignored); they never reach the
# runtime stage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/deploy/images"
PYTHON="${PYTHON:-python3.11}"
# The project environment (`make venv`): resolves the Kafka jars through
# streamproc.tools.kafka_local.
VENV_PYTHON="${VENV_PYTHON:-$ROOT/.venv/bin/python}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_IMAGE="${DEBIAN_IMAGE:-streamproc/debian:$DEBIAN_SUITE}"
STREAMPROC_BASE_IMAGE="${STREAMPROC_BASE_IMAGE:-streamproc/python:3.11-$DEBIAN_SUITE}"
KAFKA_IMAGE="${KAFKA_IMAGE:-streamproc/kafka:4.4.0}"
PROMETHEUS_IMAGE="${PROMETHEUS_IMAGE:-streamproc/prometheus:2.42}"
SCHEMA_REGISTRY_IMAGE="${SCHEMA_REGISTRY_IMAGE:-streamproc/apicurio-registry:2.6.13}"
ZIPKIN_IMAGE="${ZIPKIN_IMAGE:-streamproc/zipkin:3.6.1}"
OTEL_COLLECTOR_IMAGE="${OTEL_COLLECTOR_IMAGE:-streamproc/otelcol:0.148.0}"
STREAMPROC_IMAGE="${STREAMPROC_IMAGE:-streamproc:cpu}"
STREAMPROC_CUDA_IMAGE="${STREAMPROC_CUDA_IMAGE:-streamproc:cuda}"

LOG_PREFIX=images:
# shellcheck source=deploy/lib.sh
source "$ROOT/deploy/lib.sh"
exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# Runs a build of image TAG (the rest: the build command); removes the image it replaced, so that
# rebuilding after a change leaves no dangling image behind.
replacing() {
  local tag="$1" previous
  shift
  previous="$(image_id "$tag")"
  "$@"
  if [[ -n "$previous" && "$previous" != "$(image_id "$tag")" ]]; then
    docker rmi "$previous" >/dev/null 2>&1 || true # still used by a container: kept
  fi
}

# docker build, quiet; the legacy builder's deprecation notice is noise here.
build() {
  local tag="$2"
  replacing "$tag" docker build --quiet "$@" > >(grep -v '^sha256:' >&2) 2> >(
    grep -v -e DEPRECATED -e 'Install the buildx' -e 'docs.docker.com/go/buildx' -e '^ *$' >&2
  )
}

base() {
  if exists "$DEBIAN_IMAGE" && [[ "${REBUILD_BASE:-0}" != 1 ]]; then
    log "$DEBIAN_IMAGE exists"
  else
    command -v debootstrap >/dev/null || { log "debootstrap is missing (apt-get install debootstrap)"; exit 1; }
    local rootfs mirror
    mirror="$("$HERE/debian-mirror.sh" "$DEBIAN_SUITE")" || exit 1
    # Not a temp_dir (removed at exit): after a failed debootstrap it may still hold mounts.
    rootfs="$(mktemp -d /var/tmp/streamproc-rootfs.XXXXXX)"
    log "debootstrap --variant=minbase $DEBIAN_SUITE from $mirror (about a minute) ..."
    debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
      tail -20 "$rootfs.log" >&2
      exit 1
    }
    # Slim, container-friendly defaults (as Docker's own Debian images): no docs/man pages from
    # later packages, no apt caches, no services started by package scripts.
    cp "$HERE/debian/dpkg-excludes" "$rootfs/etc/dpkg/dpkg.cfg.d/excludes"
    cp "$HERE/debian/apt-slim" "$rootfs/etc/apt/apt.conf.d/docker-slim"
    install -m 0755 "$HERE/debian/policy-rc.d" "$rootfs/usr/sbin/policy-rc.d"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
    tar --numeric-owner -C "$rootfs" -c . |
      docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
    log "built $DEBIAN_IMAGE"
  fi
  build -t "$STREAMPROC_BASE_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/python.Dockerfile" "$HERE/debian"
  log "built $STREAMPROC_BASE_IMAGE"
}

kafka() {
  exists "$DEBIAN_IMAGE" || base
  local libs context
  libs="$("$VENV_PYTHON" -c \
    'from streamproc.tools.kafka_local import ensure_kafka_jars; print(ensure_kafka_jars(tools=True))')"
  temp_dir context /var/tmp/streamproc-kafka.XXXXXX
  cp -r "$HERE/kafka/." "$context/"
  cp -r "$libs" "$context/libs"
  rm -f "$context/libs/.complete"
  build -t "$KAFKA_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/kafka.Dockerfile" "$context"
  rm -rf "$context"
  log "built $KAFKA_IMAGE"
}

registry() {
  exists "$DEBIAN_IMAGE" || base
  local app context
  app="$("$VENV_PYTHON" -c \
    'from streamproc.tools.registry_local import ensure_registry_app; print(ensure_registry_app())')"
  temp_dir context /var/tmp/streamproc-registry.XXXXXX
  cp -r "$HERE/registry/." "$context/"
  cp -r "$app" "$context/app"
  rm -f "$context/app/.complete"
  build -t "$SCHEMA_REGISTRY_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/registry.Dockerfile" "$context"
  rm -rf "$context"
  log "built $SCHEMA_REGISTRY_IMAGE"
}

# Zipkin and the OpenTelemetry Collector (the `tracing` target): what `streamproc tracing start`
# runs on the host, fetched and built by streamproc.tools.tracing_local.
tracing() {
  exists "$DEBIAN_IMAGE" || base
  local jar collector context
  jar="$("$VENV_PYTHON" -c \
    'from streamproc.tools.tracing_local import ensure_zipkin_jar; print(ensure_zipkin_jar())')"
  collector="$("$VENV_PYTHON" -c \
    'from streamproc.tools.tracing_local import ensure_collector; print(ensure_collector())')"
  temp_dir context /var/tmp/streamproc-tracing.XXXXXX
  cp "$jar" "$context/zipkin.jar"
  cp "$collector" "$context/otelcol"
  build -t "$ZIPKIN_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/zipkin.Dockerfile" "$context"
  build -t "$OTEL_COLLECTOR_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/otelcol.Dockerfile" "$context"
  rm -rf "$context"
  log "built $ZIPKIN_IMAGE and $OTEL_COLLECTOR_IMAGE"
}

prometheus() {
  exists "$DEBIAN_IMAGE" || base
  build -t "$PROMETHEUS_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/prometheus.Dockerfile" "$HERE/debian"
  log "built $PROMETHEUS_IMAGE"
}

# The host's extra CA certificates, for pip inside the build (see the header).
ca_certificates() {
  local dir="$ROOT/deploy/docker/ca-certificates"
  find "$dir" -name '*.crt' -delete
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$dir/"
  fi
}

# PIP_INDEX_URL / pip's global.index-url on the host, handed to the build (empty: pip's default).
pip_index_url() {
  if [[ -n "${PIP_INDEX_URL:-}" ]]; then
    printf '%s' "$PIP_INDEX_URL"
  else
    "$PYTHON" -m pip config get global.index-url 2>/dev/null || true
  fi
}

# Through `docker compose build streamproc` when the compose plugin is there (BuildKit: the same
# builder and layer cache as `make compose-test`), else (or with IMAGE_BUILDER=docker) `docker build`.
streamproc_image() {
  local variant="$1" tag="$2" index
  [[ "$STREAMPROC_BASE_IMAGE" != streamproc/* ]] || exists "$STREAMPROC_BASE_IMAGE" || base
  ca_certificates
  index="$(pip_index_url)"
  log "building $tag (VARIANT=$variant; the pip step takes minutes the first time) ..."
  if [[ "${IMAGE_BUILDER:-compose}" == compose ]] && docker compose version >/dev/null 2>&1; then
    local output
    output="$(mktemp)"
    if ! STREAMPROC_IMAGE="$tag" STREAMPROC_VARIANT="$variant" PIP_INDEX_URL="$index" \
      STREAMPROC_BASE_IMAGE="$STREAMPROC_BASE_IMAGE" \
      replacing "$tag" docker compose -f "$ROOT/docker-compose.yml" --progress plain \
      build streamproc >"$output" 2>&1; then
      tail -40 "$output" >&2
      rm -f "$output"
      log "building $tag failed"
      exit 1
    fi
    rm -f "$output"
  else
    build -t "$tag" --build-arg "BASE_IMAGE=$STREAMPROC_BASE_IMAGE" \
      --build-arg "VARIANT=$variant" --build-arg "PIP_INDEX_URL=$index" "$ROOT"
    # the legacy builder keeps the build stage as an untagged image: only that one goes
    docker image prune --force --filter label=io.streamproc.stage=build >/dev/null
  fi
  log "built $tag: $(($(docker image inspect --format '{{.Size}}' "$tag") / 1000000)) MB"
}

(($# > 0)) || set -- base kafka prometheus registry tracing streamproc
for target in "$@"; do
  case "$target" in
    base) base ;;
    kafka) kafka ;;
    prometheus) prometheus ;;
    registry) registry ;;
    tracing) tracing ;;
    streamproc) streamproc_image cpu "$STREAMPROC_IMAGE" ;;
    cuda) streamproc_image cuda "$STREAMPROC_CUDA_IMAGE" ;;
    all) base && kafka && prometheus && registry && tracing && streamproc_image cpu "$STREAMPROC_IMAGE" ;;
    *) log "unknown target '$target' (base|kafka|prometheus|registry|tracing|streamproc|cuda|all)"; exit 2 ;;
  esac
done
