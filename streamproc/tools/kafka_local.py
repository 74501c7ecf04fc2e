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

:class:`LocalCluster` runs three (or more) such nodes as one replicated cluster: every node is a
combined broker + controller (the controller quorum is all nodes), clients reach each node on its
own loopback port, brokers replicate over a listener of their own (so a client's route to one
node can be cut while replication goes on), and the defaults are those of a production cluster:
replication factor 3 and ``min.insync.replicas`` 2 for every topic, the offsets and transaction
state topics included (:data:`CLUSTER_SETTINGS`).
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from filelock import FileLock

from streamproc.errors import BrokerError

KAFKA_VERSION = "4.4.0"
LOG4J_VERSION = "2.24.3"
_PR_SET_PDEATHSIG = 1
KAFKA_JVM_PERFORMANCE_OPTS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
"""The JVM options Kafka's own ``bin/kafka-run-class.sh`` starts a broker with
(``KAFKA_JVM_PERFORMANCE_OPTS``' default). Without ``MaxGCPauseMillis=20`` G1 aims at 200 ms,
sizes its young generation for that, and a young collection stopped the broker for up to 143 ms
on a busy 2-core host: every record produced meanwhile reaches a consumer that much later
(docs/benchmarks.md, "The broker's pauses")."""
GC_LOG_NAME = "kafkaServer-gc.log"
"""The broker's GC log in its ``logs/`` folder: the name and rotation (10 files of 100 MB) of
Kafka's ``kafka-server-start.sh`` (``-loggc``); the ``gc`` tag alone, not ``gc*``: one line per
collection, enough to read the pauses."""
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
    "share.coordinator.state.topic.num.partitions": "4",
    "group.initial.rebalance.delay.ms": "0",
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
}

# Broker settings of every node of a local replicated cluster (:class:`LocalCluster`): what a
# production cluster of three brokers uses. Two replicas must acknowledge every write
# (``acks=all``), so one node may be down without refusing writes; two down refuse them
# (NOT_ENOUGH_REPLICAS) until one returns. No unclean leader election: a replica that fell out
# of the ISR never becomes leader, so an acknowledged record is never lost.
CLUSTER_SETTINGS = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "share.coordinator.state.topic.num.partitions": "4",
    "unclean.leader.election.enable": "false",
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


def install_once(marker: Path, install: Callable[[], None]) -> None:
    """Run ``install`` unless ``marker`` exists, holding an inter-process lock beside the
    marker's folder (``<folder>.lock``): concurrent first uses on one host (two test sessions,
    a demo beside a test run, ``make images`` beside either) install once, and none reads or
    deletes another's half-written staging folder.

    Raises:
        whatever ``install`` raises (the lock is released).
    """
    if marker.exists():
        return
    folder = marker.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.with_name(f"{folder.name}.lock")):
        if not marker.exists():  # another process may have finished while this one waited
            install()


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
    install_once(libs / ".complete", lambda: _resolve_kafka_jars(libs, tools))
    return libs


def _resolve_kafka_jars(libs: Path, tools: bool) -> None:
    """Resolve the jars into ``libs`` (staged, renamed when complete) and mark it complete."""
    marker = libs / ".complete"
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


def spawn_logged(
    args: list[str],
    log_path: Path,
    own_lifetime: bool,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``args`` in a session of its own, stdin closed, stdout and stderr appended to
    ``log_path``; with ``own_lifetime`` it dies with this process (``PR_SET_PDEATHSIG``).
    ``env``: added to this process's environment. Does not wait."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            args,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if own_lifetime else None,
        )


class Spawnable(Protocol):
    """A local server process: started without waiting, then waited for, or stopped."""

    def spawn(self) -> None: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def stop(self, timeout_s: float = ...) -> None: ...


def spawn_until_ready(server: Spawnable, timeout_s: float) -> None:
    """Spawn ``server`` and wait until it answers; stopped again if that fails.

    Raises:
        BrokerError: it did not answer within ``timeout_s`` seconds (and what ``wait_ready``
            raises).
    """
    server.spawn()
    try:
        server.wait_ready(timeout_s)
    except BaseException:
        server.stop()
        raise


def signal_group(proc: subprocess.Popen[bytes] | None, signum: int) -> None:
    """Send ``signum`` to the process group of ``proc`` while ``proc`` runs (a group gone
    meanwhile is not an error)."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)


def node_properties(
    node_id: int,
    port: int,
    controller_port: int,
    voters: str,
    data_dir: Path,
    settings: dict[str, str],
    broker_port: int = 0,
) -> str:
    """The ``server.properties`` text of one combined broker + controller node on 127.0.0.1.

    Args:
        node_id: the node's id (``node.id``), also its id in ``voters``.
        port: the client listener (``PLAINTEXT``).
        controller_port: the controller listener (``CONTROLLER``).
        voters: the controller quorum, ``id@127.0.0.1:port,...`` (``controller.quorum.voters``).
        data_dir: ``log.dirs``.
        settings: further broker settings (:data:`SINGLE_NODE_SETTINGS`,
            :data:`CLUSTER_SETTINGS`).
        broker_port: a listener of its own for replication (``BROKER``); 0: brokers talk over
            the client listener.
    """
    listeners = [f"PLAINTEXT://127.0.0.1:{port}"]
    if broker_port:
        listeners.append(f"BROKER://127.0.0.1:{broker_port}")
    protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    if broker_port:
        protocols.append("BROKER:PLAINTEXT")
    return "\n".join(
        [
            "process.roles=broker,controller",
            f"node.id={node_id}",
            f"controller.quorum.voters={voters}",
            f"listeners={','.join(listeners)},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners={','.join(listeners)}",
            "controller.listener.names=CONTROLLER",
            f"listener.security.protocol.map={','.join(protocols)}",
            f"inter.broker.listener.name={'BROKER' if broker_port else 'PLAINTEXT'}",
            f"log.dirs={data_dir}",
            *(f"{key}={value}" for key, value in settings.items()),
            "log.flush.interval.ms=1000",
            "",
        ]
    )


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
        node_id: the node's id; :class:`LocalCluster` numbers its nodes 1, 2, 3.
        settings: broker settings (default :data:`SINGLE_NODE_SETTINGS`).
    """

    run_dir: Path
    libs: Path
    own_lifetime: bool = True
    heap_mb: int = 512
    port: int = 0
    node_id: int = 1
    settings: dict[str, str] = field(default_factory=lambda: dict(SINGLE_NODE_SETTINGS))
    controller_port: int = 0
    broker_port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The java process's id while this object started it, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "broker.pid"

    @property
    def gc_log_path(self) -> Path:
        """The broker's GC log (``logs/kafkaServer-gc.log``, as Kafka's own start script names
        it): one line per collection, its pauses in ms, wall-clock time stamps
        (:func:`streamproc.tools.broker_gc.pauses` reads it)."""
        return self.run_dir / "logs" / GC_LOG_NAME

    def _java(self, main: str, *args: str, jvm: tuple[str, ...] = ()) -> list[str]:
        """The command running Kafka's ``main`` with ``args``, ``jvm`` options added."""
        return [
            "java",
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 256)}m",
            *KAFKA_JVM_PERFORMANCE_OPTS,
            *jvm,
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.run_dir / 'logs'}",
            "-cp",
            f"{self.libs}/*",
            main,
            *args,
        ]

    def _broker_command(self) -> list[str]:
        """The broker's command: its config, and its GC log (:attr:`gc_log_path`)."""
        # the file name quoted: -Xlog splits at ":", and a --dir may hold one
        gc_log = f'-Xlog:gc:file="{self.gc_log_path}":time,tags:filecount=10,filesize=100M'
        return self._java("kafka.Kafka", str(self.run_dir / "server.properties"), jvm=(gc_log,))

    def start(self, timeout_s: float = 90.0) -> str:
        """Format storage, start the node, wait until it answers metadata requests.

        Returns:
            The bootstrap address ``127.0.0.1:PORT``.

        Raises:
            BrokerError: the broker exited or did not answer within ``timeout_s``; the message
                names the log file.
        """
        self.port = free_port()
        self.controller_port = free_port()
        self.prepare(_cluster_id(), f"{self.node_id}@127.0.0.1:{self.controller_port}")
        return self._launch(timeout_s)

    def prepare(self, cluster_id: str, voters: str) -> None:
        """Claim ``run_dir``, wipe its data and logs, write the config for the ports set on this
        object and format the storage for ``cluster_id`` (no process is started).

        Raises:
            BrokerError: the folder holds user files, or the storage tool failed.
        """
        self._claim_run_dir()
        for sub in ("data", "logs"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        (self.run_dir / "logs").mkdir(parents=True)
        props = self.run_dir / "server.properties"
        props.write_text(
            node_properties(
                self.node_id,
                self.port,
                self.controller_port,
                voters,
                self.run_dir / "data",
                self.settings,
                self.broker_port,
            )
        )
        (self.run_dir / "log4j2.properties").write_text(_LOG4J2)
        fmt = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
            capture_output=True,
            text=True,
            check=False,
        )
        if fmt.returncode != 0:
            raise BrokerError(f"kafka storage format failed: {fmt.stdout}{fmt.stderr}")

    def restart(self, timeout_s: float = 90.0) -> str:
        """Stop the broker and start it again on the same ports with the same data (for
        broker-restart failure tests). Returns the (unchanged) bootstrap address."""
        self.stop()
        return self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> str:
        spawn_until_ready(self, timeout_s)
        return self.bootstrap_servers

    def spawn(self) -> None:
        """Start the java process on the prepared config and data (does not wait)."""
        self._proc = spawn_logged(
            self._broker_command(),
            self.run_dir / "logs" / "stdout.log",
            self.own_lifetime,
        )
        self.pid_path.write_text(str(self._proc.pid))

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

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the node answers a metadata request with at least one broker.

        Raises:
            BrokerError: the process exited, or no answer within ``timeout_s`` seconds.
        """
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

    def kill(self) -> None:
        """``kill -9`` the node (no shutdown, as a crashed machine) and reap it; its data stays
        for :meth:`restart`. Idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)  # a stopped process dies only once continued
                os.killpg(pid, signal.SIGKILL)
            if self._proc is not None:
                self._proc.wait()
            else:
                terminate_pid(pid, 0.0)
        self._proc = None
        self.pid_path.unlink(missing_ok=True)

    def pause(self) -> None:
        """SIGSTOP the node (as a long GC pause or a hung disk): it keeps its sockets open and
        answers nothing until :meth:`resume`."""
        signal_group(self._proc, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the node (idempotent; harmless on a running node)."""
        signal_group(self._proc, signal.SIGCONT)

    @property
    def running(self) -> bool:
        """True while the java process started by this object runs (paused included)."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            terminate_pid(pid, timeout_s, self._proc)
        self._proc = None
        self.pid_path.unlink(missing_ok=True)


@dataclass
class LocalCluster:
    """A replicated Apache Kafka cluster of ``size`` KRaft nodes on 127.0.0.1.

    Every node is a combined broker + controller (:class:`LocalKafka`) in ``run_dir/node-<id>``;
    the controller quorum is all nodes, the settings :data:`CLUSTER_SETTINGS` (replication
    factor 3, ``min.insync.replicas`` 2). Clients reach node ``i`` on its own port; brokers
    replicate over a second listener per node. Usable as a context manager (start on enter,
    stop on exit, even on error)::

        with LocalCluster(run_dir, ensure_kafka_jars()) as cluster:
            cluster.bootstrap_servers          # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
            cluster.node(2).kill()             # the fault injector uses these (nemesis.py)

    Args:
        run_dir: the cluster's state folder (one subfolder per node; the same rules as
            :class:`LocalKafka`'s folder).
        libs: folder of Kafka jars from :func:`ensure_kafka_jars`.
        size: number of nodes (at least 3 for replication factor 3).
        heap_mb: Java heap of each node, in MiB.
        own_lifetime: kill the nodes when the starting thread dies (tests).
    """

    run_dir: Path
    libs: Path
    size: int = 3
    heap_mb: int = 320
    own_lifetime: bool = True
    nodes: list[LocalKafka] = field(default_factory=list)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        """The node with id ``node_id`` (1 .. size).

        Raises:
            KeyError: no such node.
        """
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} (nodes: 1..{len(self.nodes)})")

    def start(self, timeout_s: float = 180.0) -> str:
        """Format every node for one new cluster id, start them all, wait until each answers.

        Returns:
            The bootstrap list of every node's client address.

        Raises:
            BrokerError: a node failed to format or start (every node is then stopped).
        """
        if self.size < 1:
            raise BrokerError(f"size: a cluster needs at least one node, got {self.size}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / MARKER).write_text("state folder of a local Apache Kafka cluster\n")
        self.nodes = [
            LocalKafka(
                self.run_dir / f"node-{node_id}",
                self.libs,
                own_lifetime=self.own_lifetime,
                heap_mb=self.heap_mb,
                port=free_port(),
                node_id=node_id,
                settings=dict(CLUSTER_SETTINGS),
                controller_port=free_port(),
                broker_port=free_port(),
            )
            for node_id in range(1, self.size + 1)
        ]
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        cluster_id = _cluster_id()
        try:
            for node in self.nodes:
                node.prepare(cluster_id, voters)
            for node in self.nodes:  # all at once: no node is ready before a quorum exists
                node.spawn()
            deadline_s = time.monotonic() + timeout_s
            for node in self.nodes:
                node.wait_ready(max(1.0, deadline_s - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self.bootstrap_servers

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every node (SIGCONT first, then SIGTERM, SIGKILL after ``timeout_s``)."""
        for node in self.nodes:
            node.resume()
            node.stop(timeout_s)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def broker_unless_given(bootstrap: str | None, directory: Path) -> Iterator[str]:
    """``bootstrap`` when given; else a :class:`LocalKafka` in ``directory``, started for the
    ``with`` block and stopped after it. Yields the broker address."""
    if bootstrap:
        yield bootstrap
        return
    broker = LocalKafka(directory, ensure_kafka_jars())
    try:
        yield broker.start()
    finally:
        broker.stop()


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
