"""Shared fixtures.

Integration tests need a real Apache Kafka broker and get one, in this order:

1. ``$KAFKA_BOOTSTRAP_SERVERS`` when set (an existing cluster);
2. a container from testcontainers-python's Kafka module (KRaft) when a Docker engine answers;
3. else a local Apache Kafka broker fetched from Maven Central and started on loopback.

``STREAMPROC_TEST_BROKER=local|docker`` forces 2 or 3. The broker lives for the test session and
is stopped at the end, even on failure or interrupt.
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
    choice = os.environ.get("STREAMPROC_TEST_BROKER", "auto")
    if choice == "docker" or (choice == "auto" and _docker_engine_answers()):
        yield from _container_broker()
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
KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"  # testcontainers' Kafka module targets this image


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:
        return False
    return True


def _container_broker() -> Iterator[str]:
    from testcontainers.kafka import KafkaContainer

    with KafkaContainer(KAFKA_IMAGE).with_kraft() as kafka:
        yield kafka.get_bootstrap_server()


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
