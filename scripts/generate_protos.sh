#!/usr/bin/env bash
# Regenerate the Python code of the workloads' Protobuf schemas (streamproc/workloads/schemas/
# *.proto -> *_pb2.py and *_pb2.pyi) with protoc from grpcio-tools (a dev dependency), into the
# folder given (default: next to the .proto files). tests/unit/schemas checks that the
# checked-in code equals what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
python="${PYTHON:-.venv/bin/python}"
[[ "$python" == /* ]] || python="$root/$python"
mkdir -p "${1:-streamproc/workloads/schemas}"
out="$(cd "${1:-streamproc/workloads/schemas}" && pwd)"
cd streamproc/workloads/schemas
"$python" -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" \
  trades.proto iot.proto video.proto
