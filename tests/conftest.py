"""Shared fixtures.

Integration tests need a real Apache Kafka broker and get one, in this order:
``$KAFKA_BOOTSTRAP_SERVERS`` when set; else a local broker fetched from Maven Central and started
on loopback for the test session (stopped at the end, even on failure or interrupt).
With ``CI`` set, a skipped test fails the run: nothing skipped is counted as done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bootstrap_servers() -> Iterator[str]:
    """A real broker for the whole session."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    from streamproc.kafka_local import LocalKafka, ensure_kafka_jars

    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-test-kafka-"))
    broker = LocalKafka(run_dir, ensure_kafka_jars())
    broker.start()
    _BROKER_LOGS.append(broker.log_path)
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


_BROKER_LOGS: list[Path] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        for path in _BROKER_LOGS:
            terminalreporter.write_line(f"broker log: {path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("CI") and skipped:
        print(f"\nCI: {skipped} test(s) skipped; failing the run (nothing skipped counts)")
        session.exitstatus = 1
