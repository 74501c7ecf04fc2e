"""Overload (issue 41, item 4): a pipeline offered twice its capacity, then half of it, with a
deadline; every input accounted for from the broker, goodput, the served records' P99, recovery.

Usage (from a checkout's root, with its .venv; a local broker is started unless ``--bootstrap``
or ``$KAFKA_BOOTSTRAP_SERVERS`` names one)::

    .venv/bin/python -m benchmarks.overload --workload trades --workload iot --runs 5

Per run and workload, on fresh topics (4 partitions), three consumer processes one after the
other (``python -m streamproc run``, default settings but the ones named here; every one with
``pipelines[].latency_target_ms`` = ``--target-ms``), the producer (the
real recording, ``streamproc.tools.replay``) on the same machine:

1. *probe*: the recording produced as fast as the broker takes it for ``--probe-s`` seconds
   beside a consumer without a deadline: a first estimate c0 of the capacity (low: a flooding
   producer takes more CPU than a paced one).
2. *capacity*: no deadline, the replay offered open loop at ``--factor`` x c0 for
   ``--capacity-s`` seconds: capacity = results per second over the window (the most the
   consumer serves beside a producer at about the overload's rate: like is compared with like).
3. *overload*: ``pipelines[].max_age_ms`` = ``--max-age-ms`` (default: 3/4 of the target, so a
   record cut at its deadline still has a quarter of the target for its batch) and
   ``pipelines[].expire_when`` = ``--expire-when`` (default ``predicted``, the product's);
   ``--factor`` x the capacity offered for ``--overload-s`` seconds, then ``--after-factor`` x
   capacity for ``--after-s`` seconds; then SIGTERM (the consumer drains).

After the last phase the bench waits up to ``--drain-s`` seconds for the group to commit the end
of every partition. From the broker (read_committed): every input below the group's committed
offset has a result, an expired result (``streamproc.result.kind: expired``) or a dead-letter
record (``missing`` must be 0: a record committed without one is lost); ``undrained`` counts the
inputs not yet run when the drain timed out (not lost: at or past the committed offset, the
group's next consumer runs them); goodput =
results made by the model within ``--target-ms`` (output timestamp - input timestamp, both
CreateTime) per second of input in the overload window, as a share of the capacity; the served
records' P99 in the overload window; the share expired; the offered rate the producer reached;
goodput per CPU second: the results made within the target while the overload was offered, per
CPU second of the consumer (its process and children, ``/proc``) then, as a share of the results
per CPU second in the capacity phase (what shedding costs the consumer's own work, apart from the
CPU the producer and the broker took from it on a shared machine; the consumer's average cores
in both phases are printed beside it);
recovery = seconds after the overload ends until the first 1-s window of inputs from which on
every window is within the target: its P99 over every input (an expired or dead-lettered record
counts as over the target) at most the target; also printed, the stricter "every input" form
(every input of every window served within the target, nothing expired). "never" when none is.
Per workload at the end: median [min-max] over the runs. ``--timeline SECONDS`` also prints,
per run, what became of the inputs per window of that many seconds from the overload's start
(shares served within the target, served later, expired, other): where the misses fall.
The broker's stop-the-world pauses, read from its GC log (the broker the bench starts writes
one; ``--broker-gc-log`` names another's, e.g. one turned on with ``jcmd <pid> VM.log``), are
printed beside them: per run the longest while overloaded and after, per timeline window the
longest in it. A record the broker holds back is late before the consumer sees it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from benchmarks.consumer_process import consumer, load_average
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_RESULT_KIND, KIND_EXPIRED
from streamproc.tools.bench.cpu import process_cpu_s
from streamproc.tools.bench.measure import format_spread
from streamproc.tools.broker_gc import Pause, pauses, within
from streamproc.tools.kafka_local import LocalKafka, broker_unless_given, free_port
from streamproc.tools.replay import produce
from streamproc.tools.verify import TopicDump, committed_offsets, read_topic

PARTITIONS = 4
DEFAULT_TARGET_MS = {"trades": 30.0, "iot": 60.0}


@dataclass
class Row:
    """One run of one workload (rates in msg/s, times in ms unless named _s)."""

    workload: str
    run: int
    capacity: float
    capacity_offered: float  # msg/s offered in the capacity phase (near capacity: it held back)
    offered: float
    inputs: int
    missing: int  # below the group's committed offset, yet no result, expired result or DLQ
    undrained: int  # not yet run when the drain timed out (at or above the committed offset)
    expired_share: float
    goodput: float
    goodput_share: float
    cpu_share: float  # goodput per consumer CPU second / capacity's results per CPU second
    cores_capacity: float  # the consumer's CPU seconds per second, capacity phase
    cores_overload: float  # and while the overload was offered
    served_p99_ms: float
    recovery_s: float  # inf: never back within the target (P99 over every input)
    recovery_all_s: float  # inf: never every input within the target (nothing expired)
    load: float
    broker_longest_ms: tuple[float, float] | None = None
    """The broker's longest stop-the-world pause while the overload was offered and in the
    phase after it (None: no GC log to read, ``--broker-gc-log``)."""


@dataclass(frozen=True)
class Outcome:
    """What became of one input: its timestamp (ms), result latency (ms; None when none) and
    whether it was expired or dead-lettered."""

    ts_ms: int
    partition: int
    offset: int
    latency_ms: float | None
    expired: bool
    dead_letter: bool


def outcomes(inputs: TopicDump, outputs: TopicDump, dead_letters: TopicDump) -> list[Outcome]:
    """One :class:`Outcome` per input record (inputs without any output have latency None and
    neither flag: they are missing)."""
    first: dict[tuple[int, int], tuple[int, bool]] = {}
    for _, _, headers, ts in outputs.records.values():
        coord = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        if coord not in first or ts < first[coord][0]:
            first[coord] = (ts, headers.get(H_RESULT_KIND) == KIND_EXPIRED)
    dead = {(int(h[H_PARTITION]), int(h[H_OFFSET])) for _, _, h, _ in dead_letters.records.values()}
    rows = []
    for coord, (_, _, _, ts) in inputs.records.items():
        out = first.get(coord)
        rows.append(
            Outcome(
                ts_ms=ts,
                partition=coord[0],
                offset=coord[1],
                latency_ms=None if out is None or out[1] else float(out[0] - ts),
                expired=out is not None and out[1],
                dead_letter=coord in dead,
            )
        )
    return rows


MISS_SHARE = 0.01
"""A window is within the target when at most this share of its inputs missed it: the target is
a P99."""


def recovery_s(
    rows: list[Outcome], end_ms: int, target_ms: float, miss_share: float = MISS_SHARE
) -> float:
    """Seconds from ``end_ms`` to the start of the first 1-s window of inputs after which every
    window is within ``target_ms``: at most ``miss_share`` of its inputs missed it (served
    later, expired or dead-lettered: a record not served in time counts as over the target;
    so with the default, the P99 over every input is within the target; an input with no
    outcome yet counts as a miss too), at least one served within it; inf when none is.
    ``miss_share=0``: every input of every window served within the target."""
    windows: dict[int, list[Outcome]] = {}
    for row in rows:
        if row.ts_ms >= end_ms:
            windows.setdefault((row.ts_ms - end_ms) // 1000, []).append(row)
    good_from: float = float("inf")
    for second in sorted(windows, reverse=True):
        window = windows[second]
        missed = sum(1 for r in window if r.latency_ms is None or r.latency_ms > target_ms)
        if missed == len(window) or missed > miss_share * len(window):
            break
        good_from = float(second)
    return good_from


@dataclass(frozen=True)
class Window:
    """What became of the inputs of one window (``start_s`` after the overload began, by the
    inputs' timestamps): how many, and the shares served within the target, served later,
    expired, and dead-lettered or without an outcome (``other``)."""

    start_s: float
    inputs: int
    within: float
    late: float
    expired: float
    other: float


def timeline(rows: list[Outcome], start_ms: int, target_ms: float, step_s: float) -> list[Window]:
    """The inputs from ``start_ms`` on in windows of ``step_s`` seconds (empty ones left out),
    each with what became of them: where the overload's misses fall, and when they stop."""
    windows: dict[int, list[Outcome]] = {}
    for row in rows:
        if row.ts_ms >= start_ms:
            windows.setdefault(int((row.ts_ms - start_ms) // (step_s * 1000)), []).append(row)
    timed = []
    for index in sorted(windows):
        window = windows[index]
        n = len(window)
        within = late = expired = 0
        for r in window:  # each input counted once: a result first, then an expired result
            if r.latency_ms is not None:
                within += r.latency_ms <= target_ms
                late += r.latency_ms > target_ms
            elif r.expired:
                expired += 1
        other = n - within - late - expired
        timed.append(Window(index * step_s, n, within / n, late / n, expired / n, other / n))
    return timed


def made_within(rows: list[Outcome], start_ms: int, end_ms: int, target_ms: float) -> int:
    """The results made within ``target_ms`` of their input whose output's timestamp (input
    timestamp + latency) lies in [start_ms, end_ms]: the work done within the target in that
    time, whenever its inputs came (the numerator of goodput per CPU second)."""
    return sum(
        1
        for r in rows
        if r.latency_ms is not None
        and r.latency_ms <= target_ms
        and start_ms <= r.ts_ms + r.latency_ms <= end_ms
    )


def _positive_seconds(text: str) -> float:
    """``--timeline``'s value: a number of seconds above 0."""
    seconds = float(text)
    if not 0.0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return seconds


def _target_ms(args: argparse.Namespace, workload: str) -> float:
    """``--target-ms``, else the workload's default (pipelines[].latency_target_ms of every
    consumer the bench starts)."""
    return float(args.target_ms or DEFAULT_TARGET_MS.get(workload, 100.0))


def _fresh(bootstrap: str, prefix: str) -> str:
    topic = f"{prefix}.{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, {topic: PARTITIONS})
    return topic


def _delete(bootstrap: str, topic: str) -> None:
    """Delete a run's topics once read: its input, results and dead letters. A run at tens of
    thousands of msg/s writes gigabytes: 8 runs whose topics were kept filled a disk (17 GB)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = [topic, f"{topic}.out", f"{topic}.dlq"]
    for future in admin.delete_topics(topics, operation_timeout=30).values():
        try:
            future.result(timeout=60)
        except KafkaException as exc:  # a topic the run never created is fine
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


def _config(
    bootstrap: str,
    workload: str,
    topic: str,
    max_age_ms: float | None,
    target_ms: float,
    expire_when: str = "predicted",
) -> dict[str, Any]:
    pipeline: dict[str, object] = {
        "name": workload,
        "input_topic": topic,
        "output_topic": f"{topic}.out",
        "workload": workload,
        "latency_target_ms": target_ms,
    }
    if max_age_ms is not None:
        pipeline["max_age_ms"] = int(max_age_ms)
        pipeline["expire_when"] = expire_when
    return {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": f"{topic}-group"},
        "pipelines": [pipeline],
        "metrics": {"port": free_port()},
    }


@dataclass(frozen=True)
class Served:
    """What a consumer without a deadline served: results per second (after ``--skip-s``),
    results per second of the consumer's CPU time (its process and children, the whole window)
    and the cores it used on average."""

    rate: float
    offered: float  # msg/s the producer reached (the whole window)
    per_cpu_s: float
    cores: float


class CpuWindow:
    """A wall-clock window (epoch ms, from creation to :meth:`close`) and the CPU seconds that
    process ``pid`` and its children spent in it (``/proc``)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.start_ms = int(time.time() * 1000)
        self._start_cpu_s = process_cpu_s(pid, children=True)
        self.end_ms = self.start_ms
        self.cpu_s = 0.0

    def close(self) -> None:
        """End the window now."""
        self.end_ms = int(time.time() * 1000)
        self.cpu_s = process_cpu_s(self._pid, children=True) - self._start_cpu_s

    @property
    def wall_s(self) -> float:
        return (self.end_ms - self.start_ms) / 1000.0

    @property
    def cores(self) -> float:
        """CPU seconds per second of the window."""
        return self.cpu_s / self.wall_s

    def per_cpu_s(self, count: int) -> float:
        """``count`` per CPU second of the window (nan when no CPU time was counted)."""
        return count / self.cpu_s if self.cpu_s > 0 else float("nan")


def _result_stamps(bootstrap: str, topic: str) -> list[int]:
    """The timestamps (epoch ms) of ``topic``'s results."""
    return [ts for _, _, _, ts in read_topic(bootstrap, f"{topic}.out").records.values()]


def _within(stamps: list[int], start_ms: float, end_ms: float) -> int:
    return sum(1 for ts in stamps if start_ms <= ts <= end_ms)


def _served(
    args: argparse.Namespace,
    bootstrap: str,
    workload: str,
    work: Path,
    seconds: float,
    rate: float | None,
) -> Served:
    """What a consumer without a deadline serves while the recording is offered for
    ``seconds``: open loop at ``rate`` msg/s, or as fast as the broker takes it (None)."""
    topic = _fresh(bootstrap, f"{'cap' if rate else 'probe'}.{workload}")
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    limit = int(rate * seconds) if rate else 10**9
    with consumer(
        _config(bootstrap, workload, topic, None, _target_ms(args, workload)),
        Path.cwd(),
        work,
        topic,
    ) as proc:
        window = CpuWindow(proc.pid)
        if rate is None:
            timer.start()
        try:
            sent = produce(workload, topic, bootstrap, PARTITIONS, limit, rate, False, stop=stop)
        finally:
            timer.cancel()
        window.close()
    stamps = _result_stamps(bootstrap, topic)
    _delete(bootstrap, topic)
    skipped_ms = window.start_ms + args.skip_s * 1000
    return Served(
        rate=_within(stamps, skipped_ms, window.end_ms) / ((window.end_ms - skipped_ms) / 1000.0),
        offered=sent / window.wall_s,
        per_cpu_s=window.per_cpu_s(_within(stamps, window.start_ms, window.end_ms)),
        cores=window.cores,
    )


def run_one(args: argparse.Namespace, bootstrap: str, workload: str, run: int, work: Path) -> Row:
    """Measure the capacity, then the overload and the recovery, of ``workload`` once."""
    target_ms = _target_ms(args, workload)
    probe_rate = args.factor * _served(args, bootstrap, workload, work, args.probe_s, None).rate
    measured = _served(args, bootstrap, workload, work, args.capacity_s, probe_rate)
    capacity = measured.rate
    # the overload is offered at factor x the capacity, not x the probe: a flooding producer
    # takes more CPU than a paced one, so the probe reads low (2x it came to 1.5-1.6x capacity)
    over_rate = args.factor * capacity
    after_rate = args.after_factor * capacity
    topic = _fresh(bootstrap, f"over.{workload}")
    max_age_ms = args.max_age_ms or 0.75 * target_ms
    config = _config(bootstrap, workload, topic, max_age_ms, target_ms, args.expire_when)
    with consumer(config, Path.cwd(), work, topic) as proc:
        overload = CpuWindow(proc.pid)
        sent = produce(
            workload, topic, bootstrap, PARTITIONS, int(over_rate * args.overload_s), over_rate
        )
        overload.close()
        start_ms, end_ms = overload.start_ms, overload.end_ms
        produce(workload, topic, bootstrap, PARTITIONS, int(after_rate * args.after_s), after_rate)
        load = load_average()
        committed = _drained(bootstrap, f"{topic}-group", topic, args.drain_s)
    rows = outcomes(
        read_topic(bootstrap, topic),
        read_topic(bootstrap, f"{topic}.out"),
        read_topic(bootstrap, f"{topic}.dlq"),
    )
    _delete(bootstrap, topic)
    unaccounted = [r for r in rows if r.latency_ms is None and not r.expired and not r.dead_letter]
    during = [r for r in rows if start_ms + args.skip_s * 1000 <= r.ts_ms <= end_ms]
    seconds = (end_ms - start_ms - args.skip_s * 1000) / 1000.0
    served = [r.latency_ms for r in during if r.latency_ms is not None]
    good = sum(1 for ms in served if ms <= target_ms) / seconds
    broker_pauses = pauses(args.broker_gc_log) if args.broker_gc_log else []
    if args.timeline:
        print(
            f"run {run} {workload}: inputs by their timestamp, the overload ending at "
            f"{(end_ms - start_ms) / 1000:.1f} s (it began at {start_ms / 1000:.3f} s, Unix time)",
            flush=True,
        )
        for w in timeline(rows, start_ms, target_ms, args.timeline):
            begin_s = start_ms / 1000.0 + w.start_s
            stopped = within(broker_pauses, begin_s, begin_s + args.timeline)
            print(
                f"  {w.start_s:6.1f} s {w.inputs:7d} inputs | within {w.within:6.1%} late "
                f"{w.late:6.1%} expired {w.expired:6.1%} other {w.other:5.1%}"
                + (f" | broker paused {_longest(stopped):5.1f} ms" if stopped else ""),
                flush=True,
            )
    return Row(
        workload=workload,
        run=run,
        capacity=capacity,
        offered=sent / ((end_ms - start_ms) / 1000.0),
        inputs=len(rows),
        missing=sum(1 for r in unaccounted if r.offset < committed.get(r.partition, 0)),
        undrained=sum(1 for r in unaccounted if r.offset >= committed.get(r.partition, 0)),
        expired_share=sum(r.expired for r in during) / max(1, len(during)),
        goodput=good,
        goodput_share=good / capacity,
        capacity_offered=measured.offered,
        cpu_share=overload.per_cpu_s(made_within(rows, start_ms, end_ms, target_ms))
        / measured.per_cpu_s,
        cores_capacity=measured.cores,
        cores_overload=overload.cores,
        served_p99_ms=float(np.percentile(served, 99)) if served else float("nan"),
        recovery_s=recovery_s(rows, end_ms, target_ms),
        recovery_all_s=recovery_s(rows, end_ms, target_ms, miss_share=0.0),
        load=load,
        broker_longest_ms=(
            (
                _longest(within(broker_pauses, start_ms / 1000.0, end_ms / 1000.0)),
                _longest(within(broker_pauses, end_ms / 1000.0, end_ms / 1000.0 + args.after_s)),
            )
            if args.broker_gc_log
            else None
        ),
    )


def _longest(found: list[Pause]) -> float:
    """The longest of ``found`` in ms (0 when none)."""
    return max((pause.ms for pause in found), default=0.0)


def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "overload-ends"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        }
    finally:
        consumer.close()


def _drained(bootstrap: str, group: str, topic: str, timeout_s: float) -> dict[int, int]:
    """Wait up to ``timeout_s`` seconds for ``group`` to commit the end of every partition of
    ``topic`` (the backlog drained); return its committed offsets as they are then."""
    deadline = time.monotonic() + timeout_s
    partitions = list(range(PARTITIONS))
    while True:
        ends = _end_offsets(bootstrap, topic)
        committed = committed_offsets(bootstrap, group, topic, partitions)
        if all(committed.get(p, -1) >= end for p, end in ends.items() if end > 0):
            return committed
        if time.monotonic() > deadline:
            return committed
        time.sleep(2.0)  # polling the broker's view of the group, not our own threads


def _print_row(row: Row, target_ms: float) -> None:
    print(
        f"run {row.run} {row.workload:<7} capacity {row.capacity:8.0f} msg/s (offered "
        f"{row.capacity_offered:.0f}) | offered "
        f"{row.offered:8.0f} ({row.offered / row.capacity:.1f}x) | inputs {row.inputs:7d} "
        f"missing {row.missing} undrained {row.undrained} | expired "
        f"{row.expired_share:5.1%} | goodput {row.goodput:8.0f} msg/s = {row.goodput_share:5.1%} "
        f"of capacity, per CPU s {row.cpu_share:5.1%} (consumer cores {row.cores_capacity:.2f} "
        f"-> {row.cores_overload:.2f}) | served P99 {row.served_p99_ms:7.1f} ms "
        f"(target {target_ms:.0f}) | "
        f"recovery {row.recovery_s:4.0f} s (every input: {row.recovery_all_s:.0f} s) | "
        f"load {row.load:.1f}"
        + (
            f" | the broker's longest pause {row.broker_longest_ms[0]:.0f} ms overloaded, "
            f"{row.broker_longest_ms[1]:.0f} ms after"
            if row.broker_longest_ms is not None
            else ""
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", default=[], help="trades, iot (repeatable)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--probe-s", type=float, default=10.0)
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--factor", type=float, default=2.0, help="offered / capacity, overload")
    parser.add_argument("--after-factor", type=float, default=0.5, help="offered / capacity, after")
    parser.add_argument("--target-ms", type=float, help="default: trades 30, iot 60")
    parser.add_argument(
        "--max-age-ms", type=float, help="pipelines[].max_age_ms; default: 3/4 of the target"
    )
    parser.add_argument(
        "--expire-when",
        choices=("passed", "predicted"),
        default="predicted",
        help="pipelines[].expire_when in the overload phase (the product's default: predicted)",
    )
    parser.add_argument(
        "--drain-s", type=float, default=180.0, help="most s to wait for the backlog at the end"
    )
    parser.add_argument("--skip-s", type=float, default=2.0, help="left out of each window")
    parser.add_argument(
        "--timeline",
        type=_positive_seconds,
        metavar="SECONDS",
        help="print what became of the inputs per window of this many seconds (overload on)",
    )
    parser.add_argument("--bootstrap")
    parser.add_argument(
        "--broker-gc-log",
        type=Path,
        help="the broker's GC log, its pauses printed beside the results (default: the log of "
        "the broker the bench starts; none with --bootstrap)",
    )
    args = parser.parse_args()
    workloads = args.workload or ["trades", "iot"]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="streamproc-overload-") as tmp:
        work = Path(tmp)
        if not args.bootstrap and not args.broker_gc_log:
            args.broker_gc_log = LocalKafka(work / "kafka", work).gc_log_path
        with broker_unless_given(args.bootstrap, work / "kafka") as bootstrap:
            for run in range(1, args.runs + 1):
                for workload in workloads:
                    row = run_one(args, bootstrap, workload, run, work)
                    rows.append(row)
                    _print_row(row, _target_ms(args, workload))
    print("\nper workload, median [min-max] over the runs")
    for workload in workloads:
        mine = [r for r in rows if r.workload == workload]
        finite = [r.recovery_s for r in mine if r.recovery_s != float("inf")]
        finite_all = [r.recovery_all_s for r in mine if r.recovery_all_s != float("inf")]
        print(
            f"{workload:<7} capacity {format_spread([r.capacity for r in mine])} msg/s | goodput "
            f"share {format_spread([r.goodput_share for r in mine])} (per CPU s "
            f"{format_spread([r.cpu_share for r in mine])}) | served P99 "
            f"{format_spread([r.served_p99_ms for r in mine])} ms | expired "
            f"{format_spread([r.expired_share for r in mine])} | recovery "
            f"{format_spread(finite) if finite else '-'} s ({len(mine) - len(finite)} never; "
            f"every input: {format_spread(finite_all) if finite_all else '-'} s, "
            f"{len(mine) - len(finite_all)} never) | "
            f"missing {sum(r.missing for r in mine)} | undrained {sum(r.undrained for r in mine)}"
        )
    if any(r.missing for r in rows):
        raise SystemExit("inputs without a result, expired result or dead-letter record")
    print(f"(median of goodput share: {statistics.median(r.goodput_share for r in rows):.2f})")


if __name__ == "__main__":
    threading.current_thread().name = "overload-bench"
    main()
