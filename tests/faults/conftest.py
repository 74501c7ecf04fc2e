"""Fault scenarios on a local three-node cluster (`make test-faults`; marker ``faults``).

One :class:`~streamproc.tools.kafka_local.LocalCluster` (KRaft, replication factor 3,
``min.insync.replicas`` 2) serves the whole session; before every test the cluster is whole
again (every node running, every replica of the internal topics in sync), and after every test
the nemesis undoes whatever fault is left (killed nodes restarted, stopped ones continued, cut
routes reconnected), also when the test failed.

``FAULTS_HEAP_MB`` sets each node's Java heap (default 320).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamproc.tools.kafka_local import LocalCluster, ensure_kafka_jars
from streamproc.tools.nemesis import Nemesis

HEALTHY_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Three KRaft nodes on loopback for the session, stopped at the end even on failure."""
    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-faults-"))
    heap_mb = int(os.environ.get("FAULTS_HEAP_MB", "320"))
    cluster = LocalCluster(run_dir, ensure_kafka_jars(), heap_mb=heap_mb)
    cluster.start()
    try:
        yield cluster
    finally:
        Nemesis(cluster).heal()
        cluster.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def nemesis(cluster: LocalCluster) -> Iterator[Nemesis]:
    """The fault injector of a whole cluster; every fault is undone after the test."""
    nemesis = Nemesis(cluster)
    nemesis.heal()
    wait_whole(cluster, nemesis)
    try:
        yield nemesis
    finally:
        nemesis.heal()


def wait_whole(cluster: LocalCluster, nemesis: Nemesis) -> None:
    """Wait until every node runs and every partition of the internal topics that exist has
    all three replicas in sync (a scenario starts from a whole cluster)."""
    deadline_s = time.monotonic() + HEALTHY_TIMEOUT_S
    replicas = list(range(1, len(cluster.nodes) + 1))
    lagging: dict[str, object] = {}
    while time.monotonic() < deadline_s:
        lagging = {}
        for topic in ("__consumer_offsets", "__transaction_state"):
            with contextlib.suppress(Exception):
                short = {p: isr for p, isr in nemesis.isr(topic).items() if isr != replicas}
                if short:
                    lagging[topic] = short
        if all(node.running for node in cluster.nodes) and not lagging:
            return
        time.sleep(0.5)
    pytest.fail(f"the cluster is not whole after {HEALTHY_TIMEOUT_S:.0f} s: {lagging}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.faults.scenario import RESULTS

    if RESULTS:
        terminalreporter.section("fault scenarios")
        for line in RESULTS:
            terminalreporter.write_line(line)
