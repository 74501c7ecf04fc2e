"""How long partitions go without results while the group changes: scale 1 -> 3, a rolling
restart of the three, scale 3 -> 1; per group protocol (``classic``, ``consumer``) and with
and without static membership (``kafka.group_instance_id``).

Usage (from a checkout's root, with its .venv; a local broker is started unless
``--bootstrap`` or ``$KAFKA_BOOTSTRAP_SERVERS`` names one)::

    .venv/bin/python benchmarks/rebalance_gaps.py --runs 1

A paced replay of trades (``--rate`` msg/s over ``PARTITIONS`` partitions) runs for the whole of
each variant while ``streamproc run`` processes join and leave the group as a deployment's pods
would: members are started (as pods are scheduled), stopped with SIGTERM (as Kubernetes stops
a pod) and, in the rolling restart, started again under the same instance id (a StatefulSet
pod keeps its name), the highest first, each after the previous one is ready (``/readyz``).
Results carry their source partition (``streamproc.source.partition`` header); per phase and
input partition the script takes the longest stretch without a result (the output record
timestamps) and reports the longest over the partitions and the partition-seconds spent in
stretches over ``--gap-s`` (unowned, or owned by a member not yet consuming). At ``--rate``
60 msg/s a partition that is owned and consuming gets a result about every 0.1 s.

Each variant runs ``--runs`` times (variants alternate); the summary prints per variant and
phase the median [min-max] over the runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_PARTITION
from streamproc.tools.bench.measure import format_spread
from streamproc.tools.kafka_local import broker_unless_given, free_port
from streamproc.tools.replay import produce
from streamproc.tools.verify import TopicDump, read_topic

PARTITIONS = 6
MEMBERS = 3
VARIANTS = (
    ("classic", False),
    ("classic", True),
    ("consumer", False),
    ("consumer", True),
)
"""(group protocol, static membership)."""


@dataclass
class Row:
    """One phase of one run of one variant (seconds)."""

    protocol: str
    static: bool
    run: int
    phase: str
    longest_gap_s: float
    unowned_partition_s: float

    @property
    def variant(self) -> str:
        return f"{self.protocol}{' static' if self.static else ''}"


@dataclass
class Member:
    """One ``streamproc run`` process of the group."""

    index: int
    port: int
    proc: subprocess.Popen[bytes] | None = None


class Group:
    """The consumer processes of one variant, started and stopped as pods would be."""

    def __init__(
        self, config: dict[str, object], static: bool, work: Path, ready_timeout_s: float
    ) -> None:
        self._config = config
        self._static = static
        self._work = work
        self._ready_timeout_s = ready_timeout_s
        self.members = [Member(i, free_port()) for i in range(MEMBERS)]

    def start(self, member: Member) -> None:
        config = {**self._config, "metrics": {"port": member.port}}
        path = self._work / f"member{member.index}.json"  # YAML is a superset of JSON
        path.write_text(json.dumps(config))
        env = {**os.environ, "STREAMPROC_INSTANCE_ID": f"member-{member.index}"}
        if self._static:
            env["STREAMPROC_KAFKA__GROUP_INSTANCE_ID"] = f"member-{member.index}"
        with open(self._work / f"member{member.index}.log", "ab") as log:
            member.proc = subprocess.Popen(
                [sys.executable, "-m", "streamproc", "run", "--config", str(path)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, member: Member) -> None:
        """Until the member's ``/readyz`` answers 200 (it owns partitions and runs)."""
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            assert member.proc is not None
            if member.proc.poll() is not None:
                raise RuntimeError(f"member {member.index} exited with {member.proc.returncode}")
            try:
                url = f"http://127.0.0.1:{member.port}/readyz"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)  # polling an HTTP probe of another process
        raise RuntimeError(f"member {member.index} not ready in {self._ready_timeout_s:.0f} s")

    def stop(self, members: Iterable[Member], timeout_s: float = 120.0) -> None:
        """SIGTERM, then wait for each to exit (as a pod's termination)."""
        members = list(members)
        for member in members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGTERM)
        for member in members:
            if member.proc is not None:
                try:
                    member.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait()
                member.proc = None


def gaps(
    results: TopicDump, start_ms: int, end_ms: int, partitions: int, gap_s: float
) -> tuple[float, float]:
    """Per input partition, the stretches without a result within ``[start_ms, end_ms]``:
    the longest over the partitions, and the sum of those longer than ``gap_s`` (seconds)."""
    stamps: dict[int, list[int]] = {p: [] for p in range(partitions)}
    for _, _, headers, ts in results.records.values():
        if start_ms <= ts <= end_ms and H_PARTITION in headers:
            stamps[int(headers[H_PARTITION])].append(ts)
    longest = 0.0
    unowned = 0.0
    for series in stamps.values():
        edges = [start_ms, *sorted(series), end_ms]
        for a, b in itertools.pairwise(edges):
            stretch = (b - a) / 1000.0
            longest = max(longest, stretch)
            if stretch > gap_s:
                unowned += stretch
    return longest, unowned


def run_variant(
    args: argparse.Namespace, bootstrap: str, protocol: str, static: bool, run: int, work: Path
) -> list[Row]:
    """One variant: 1 member, scale to 3, rolling restart, scale to 1; a row per phase."""
    suffix = uuid.uuid4().hex[:6]
    topic = f"gaps.{suffix}"
    ensure_topics(bootstrap, {topic: PARTITIONS, f"{topic}.out": PARTITIONS})
    config: dict[str, object] = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": f"gaps-{suffix}",
            "group_protocol": protocol,
        },
        "pipelines": [
            {
                "name": "t",
                "input_topic": topic,
                "output_topic": f"{topic}.out",
                "workload": "trades",
            }
        ],
    }
    where = work / f"{protocol}-{'static' if static else 'dynamic'}-{run}"
    where.mkdir()
    group = Group(config, static, where, args.ready_timeout_s)
    first, *others = group.members
    stop = threading.Event()
    replay = threading.Thread(
        # every partition in turn: the 4 symbol keys would hash onto fewer partitions than
        # the group has members
        target=produce,
        args=("trades", topic, bootstrap, PARTITIONS, int(args.rate * 3600), args.rate, False),
        kwargs={"stop": stop, "spread": True},
        name="replay",
    )
    phases: list[tuple[str, int, int]] = []
    try:
        group.start(first)
        group.wait_ready(first)
        replay.start()
        time.sleep(args.settle_s)  # steady state before the first change (paced input)
        begin = int(time.time() * 1000)
        for member in others:
            group.start(member)
        for member in others:
            group.wait_ready(member)
        time.sleep(args.settle_s)
        phases.append(("scale 1->3", begin, int(time.time() * 1000)))
        begin = int(time.time() * 1000)
        for member in reversed(group.members):  # a StatefulSet rolls the highest ordinal first
            group.stop([member])
            group.start(member)
            group.wait_ready(member)
        time.sleep(args.settle_s)
        phases.append(("rolling restart", begin, int(time.time() * 1000)))
        begin = int(time.time() * 1000)
        group.stop(others)
        time.sleep(args.scale_down_s)
        phases.append(("scale 3->1", begin, int(time.time() * 1000)))
    finally:
        stop.set()
        if replay.is_alive():
            replay.join(60)
        group.stop(group.members)
    results = read_topic(bootstrap, f"{topic}.out")
    seen = {int(h[H_PARTITION]) for _, _, h, _ in results.records.values() if H_PARTITION in h}
    if seen != set(range(PARTITIONS)):
        raise RuntimeError(f"results for partitions {sorted(seen)} only (logs: {where})")
    rows = []
    for phase, start_ms, end_ms in phases:
        longest, unowned = gaps(results, start_ms, end_ms, PARTITIONS, args.gap_s)
        rows.append(Row(protocol, static, run, phase, longest, unowned))
    return rows


def summary(rows: list[Row]) -> str:
    """Per variant and phase: median [min-max] over the runs."""
    lines = [
        f"{'variant':<16} {'phase':<16} {'longest gap s':>22} {'unowned partition-s':>24}",
    ]
    keys = dict.fromkeys((r.variant, r.phase) for r in rows)
    for variant, phase in keys:
        mine = [r for r in rows if (r.variant, r.phase) == (variant, phase)]
        longest = format_spread([r.longest_gap_s for r in mine])
        unowned = format_spread([r.unowned_partition_s for r in mine])
        lines.append(f"{variant:<16} {phase:<16} {longest:>22} {unowned:>24}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--rate", type=float, default=60.0, help="input msg/s (all partitions)")
    parser.add_argument("--settle-s", type=float, default=15.0, help="steady time per phase")
    parser.add_argument(
        "--scale-down-s", type=float, default=75.0, help="window after the scale-down"
    )
    parser.add_argument("--gap-s", type=float, default=1.0, help="a stretch longer is counted")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--variants", default="all", help="comma list of protocol[:static], or all")
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--out", help="append each row to this file (JSON lines)")
    parser.add_argument("--work", help="keep the members' configs and logs in this folder")
    args = parser.parse_args(argv)
    variants = list(VARIANTS)
    if args.variants != "all":
        wanted = [v.split(":") for v in args.variants.split(",")]
        variants = [(w[0], len(w) > 1 and w[1] == "static") for w in wanted]
    rows: list[Row] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="streamproc-gaps-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        with broker_unless_given(args.bootstrap, work / "kafka") as bootstrap:
            for run in range(1, args.runs + 1):
                for protocol, static in variants:
                    for row in run_variant(args, bootstrap, protocol, static, run, work):
                        rows.append(row)
                        print(
                            f"run {run} {row.variant:<16} {row.phase:<16} longest gap "
                            f"{row.longest_gap_s:6.1f} s, unowned {row.unowned_partition_s:6.1f}"
                            " partition-s",
                            flush=True,
                        )
                        if args.out:
                            with open(args.out, "a") as out:
                                out.write(json.dumps(asdict(row)) + "\n")
    print(summary(rows))
    print(
        f"({args.runs} run(s); input {args.rate:g} msg/s over {PARTITIONS} partitions; "
        f"gaps over {args.gap_s:g} s counted; total {time.monotonic() - started:.0f} s; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})"
    )


if __name__ == "__main__":
    main()
