"""A local Apache Kafka broker without Docker, for tests, the demo and development.

Apache Kafka (``org.apache.kafka:kafka_2.13``, KRaft mode) and its runtime dependencies are
resolved from Maven Central with Maven into a cache directory once; each broker then gets a
fresh data directory, free loopback ports and one combined broker+controller node whose
internal topics use replication factor 1.

Lifecycle of one :class:`LocalKafka`::

    jars = ensure_kafka_jars()            # mvn dependency:copy-dependencies, cached
    broker = LocalKafka(run_dir, jars)
    broker.start()                        # format storage, spawn java, wait for metadata
    broker.bootstrap_servers              # "127.0.0.1:PORT"
    broker.stop()                         # SIGTERM, then SIGKILL after a deadline; idempotent

A broker started with ``own_lifetime=True`` (the default, used by tests and the demo) is bound to
the Python thread that started it (``PR_SET_PDEATHSIG``), so no java process outlives an
interrupted or killed test session. ``streamproc kafka start`` passes ``own_lifetime=False`` and
records the pid in ``<dir>/broker.pid`` for ``streamproc kafka stop``.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from streamproc.errors import BrokerError

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.24.3"
_PR_SET_PDEATHSIG = 1
MARKER = ".streamproc-broker"

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.streamproc</groupId>
  <artifactId>kafka-local</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
      <version>@KAFKA@</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId>
      <version>@LOG4J@</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId>
      <version>@LOG4J@</version>
    </dependency>
@TOOLS@  </dependencies>
</project>
"""
_TOOLS_DEPENDENCY = """    <dependency>
      <groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId>
      <version>@KAFKA@</version>
    </dependency>
"""


def _pom(tools: bool) -> str:
    extra = _TOOLS_DEPENDENCY if tools else ""
    return (
        _POM.replace("@TOOLS@", extra)
        .replace("@KAFKA@", KAFKA_VERSION)
        .replace("@LOG4J@", LOG4J_VERSION)
    )


# Broker settings of a single test/demo node: internal topics with one replica and few partitions,
# no rebalance delay, no topic auto-creation (also used by the tests' container broker).
SINGLE_NODE_SETTINGS = {
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
}

_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def cache_dir() -> Path:
    """Return the cache root (``$STREAMPROC_CACHE_DIR`` or ``~/.cache/streamproc``)."""
    root = os.environ.get("STREAMPROC_CACHE_DIR") or Path.home() / ".cache" / "streamproc"
    return Path(root)


def ensure_kafka_jars(root: Path | None = None, tools: bool = False) -> Path:
    """Resolve Apache Kafka's jars from Maven Central once; return the folder holding them.

    With ``tools=True`` the set also holds ``org.apache.kafka:kafka-tools`` (the command-line
    tools: topics, consumer groups, offsets, console consumer), in its own folder
    ``kafka-<version>-tools/libs``; the container image of the broker is built from it.

    Raises:
        BrokerError: Maven or Java is missing, or the resolution failed (Maven's output is
            included in the message).
    """
    suffix = "-tools" if tools else ""
    libs = (root or cache_dir()) / f"kafka-{KAFKA_VERSION}{suffix}" / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    for tool in ("mvn", "java"):
        if shutil.which(tool) is None:
            raise BrokerError(f"`{tool}` not found on PATH: the local broker needs Java 17 + Maven")
    work = libs.parent
    work.mkdir(parents=True, exist_ok=True)
    (work / "pom.xml").write_text(_pom(tools))
    staging = work / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    proc = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={staging}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not any(staging.glob(f"kafka_2.13-{KAFKA_VERSION}.jar")):
        raise BrokerError(
            f"mvn could not resolve org.apache.kafka:kafka_2.13:{KAFKA_VERSION} "
            f"(exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    marker.touch()
    return libs


def _cluster_id() -> str:
    """A random KRaft cluster id: a UUID in URL-safe base64 without padding (22 chars).

    Never starting with ``-`` (as Kafka's own ``Uuid.randomUuid``): the storage tool's argument
    parser would take such an id for an option and fail (1 start in 64).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when asked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class LocalKafka:
    """One Apache Kafka 4.x KRaft node (broker + controller) on 127.0.0.1.

    Args:
        run_dir: folder for config, data (``data/``), logs (``logs/server.log``) and the pid file;
            ``data/`` and ``logs/`` are wiped on start. A non-empty folder that streamproc did
            not create is refused (BrokerError), so user files are never deleted.
        libs: folder of Kafka jars from :func:`ensure_kafka_jars`.
        own_lifetime: kill the broker when the starting thread dies (tests, demo).
        heap_mb: Java heap size in MiB.
    """

    run_dir: Path
    libs: Path
    own_lifetime: bool = True
    heap_mb: int = 512
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "broker.pid"

    def _java(self, main: str, *args: str, **kwargs: object) -> list[str]:
        return [
            "java",
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 256)}m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.run_dir / 'logs'}",
            "-cp",
            f"{self.libs}/*",
            main,
            *args,
        ]

    def start(self, timeout_s: float = 90.0) -> str:
        """Format storage, start the node, wait until it answers metadata requests.

        Returns:
            The bootstrap address ``127.0.0.1:PORT``.

        Raises:
            BrokerError: the broker exited or did not answer within ``timeout_s``; the message
                names the log file.
        """
        self._claim_run_dir()
        for sub in ("data", "logs"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        (self.run_dir / "logs").mkdir(parents=True)
        self.port = free_port()
        controller_port = free_port()
        props = self.run_dir / "server.properties"
        props.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                    f"CONTROLLER://127.0.0.1:{controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    "inter.broker.listener.name=PLAINTEXT",
                    f"log.dirs={self.run_dir / 'data'}",
                    *(f"{key}={value}" for key, value in SINGLE_NODE_SETTINGS.items()),
                    "log.flush.interval.ms=1000",
                    "",
                ]
            )
        )
        (self.run_dir / "log4j2.properties").write_text(_LOG4J2)
        fmt = subprocess.run(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "-t",
                _cluster_id(),
                "-c",
                str(props),
            ),
            capture_output=True,
            text=True,
            check=False,
        )
        if fmt.returncode != 0:
            raise BrokerError(f"kafka storage format failed: {fmt.stdout}{fmt.stderr}")
        return self._launch(timeout_s)

    def restart(self, timeout_s: float = 90.0) -> str:
        """Stop the broker and start it again on the same ports with the same data (for
        broker-restart failure tests). Returns the (unchanged) bootstrap address."""
        self.stop()
        return self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> str:
        props = self.run_dir / "server.properties"
        stdout = (self.run_dir / "logs" / "stdout.log").open("ab")
        self._proc = subprocess.Popen(
            self._java("kafka.Kafka", str(props)),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.own_lifetime else None,
        )
        stdout.close()
        self.pid_path.write_text(str(self._proc.pid))
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.bootstrap_servers

    def _claim_run_dir(self) -> None:
        """Use ``run_dir`` only if it is new, empty, or was made by us (never wipe user files)."""
        marker = self.run_dir / MARKER
        if self.run_dir.exists() and any(self.run_dir.iterdir()) and not marker.exists():
            raise BrokerError(
                f"{self.run_dir} is not empty and was not created by streamproc; "
                "choose a new folder for the broker"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text("state folder of a local Apache Kafka broker started by streamproc\n")

    def _wait_ready(self, timeout_s: float) -> None:
        from confluent_kafka.admin import AdminClient

        deadline_s = time.monotonic() + timeout_s
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        while time.monotonic() < deadline_s:
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerError(
                    f"kafka exited with code {self._proc.returncode}; see {self.log_path} "
                    f"and {self.run_dir / 'logs' / 'stdout.log'}"
                )
            with contextlib.suppress(Exception):
                md = admin.list_topics(timeout=2)
                if md.brokers:
                    return
            time.sleep(0.2)
        raise BrokerError(f"kafka did not answer within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            terminate_pid(pid, timeout_s, self._proc)
        self._proc = None
        self.pid_path.unlink(missing_ok=True)


def read_pid(path: Path) -> int | None:
    """Return the pid stored in ``path``, or None if absent or malformed."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def terminate_pid(pid: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM ``pid``'s process group, SIGKILL it after ``timeout_s``; wait until it is gone."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline_s = time.monotonic() + wait_s
        while time.monotonic() < deadline_s:
            if proc is not None:
                if proc.poll() is not None:
                    return
            elif not _alive(pid):
                return
            time.sleep(0.1)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    return _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
