"""Shared fixtures.

Integration tests need a real Apache Kafka broker and get one, in this order:

1. ``$KAFKA_BOOTSTRAP_SERVERS`` when set (an existing cluster);
2. a container of ``$KAFKA_IMAGE`` (default ``streamproc/kafka:4.4.0``, built by ``make images``
   from the same Maven Central jars as 3.) when a Docker engine answers and has that image;
3. else a local Apache Kafka broker fetched from Maven Central and started on loopback.

``STREAMPROC_TEST_BROKER=local|docker`` forces 3 or 2 (``docker`` fails with the command to run
when the engine or the image is missing; it never pulls: these machines reach no registry). With
``auto`` (the default), an engine without the image means the local broker, said in one line of
the report header. The broker lives for the test session and is stopped at the end, even on
failure or interrupt.

Ryuk (testcontainers' reaper container) is disabled: its image would have to be pulled. The
container is removed by the fixture's ``finally`` (failure, Ctrl-C); one left by a session that was
killed outright (SIGKILL) carries the label ``io.streamproc.test-broker=<pid>`` and is removed by
the next session once that pid is gone.
With ``CI`` set, a skipped test fails the run: nothing skipped is counted as done.
``$OTEL_EXPORTER_OTLP_ENDPOINT`` is removed from the environment: only the tracing tests trace,
each to a backend of its own.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

KAFKA_IMAGE = os.environ.get("KAFKA_IMAGE", "streamproc/kafka:4.4.0")
# A shell that ran `streamproc tracing start` exports this: the tests that trace set their own
# endpoint, and no other test's pipeline (in this process or a child) exports to that backend.
os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
OWNER_LABEL = "io.streamproc.test-broker"
_BROKER_LOGS: list[Path] = []


@pytest.fixture(scope="session")
def bootstrap_servers() -> Iterator[str]:
    """A real broker for the whole session."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    if broker_choice()[0] == "docker":
        yield from _container_broker()
        return
    from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-test-kafka-"))
    broker = LocalKafka(run_dir, ensure_kafka_jars())
    broker.start()
    _BROKER_LOGS.append(broker.log_path)
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@functools.cache
def broker_choice() -> tuple[str, str]:
    """("docker" | "local" | "given", why), decided once per session."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return "given", f"KAFKA_BOOTSTRAP_SERVERS={os.environ['KAFKA_BOOTSTRAP_SERVERS']}"
    choice = os.environ.get("STREAMPROC_TEST_BROKER", "auto")
    if choice not in ("auto", "docker", "local"):
        raise pytest.UsageError(f"STREAMPROC_TEST_BROKER must be auto, docker or local: {choice!r}")
    if choice == "local":
        return "local", "STREAMPROC_TEST_BROKER=local"
    missing = _container_unavailable()
    if missing is None:
        return "docker", f"container of {KAFKA_IMAGE}"
    if choice == "docker":
        raise pytest.UsageError(f"STREAMPROC_TEST_BROKER=docker: {missing}")
    return "local", missing


def _container_unavailable() -> str | None:
    """None when the engine answers and holds KAFKA_IMAGE, else what is missing and what to do."""
    with warnings.catch_warnings():
        # docker (7.x) UnixHTTPConnection.connect leaves its socket open when no engine listens
        # on the Unix socket; its ResourceWarning would fail whichever test the garbage
        # collector happens to run in. Collected here, where it is expected.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return _probe_engine()
        finally:
            gc.collect()


def _probe_engine() -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
    except Exception:
        return "no Docker engine answers"
    try:
        client.images.get(KAFKA_IMAGE)
    except docker.errors.ImageNotFound:
        return (
            f"the Docker engine has no image {KAFKA_IMAGE} (build it: make images; or set "
            "KAFKA_IMAGE to one it has)"
        )
    finally:
        client.close()
    return None


def pytest_report_header(config: pytest.Config) -> str:
    kind, why = broker_choice()
    if kind == "local" and why.startswith("the Docker engine"):
        return f"kafka broker: local (Maven Central jars) because {why}"
    return f"kafka broker: {kind} ({why})"


def _remove_leftover_brokers(client: object) -> None:
    """Remove broker containers of test sessions that no longer run (killed without cleanup)."""
    from streamproc.tools.kafka_local import alive

    for container in client.containers.list(all=True, filters={"label": OWNER_LABEL}):  # type: ignore[attr-defined]
        owner = container.labels.get(OWNER_LABEL, "")
        if not owner.isdigit() or not alive(int(owner)):
            container.remove(force=True, v=True)


def _container_broker() -> Iterator[str]:
    """One KRaft node in a container of KAFKA_IMAGE, its listener published on 127.0.0.1."""
    from confluent_kafka.admin import AdminClient
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    from streamproc.tools.kafka_local import SINGLE_NODE_SETTINGS, free_port

    testcontainers_config.ryuk_disabled = True
    port = free_port()
    broker = (
        DockerContainer(KAFKA_IMAGE)
        .with_envs(
            CLUSTER_ID="DxCWdqKLRGe928dtyDqT1g",
            KAFKA_NODE_ID="1",
            KAFKA_PROCESS_ROLES="broker,controller",
            KAFKA_CONTROLLER_QUORUM_VOTERS="1@localhost:9093",
            # clients: the published port; the broker itself (transaction markers, metadata)
            # on a listener of its own that resolves inside the container
            KAFKA_LISTENERS="PLAINTEXT://:9092,BROKER://localhost:9094,CONTROLLER://localhost:9093",
            KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://127.0.0.1:{port},BROKER://localhost:9094",
            KAFKA_LISTENER_SECURITY_PROTOCOL_MAP=(
                "PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT"
            ),
            KAFKA_CONTROLLER_LISTENER_NAMES="CONTROLLER",
            KAFKA_INTER_BROKER_LISTENER_NAME="BROKER",
            # as the local broker: KAFKA_FOO_BAR is the broker property foo.bar
            **{f"KAFKA_{k.upper().replace('.', '_')}": v for k, v in SINGLE_NODE_SETTINGS.items()},
            KAFKA_HEAP_OPTS="-Xmx512m -Xms256m",
        )
        .with_kwargs(labels={OWNER_LABEL: str(os.getpid())})
    )
    # Published on loopback only (with_bind_ports takes no host address; the Docker SDK does).
    broker.ports["9092/tcp"] = ("127.0.0.1", port)
    _remove_leftover_brokers(broker.get_docker_client().client)
    broker.start()
    try:
        bootstrap = f"127.0.0.1:{port}"
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        deadline_s = time.monotonic() + 90.0
        while True:
            with contextlib.suppress(Exception):
                if admin.list_topics(timeout=2).brokers:
                    break
            container = broker.get_wrapped_container()
            container.reload()
            if container.status != "running" or time.monotonic() > deadline_s:
                logs = container.logs(tail=40).decode(errors="replace")
                raise RuntimeError(f"{KAFKA_IMAGE} did not answer on {bootstrap}:\n{logs}")
            time.sleep(0.2)
        yield bootstrap
    finally:
        broker.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        for path in _BROKER_LOGS:
            terminalreporter.write_line(f"broker log: {path}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark integration tests; give each test its tier (tests/support/tiers.py) and fail the
    collection, naming the modules, when a test has none or several."""
    from tests.support.tiers import tier_of

    problems: dict[str, None] = {}
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
        try:
            path = PurePosixPath(item.path.relative_to(config.rootpath).as_posix())
        except ValueError:  # outside the repository: no folder default applies
            path = PurePosixPath(item.path.as_posix())
        tier, problem = tier_of(path, (mark.name for mark in item.iter_markers()))
        if tier is None:
            problems[str(problem)] = None
        elif item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    if problems:
        raise pytest.UsageError("test tiers:\n" + "\n".join(problems))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("CI") and skipped:
        print(f"\nCI: {skipped} test(s) skipped; failing the run (nothing skipped counts)")
        session.exitstatus = 1
