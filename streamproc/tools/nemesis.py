"""A fault injector ("nemesis") for a local replicated cluster (:class:`LocalCluster`).

It finds the node that matters (the leader of a partition, the active controller, the
transaction coordinator of a transactional id, the group coordinator of a consumer group) and
injects one fault into it:

* ``kill``: ``kill -9`` the node (a crashed machine); undone by restarting it on the same ports
  and data;
* ``pause``: SIGSTOP the node (a long GC pause, a hung disk): it holds its sockets and answers
  nothing; undone by SIGCONT;
* ``cut``: drop every client packet to and from the node's client port on the loopback
  interface (iptables): clients lose their route to it while the brokers still replicate over
  their own listener; undone by deleting the rules. Only loopback and only that port are
  touched; each rule carries the comment ``streamproc-nemesis-<pid>``.

Every fault is recorded until healed; :meth:`Nemesis.heal` undoes all of them (SIGCONT before
anything else), and the nemesis is a context manager that heals on exit, also on error::

    with Nemesis(cluster) as nemesis:
        victim = nemesis.leader_of("orders", 0)
        nemesis.kill(victim)
        ...
        nemesis.heal()        # restart, continue, reconnect: whatever was done
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import CLUSTER_SETTINGS, LocalCluster

FAULTS = ("kill", "pause", "cut")


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode`` of ``text`` (a signed 32-bit int, over UTF-16 code units)."""
    value = 0
    data = text.encode("utf-16-be")
    for index in range(0, len(data), 2):
        value = (31 * value + int.from_bytes(data[index : index + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of ``__consumer_offsets`` / ``__transaction_state`` that holds the state
    of group (or transactional id) ``key``: Kafka's ``Utils.abs(key.hashCode()) % partitions``.
    """
    value = java_string_hash(key)
    return (0 if value == -(1 << 31) else abs(value)) % partitions


@dataclass
class Nemesis:
    """Faults for the nodes of ``cluster``; see the module docstring.

    Args:
        cluster: a started :class:`LocalCluster`.
        restart_timeout_s: how long a restarted node may take to answer again.
    """

    cluster: LocalCluster
    restart_timeout_s: float = 180.0
    killed: set[int] = field(default_factory=set)
    paused: set[int] = field(default_factory=set)
    cut_off: set[int] = field(default_factory=set)

    # -- who -------------------------------------------------------------------------------
    def _admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.cluster.bootstrap_servers, "log_level": 0})

    def leader_of(self, topic: str, partition: int, timeout_s: float = 60.0) -> int:
        """The node id of the current leader of ``topic[partition]``.

        Raises:
            BrokerError: no leader known within ``timeout_s`` seconds.
        """
        admin = self._admin()
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            with contextlib.suppress(Exception):
                found = admin.list_topics(topic, timeout=5).topics[topic]
                leader = found.partitions[partition].leader
                if found.error is None and leader >= 0:
                    return int(leader)
            time.sleep(0.2)
        raise BrokerError(f"no leader of {topic}[{partition}] within {timeout_s:.0f} s")

    def isr(self, topic: str, timeout_s: float = 10.0) -> dict[int, list[int]]:
        """Each partition's in-sync replicas (node ids) of ``topic``."""
        found = self._admin().list_topics(topic, timeout=timeout_s).topics[topic]
        return {p: sorted(meta.isrs) for p, meta in found.partitions.items()}

    def controller(self) -> int:
        """The node id of the active controller (the KRaft quorum's leader): the leader of the
        highest epoch in the quorum state of the running nodes.

        Raises:
            BrokerError: no running node knows a leader.
        """
        best: tuple[int, int] | None = None
        for node in self.cluster.nodes:
            if not node.running:
                continue
            path = node.run_dir / "data" / "__cluster_metadata-0" / "quorum-state"
            with contextlib.suppress(OSError, ValueError, KeyError):
                state = json.loads(path.read_text())
                epoch, leader = int(state["leaderEpoch"]), int(state["leaderId"])
                if leader >= 0 and (best is None or epoch > best[0]):
                    best = (epoch, leader)
        if best is None:
            raise BrokerError("no running node knows the controller quorum's leader")
        return best[1]

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The node id coordinating ``transactional_id`` (leader of its partition of
        ``__transaction_state``)."""
        count = int(CLUSTER_SETTINGS["transaction.state.log.num.partitions"])
        partition = coordinator_partition(transactional_id, count)
        return self.leader_of("__transaction_state", partition)

    def group_coordinator(self, group_id: str, timeout_s: float = 30.0) -> int:
        """The node id coordinating consumer group ``group_id`` (as the broker says).

        Raises:
            BrokerError: the cluster did not name it within ``timeout_s`` seconds.
        """
        admin = self._admin()
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            with contextlib.suppress(Exception):
                future = admin.describe_consumer_groups([group_id])[group_id]
                return int(future.result(timeout=5).coordinator.id)
            time.sleep(0.2)
        raise BrokerError(f"no coordinator of group {group_id!r} within {timeout_s:.0f} s")

    # -- faults ----------------------------------------------------------------------------
    def kill(self, node_id: int) -> None:
        """``kill -9`` node ``node_id`` (restarted by :meth:`restart` or :meth:`heal`)."""
        self.cluster.node(node_id).kill()
        self.killed.add(node_id)
        self.paused.discard(node_id)

    def restart(self, node_id: int) -> None:
        """Start a killed node again on its ports and data; wait until it answers."""
        self.cluster.node(node_id).restart(self.restart_timeout_s)
        self.killed.discard(node_id)

    def pause(self, node_id: int) -> None:
        """SIGSTOP node ``node_id`` (continued by :meth:`resume` or :meth:`heal`)."""
        self.paused.add(node_id)
        self.cluster.node(node_id).pause()

    def resume(self, node_id: int) -> None:
        """SIGCONT node ``node_id``."""
        self.cluster.node(node_id).resume()
        self.paused.discard(node_id)

    def cut(self, node_id: int) -> None:
        """Drop every client packet to and from node ``node_id``'s client port on loopback.

        Raises:
            BrokerError: iptables is missing or refused the rule (not root).
        """
        port = self.cluster.node(node_id).port
        self.cut_off.add(node_id)
        for rule in _cut_rules(port):
            _iptables("-I", rule)

    def reconnect(self, node_id: int) -> None:
        """Delete the rules of :meth:`cut` for node ``node_id``."""
        port = self.cluster.node(node_id).port
        for rule in _cut_rules(port):
            with contextlib.suppress(BrokerError):
                while True:  # a rule inserted twice is deleted twice
                    _iptables("-D", rule)
        self.cut_off.discard(node_id)

    def inject(self, fault: str, node_id: int) -> None:
        """Inject ``fault`` (one of :data:`FAULTS`) into node ``node_id``.

        Raises:
            ValueError: unknown fault.
        """
        actions = {"kill": self.kill, "pause": self.pause, "cut": self.cut}
        if fault not in actions:
            raise ValueError(f"fault: unknown {fault!r}; allowed: {list(FAULTS)}")
        actions[fault](node_id)

    def heal(self) -> None:
        """Undo every fault still in place: continue paused nodes, reconnect cut ones, restart
        killed ones (together, so two restarted nodes form a quorum again)."""
        for node_id in sorted(self.paused):
            self.resume(node_id)
        for node_id in sorted(self.cut_off):
            self.reconnect(node_id)
        killed = sorted(self.killed)
        for node_id in killed:
            self.cluster.node(node_id).spawn()
        deadline_s = time.monotonic() + self.restart_timeout_s
        for node_id in killed:
            self.cluster.node(node_id).wait_ready(max(1.0, deadline_s - time.monotonic()))
            self.killed.discard(node_id)

    @contextlib.contextmanager
    def fault(self, fault: str, *node_ids: int) -> Iterator[None]:
        """Inject ``fault`` into every node of ``node_ids`` for the body; heal after it."""
        try:
            for node_id in node_ids:
                self.inject(fault, node_id)
            yield
        finally:
            self.heal()

    def __enter__(self) -> Nemesis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()


def _cut_rules(port: int) -> list[list[str]]:
    """The iptables rules (chain OUTPUT, interface lo) that drop a client port's traffic."""
    comment = ["-m", "comment", "--comment", f"streamproc-nemesis-port-{port}"]
    return [
        ["OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port), *comment, "-j", "DROP"],
        ["OUTPUT", "-o", "lo", "-p", "tcp", "--sport", str(port), *comment, "-j", "DROP"],
    ]


def _iptables(action: str, rule: list[str]) -> None:
    binary = shutil.which("iptables")
    if binary is None:
        raise BrokerError("iptables not found: install it (Debian: apt-get install iptables)")
    done = subprocess.run([binary, "-w", action, *rule], capture_output=True, text=True)
    if done.returncode != 0:
        raise BrokerError(f"iptables {action} {' '.join(rule)}: {done.stderr.strip()}")
