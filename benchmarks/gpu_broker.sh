#!/usr/bin/env bash
# The local broker for the GPU check's pipeline row on a machine with no Java and no network
# (docs/operations.md "The GPU check"): a Java runtime cut to the modules the Kafka broker loads
# (jlink from this machine's JDK, about 50 MB) in benchmarks/wheels/jre, and the broker's jars
# (the cache's kafka-<version>/libs, from `make kafka-jars`) in benchmarks/wheels/cache.
# gpu_check.sh puts both to use when present. Called by `make gpu-wheels`.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${STREAMPROC_CACHE_DIR:-$HOME/.cache/streamproc}
out=benchmarks/wheels
libs=$(find "$CACHE" -maxdepth 2 -type d -path '*/kafka-[0-9]*/libs' ! -path '*-tools/*' | sort | tail -1)
[[ -n "$libs" && -e "$libs/.complete" ]] || {
  echo "gpu_broker: no Kafka jars under $CACHE (run make kafka-jars)" >&2
  exit 2
}
command -v jlink >/dev/null || {
  echo "gpu_broker: jlink not found (a JDK 17+ is needed here)" >&2
  exit 2
}
# java.desktop: the broker's storage tool loads java.beans
modules=java.base,java.desktop,java.instrument,java.logging,java.management,java.naming
modules+=,java.scripting,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.crypto.ec
modules+=,jdk.management,jdk.naming.dns,jdk.unsupported,jdk.zipfs
rm -rf "$out/jre"
jlink --add-modules "$modules" --strip-debug --no-header-files --no-man-pages --compress=2 \
  --output "$out/jre"
version_dir=$(basename "$(dirname "$libs")")
rm -rf "$out/cache/$version_dir"
mkdir -p "$out/cache/$version_dir"
cp -r "$libs" "$out/cache/$version_dir/"
echo "gpu_broker: $out/jre ($(du -sh "$out/jre" | cut -f1)), $out/cache/$version_dir ($(du -sh "$out/cache/$version_dir" | cut -f1))"
