"""Exactly-once: how long read_committed readers of the output wait after a process is killed
-9 and started again at once: restart -> first new result visible to a read_committed reader.

Usage (from a checkout's root, with its .venv; a local broker is started unless
``--bootstrap`` or ``$KAFKA_BOOTSTRAP_SERVERS`` names one)::

    .venv/bin/python benchmarks/eos_restart.py --runs 3 [--checkout /path/to/other/checkout]

``--checkout``: the consumer runs that checkout's package (``PYTHONPATH``), so one script
measures the code before and after a change. Variants:

* ``default``: no id set by hand (no ``kafka.transactional_id``, no ``STREAMPROC_INSTANCE_ID``):
  the restart gets whatever id the checkout's default gives it;
* ``fresh``: the restart gets a ``kafka.transactional_id`` never used before (what one fresh id
  per process would do): nobody aborts the killed process's open transaction, the broker does
  after ``transaction.timeout.ms``.

A paced replay of iot (``--rate`` msg/s over 6 partitions) runs throughout; one ``streamproc
run`` consumes it (``kafka.session_timeout_ms`` 6000, the broker's minimum, so the dead
member leaves the group soon and the rebalance does not hide the transaction's effect). Once
``--warm`` results are visible, the consumer is killed -9 and started again at once; a
read_committed reader of the output notes when the first result produced after the restart
(record timestamp) arrives, and when every output partition that had results before the kill
has delivered one (a partition where a transaction is still open delivers nothing past it).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.replay import produce

PARTITIONS = 6


class Reader:
    """A read_committed reader of every partition of ``topic`` from the beginning, on a thread
    of its own; notes (arrival monotonic s, record timestamp ms) of each record."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        self._consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)]
        )
        self.seen: list[tuple[float, int, int]] = []  # (arrival s, timestamp ms, partition)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self._consumer.consume(500, 0.1):
                partition = msg.partition()
                if msg.error() is None and partition is not None:
                    self.seen.append((time.monotonic(), msg.timestamp()[1], partition))

    def first_after(self, epoch_ms: int) -> float | None:
        """Arrival (monotonic s) of the first record with a timestamp >= ``epoch_ms``."""
        return next((at for at, ts, _ in list(self.seen) if ts >= epoch_ms), None)

    def every_partition_after(self, epoch_ms: int) -> float | None:
        """Arrival (monotonic s) by which every partition that delivered records before
        ``epoch_ms`` had delivered one with a timestamp >= ``epoch_ms`` (a partition held at
        an open transaction delivers none); None until then."""
        before: set[int] = set()
        firsts: dict[int, float] = {}
        for at, ts, partition in list(self.seen):
            if ts >= epoch_ms:
                firsts.setdefault(partition, at)
            else:
                before.add(partition)
        return max(firsts.values()) if before and before <= firsts.keys() else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def consumer(
    config: Path, log: Path, checkout: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``streamproc run`` of ``checkout``'s package, output appended to ``log``."""
    base = {k: v for k, v in os.environ.items() if k != "STREAMPROC_INSTANCE_ID"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "streamproc", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**base, "PYTHONPATH": str(checkout), **env},
            cwd=checkout,
        )


def one_run(
    bootstrap: str, checkout: Path, variant: str, rate: float, warm: int
) -> tuple[float, float]:
    """Seconds from the restart to the first new result visible read_committed, and to new
    results visible on every output partition."""
    suffix = uuid.uuid4().hex[:8]
    source, output, group = f"iot.{suffix}", f"scores.{suffix}", f"g-{suffix}"
    ensure_topics(bootstrap, {source: PARTITIONS, output: PARTITIONS})
    work = Path(tempfile.mkdtemp(prefix="eos-restart-"))
    config = work / "c.yaml"
    pipeline = {"name": "p", "input_topic": source, "output_topic": output, "workload": "iot"}
    config.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group,
                          "session_timeout_ms": 6000},
                "pipelines": [pipeline],
                "processing_guarantee": "exactly_once",
                "metrics": {"port": 0},
            }
        )
    )  # fmt: skip
    stop = threading.Event()
    replay = threading.Thread(
        target=produce,
        args=("iot", source, bootstrap, PARTITIONS, 10**7, rate),
        kwargs={"progress": False, "stop": stop},
        daemon=True,
    )
    replay.start()
    reader = Reader(bootstrap, output)
    log = work / "consumer.log"
    first = consumer(config, log, checkout, {})
    restarted: subprocess.Popen[bytes] | None = None
    try:
        while len(reader.seen) < warm:
            if first.poll() is not None:
                raise RuntimeError(f"consumer exited {first.returncode}: {log}")
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        env = (
            {"STREAMPROC_KAFKA__TRANSACTIONAL_ID": f"fresh-{suffix}"} if variant == "fresh" else {}
        )
        restart_s, restart_ms = time.monotonic(), int(time.time() * 1000)
        restarted = consumer(config, log, checkout, env)
        while (every_s := reader.every_partition_after(restart_ms)) is None:
            if restarted.poll() is not None:
                raise RuntimeError(f"restarted consumer exited {restarted.returncode}: {log}")
            if time.monotonic() - restart_s > 300:
                raise RuntimeError(f"no result 300 s after the restart: {log}")
            time.sleep(0.05)
        first_s = reader.first_after(restart_ms)
        assert first_s is not None
        return first_s - restart_s, every_s - restart_s
    finally:
        stop.set()
        for proc in (first, restarted):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        reader.close()
        replay.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--checkout", type=Path, default=Path.cwd())
    parser.add_argument("--variants", nargs="+", default=["default", "fresh"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="input msg/s")
    parser.add_argument("--warm", type=int, default=300, help="results before the kill")
    args = parser.parse_args()
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

        broker = LocalKafka(
            Path(tempfile.mkdtemp(prefix="eos-restart-kafka-")), ensure_kafka_jars()
        )
        broker.start()
        bootstrap = broker.bootstrap_servers
    try:
        checkout = args.checkout.resolve()
        for variant in args.variants:
            times = [
                one_run(bootstrap, checkout, variant, args.rate, args.warm)
                for _ in range(args.runs)
            ]
            for what, values in (
                ("first new result", [t[0] for t in times]),
                ("new results on every partition", [t[1] for t in times]),
            ):
                print(
                    f"{checkout} {variant}: restart -> {what} visible read_committed: "
                    f"median {statistics.median(values):.1f} s "
                    f"[{', '.join(f'{t:.1f}' for t in values)}]",
                    flush=True,
                )
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
