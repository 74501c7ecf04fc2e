"""Helpers for tests/k8s: kubectl and helm, pods, the consumer group as the broker sees it, replays
in the background, and the partition ownership that the pods' own logs record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient

from streamproc.tools.replay import produce

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "streamproc"
VALUES = ROOT / "deploy" / "k8s" / "values"
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "")
HELM = os.environ.get("HELM", "helm")
T = TypeVar("T")


def run(cmd: list[str], *, stdin: str | None = None, timeout_s: float = 600) -> str:
    """Runs CMD; its stdout, or AssertionError with its output when it fails."""
    result = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def kubectl(*args: str, stdin: str | None = None, timeout_s: float = 600) -> str:
    return run(["kubectl", *args], stdin=stdin, timeout_s=timeout_s)


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json"))


def helm(*args: str, timeout_s: float = 900) -> str:
    return run([HELM, *args], timeout_s=timeout_s)


def wait_for(
    what: str,
    condition: Callable[[], T],
    timeout_s: float,
    every_s: float = 1.0,
    diagnose: str | None = None,
) -> T:
    """Polls CONDITION until it returns something truthy (returned); fails after TIMEOUT_S,
    with :func:`diagnosis` of the namespace DIAGNOSE when given (pods, events, logs)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() > deadline:
            message = f"timed out after {timeout_s:.0f} s waiting for {what} ({last!r})"
            if diagnose is not None:
                message += f"\n{diagnosis(diagnose)}"
            raise AssertionError(message)
        time.sleep(every_s)


def diagnosis(namespace: str) -> str:
    """What a failed wait in NAMESPACE needs to be understood: its pods, deployments and events,
    the description of every pod that is not Ready and the last log lines of each of its
    containers (the previous instance's too). Best effort: a command that fails says so."""

    def attempt(*args: str) -> str:
        try:
            return kubectl(*args, timeout_s=60)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"(kubectl {' '.join(args)} failed: {exc})"

    parts = [
        attempt("get", "pods,deployments,replicasets", "-n", namespace, "-o", "wide"),
        attempt("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
    ]
    try:
        listed = kubectl_json("get", "pods", "-n", namespace)["items"]
        unready = [p for p in listed if not is_ready(p)]
    except AssertionError as exc:
        unready, parts = [], [*parts, str(exc)]
    for pod in unready:
        name = pod["metadata"]["name"]
        parts.append(attempt("describe", "pod", "-n", namespace, name))
        for container in pod["spec"]["containers"]:
            for previous in ("false", "true"):
                logs = attempt("logs", "-n", namespace, name, "-c", container["name"],
                               f"--previous={previous}", "--tail=60")  # fmt: skip
                parts.append(f"--- {name}/{container['name']} (previous={previous}):\n{logs}")
    return "\n".join(parts)


# --- pods -----------------------------------------------------------------------------------------
def pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching SELECTOR that are not being deleted."""
    items = kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def condition_time(pod: dict[str, Any], kind: str) -> datetime | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c["type"] == kind and c["status"] == "True":
            return datetime.fromisoformat(c["lastTransitionTime"])
    return None


def restarts(pod: dict[str, Any]) -> int:
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses", []))


def all_ready(namespace: str, selector: str, count: int) -> list[dict[str, Any]] | None:
    found = pods(namespace, selector)
    if len(found) == count and all(is_ready(p) for p in found):
        return found
    return None


def exec_python(namespace: str, pod: str, code: str) -> str:
    return kubectl("exec", "-n", namespace, pod, "--", "python", "-c", code)


def container_host_pid(pod: dict[str, Any]) -> int:
    """The host pid of the pod's first container (from the node's containerd)."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    tasks = run(
        ["ctr", "--address", os.environ["STREAMPROC_K8S_CONTAINERD"], "-n", "k8s.io", "tasks", "ls"]
    )
    for line in tasks.splitlines()[1:]:
        task, pid, _status = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no task {container_id} on the node")


def wedge(pid: int) -> None:
    """Freezes a process the way a hung one looks from outside: SIGSTOP."""
    os.kill(pid, signal.SIGSTOP)


# --- the broker ---------------------------------------------------------------------------------
def group_assignment(group: str, by: str = "host") -> dict[str, set[tuple[str, int]]]:
    """Member -> partitions, as the group coordinator has them now; the member named by its
    host (the pod's IP; ``by="host"``) or its static group instance id (``by="instance"``)."""
    # log_level 4: not librdkafka's notice of the purged background queue at every close
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP, "log_level": 4})
    description = admin.describe_consumer_groups([group])[group].result(timeout=20)
    return {
        (member.host.lstrip("/") if by == "host" else str(member.group_instance_id)): {
            (tp.topic, tp.partition) for tp in member.assignment.topic_partitions
        }
        for member in description.members
    }


class Replay(threading.Thread):
    """``streamproc produce`` (the replay of real recorded data) in the background; setting
    ``stopping`` ends it early (``finish`` then returns the count sent)."""

    def __init__(
        self,
        workload: str,
        topic: str,
        limit: int,
        rate: float | None,
        transaction_size: int | None = None,
        partitions: int = 4,
        spread: bool = False,
    ) -> None:
        super().__init__(daemon=True, name=f"replay-{workload}")
        self.args = (workload, topic, BOOTSTRAP, partitions, limit, rate, False)
        self.options: dict[str, Any] = {"transaction_size": transaction_size, "spread": spread}
        self.stopping = threading.Event()
        self.count = 0
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.count = produce(*self.args, stop=self.stopping, **self.options)
        except BaseException as exc:  # re-raised in the test's thread by finish()
            self.error = exc

    def finish(self, timeout_s: float = 300) -> int:
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.name} still running after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.count


# --- partition ownership from the pods' logs ----------------------------------------------------
@dataclass
class Ownership:
    pod: str
    start: float
    end: float


@dataclass
class _Stream:
    lines: list[str] = field(default_factory=list)
    ended: float | None = None


class LogFollower:
    """Follows the logs of every pod matching SELECTOR (``kubectl logs -f``), including pods
    created while it runs, and turns the "partitions assigned/revoked/lost" events into ownership
    intervals. A pod whose stream ends while it still owns partitions owns them until the end of
    its stream (an upper bound: the stream outlives the process)."""

    def __init__(self, namespace: str, selector: str) -> None:
        self.namespace, self.selector = namespace, selector
        self.streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # the running `kubectl logs -f` of each pod; stop() ends them (guarded by _lock)
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                names = [p["metadata"]["name"] for p in pods(self.namespace, self.selector)]
            except AssertionError:
                names = []
            for name in names:
                if name not in self.streams:
                    self.streams[name] = _Stream()
                    thread = threading.Thread(target=self._follow, args=(name,), daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._stop.wait(0.5)

    def _follow(self, pod: str) -> None:
        stream = self.streams[pod]
        while not self._stop.is_set():
            if self._stream_once(pod, stream) is not False:
                break  # it logged (or stop() ended it)
            time.sleep(0.5)  # container not started yet
            try:
                kubectl("get", "pod", "-n", self.namespace, pod)
            except AssertionError:
                break  # gone before it logged anything
        stream.ended = time.time()

    def _stream_once(self, pod: str, stream: _Stream) -> bool | None:
        """One ``kubectl logs -f`` of POD into STREAM until it ends: whether it ended well (a
        line or exit 0), None when stop() ended it. The pipe is closed and the process reaped
        here, whatever happens."""
        with self._lock:
            if self._stop.is_set():
                return None
            proc = subprocess.Popen(
                ["kubectl", "logs", "-f", "-n", self.namespace, pod],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._procs[pod] = proc
        got = False
        with proc:  # closes stdout and waits for the process on the way out
            assert proc.stdout is not None
            for line in proc.stdout:
                got = True
                stream.lines.append(line)
        with self._lock:
            self._procs.pop(pod, None)
        if self._stop.is_set():
            return None
        return got or proc.returncode == 0

    def stop(self, timeout_s: float = 30) -> None:
        """Ends every ``kubectl logs -f`` (their pipes closed, the processes reaped) and joins the
        threads; the streams keep what they read."""
        self._stop.set()
        self._watcher.join(timeout_s)
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [self._watcher, *self._threads] if t.is_alive()]
        assert not alive, f"log followers still running after {timeout_s:.0f} s: {alive}"

    def events(self, pod: str) -> list[dict[str, Any]]:
        out = []
        for line in self.streams[pod].lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "timestamp" in event:
                out.append(event)
        return out

    def first_assignment(self, pod: str) -> float | None:
        for event in self.events(pod):
            if event.get("event") == "partitions assigned" and event.get("partitions"):
                return datetime.fromisoformat(event["timestamp"]).timestamp()
        return None

    def ownership(self) -> dict[str, list[Ownership]]:
        """Partition ("topic[p]") -> who owned it when."""
        owned: dict[str, list[Ownership]] = {}
        for pod, stream in self.streams.items():
            open_since: dict[str, float] = {}
            for event in self.events(pod):
                when = datetime.fromisoformat(event["timestamp"]).timestamp()
                kind = event.get("event")
                if kind not in ("partitions assigned", "partitions revoked", "partitions lost"):
                    continue
                for partition in event["partitions"]:
                    if kind == "partitions assigned":
                        open_since.setdefault(partition, when)
                    elif (
                        kind in ("partitions revoked", "partitions lost")
                        and partition in open_since
                    ):
                        start = open_since.pop(partition)
                        owned.setdefault(partition, []).append(Ownership(pod, start, when))
            end = stream.ended or time.time()
            for partition, start in open_since.items():
                owned.setdefault(partition, []).append(Ownership(pod, start, end))
        return owned


def overlaps(owned: dict[str, list[Ownership]]) -> list[str]:
    """Every moment two pods owned the same partition."""
    found = []
    for partition, spans in owned.items():
        spans = sorted(spans, key=lambda s: s.start)
        for i, a in enumerate(spans):
            for b in spans[i + 1 :]:
                if b.pod != a.pod and b.start < a.end:
                    found.append(
                        f"{partition}: {a.pod} [{a.start:.3f}, {a.end:.3f}] and "
                        f"{b.pod} [{b.start:.3f}, {b.end:.3f}]"
                    )
    return found


class StuckMember(threading.Thread):
    """A member of GROUP outside the chart, subscribed to TOPIC, that pauses every partition it
    is given and never commits: those partitions are stuck, as behind a member stuck on one
    record. It keeps polling (so it stays in the group) until :meth:`leave`."""

    def __init__(self, group: str, topic: str) -> None:
        super().__init__(daemon=True, name="stuck-member")
        self.owned: list[tuple[str, int]] = []
        self._leaving = threading.Event()  # not _stop: threading.Thread has a _stop method
        self._consumer = Consumer(
            {
                "bootstrap.servers": BOOTSTRAP,
                "group.id": group,
                "partition.assignment.strategy": "cooperative-sticky",
                "enable.auto.commit": False,
                "log_level": 4,
            }
        )
        self._consumer.subscribe([topic], on_assign=self._assigned)
        self.start()

    def _assigned(self, consumer: Consumer, parts: list[KafkaTopicPartition]) -> None:
        consumer.incremental_assign(parts)
        consumer.pause(parts)
        self.owned.extend((p.topic, p.partition) for p in parts)

    def run(self) -> None:
        while not self._leaving.is_set():
            self._consumer.consume(1, 0.5)  # paused: nothing comes; the group sees it alive
        self._consumer.close()  # leaves the group: its partitions go to the chart's pods

    def leave(self) -> None:
        self._leaving.set()
        self.join(60)
