"""A model repository on the test cluster's node, and the versions its results name.

The node of deploy/k8s/cluster.sh is this machine (the kubelet, containerd and runc run here as
host processes), so a folder written here is what a ``hostPath`` volume (the chart's
``models.repository.hostPath``) shows the pod, and a version renamed into it appears there at
once: no copy, no image, no restart.

torch (for the versions themselves: tests/support/model_versions.py) is imported only when a
version is written, so that collecting the chart checks stays light.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamproc.output.headers import H_MODEL_VERSION, H_OFFSET, H_PARTITION
from streamproc.tools.verify import TopicDump

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def node_repository() -> Iterator[Path]:
    """An empty model repository folder on the node, readable by the pod's user (uid 10001:
    ``0755``, whatever the umask), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="streamproc-models-"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def iot_version(scale: float = 1.0) -> torch.export.ExportedProgram:
    """A version of the iot autoencoder (``scale`` != 1: other output weights)."""
    from tests.support.model_versions import iot_module

    return iot_module(scale)


def publish(repository: Path, version: str, program: torch.export.ExportedProgram) -> Path:
    """``<repository>/iot/<version>/model.pt2`` written as a live repository is updated (a
    ``.tmp`` folder renamed into place), its folders and file readable by the pod's user."""
    from tests.support.model_versions import write_version

    previous = os.umask(0o022)
    try:
        return write_version(repository, version, program)
    finally:
        os.umask(previous)


def versions_by_partition(
    dump: TopicDump, since: dict[int, int] | None = None
) -> dict[int, list[tuple[int, str]]]:
    """Input partition -> (input offset, model version) of each result, in offset order; only
    the results of input offsets from ``since[partition]`` on when given (a topic that already
    held the results of an earlier run)."""
    found: dict[int, list[tuple[int, str]]] = {}
    for _key, _value, headers, _timestamp in dump.records.values():
        partition, offset = int(headers[H_PARTITION]), int(headers[H_OFFSET])
        if since is not None and offset < since.get(partition, 0):
            continue
        found.setdefault(partition, []).append((offset, headers[H_MODEL_VERSION].decode()))
    for results in found.values():
        results.sort()
    return found


def version_runs(results: list[tuple[int, str]]) -> list[str]:
    """The versions of RESULTS (offset order) with repeats collapsed: ``["1", "2"]`` for a
    partition whose version changed once from 1 to 2."""
    runs: list[str] = []
    for _offset, version in results:
        if not runs or runs[-1] != version:
            runs.append(version)
    return runs


def first_result_ms(dump: TopicDump, version: str, after_ms: int) -> int | None:
    """The Kafka timestamp (ms; CreateTime, set by the pod's producer) of VERSION's first
    result stamped at or after ``after_ms``, None before there is one."""
    stamps = [
        timestamp
        for _key, _value, headers, timestamp in dump.records.values()
        if headers.get(H_MODEL_VERSION, b"").decode() == version and timestamp >= after_ms
    ]
    return min(stamps, default=None)
