"""Priority isolation (issue 22, item 7): trades (high) latency alone and while a video (low)
backlog drains in the same consumer process, for one or more checkouts.

Usage (from a checkout's root, with its .venv; a local broker is started unless ``--bootstrap``
or ``$KAFKA_BOOTSTRAP_SERVERS`` names one)::

    git worktree add --detach /tmp/streamproc-before main
    .venv/bin/python -m benchmarks.priority_isolation --runs 5 \\
        --checkout before=/tmp/streamproc-before --checkout after=.

Each run starts, per checkout in alternating order (A B, then B A, ...), one consumer process
(``python -m streamproc run --config ...`` with ``PYTHONPATH`` set to the checkout) serving two
pipelines with default settings: trades (priority high) and video (priority low), on fresh
topics (4 partitions). Once it is ready (``/readyz``) the run has two phases:

1. *alone*: the real trades replay (``streamproc.tools.replay.produce``) at ``--rate`` msg/s for
   ``--seconds``;
2. *backlog*: ``--frames`` real video frames are produced as fast as the broker takes them (the
   backlog), then the same trades replay runs again while the backlog drains.

Then the consumer is stopped (SIGTERM; it drains what is in flight). Latency is measured from
the broker, as ``streamproc.tools.verify`` and the demo do: output record timestamp - input
record timestamp (both CreateTime: the replayer's send and streamproc's produce), per trades
input matched by its source headers; the first ``--skip-s`` of each phase are left out (the first
fetches). Per run and checkout it prints trades P50/P99/max alone and with the backlog, their
P99 ratio (the isolation: 1.0 = unaffected), and the video results per second during the
backlog phase (what isolation costs the low-priority lane); at the end, per checkout, the median
and range over the runs. A backlog that was drained before the phase ended is flagged (``!``).
Beside the broker's view each row prints trades' in-pipeline P99 (consumed -> produced) and its
model-call P99 (both from the ``streamproc.timing`` header), and the machine's load average at
the end of each phase. With ``--out`` the rows are also appended to a file as JSON lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from confluent_kafka import Producer

from benchmarks.consumer_process import consumer, load_average
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_TIMING, parse_timing
from streamproc.tools.bench.measure import format_spread
from streamproc.tools.kafka_local import broker_unless_given, free_port
from streamproc.tools.replay import Message, messages, produce
from streamproc.tools.verify import TopicDump, read_topic

PARTITIONS = 4


@dataclass
class Row:
    """One run of one checkout (latencies in ms, rates in msg/s)."""

    checkout: str
    run: int
    alone_p50_ms: float
    alone_p99_ms: float
    alone_max_ms: float
    backlog_p50_ms: float
    backlog_p99_ms: float
    backlog_max_ms: float
    ratio_p99: float
    alone_pipeline_p99_ms: float
    backlog_pipeline_p99_ms: float
    alone_model_p99_ms: float
    backlog_model_p99_ms: float
    video_msg_s: float
    backlog_outlasted_phase: bool
    trades_matched: int
    load_alone: float
    load_backlog: float


Latencies = dict[tuple[int, int], tuple[int, float, float, float]]


def _latencies(inputs: TopicDump, outputs: TopicDump) -> Latencies:
    """Per input (partition, offset): its timestamp (ms), its first result's latency (ms), that
    result's in-pipeline time (consumed -> produced) and its batch's model time (both ms, from
    the ``streamproc.timing`` header)."""
    first: dict[tuple[int, int], tuple[int, float, float]] = {}
    for _, _, headers, ts in outputs.records.values():
        try:
            coord = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
            timing = parse_timing(headers[H_TIMING])
        except (KeyError, ValueError):
            continue
        if coord not in first or ts < first[coord][0]:
            first[coord] = (ts, timing["processing_ms"], timing["inference_ms"])
    return {
        coord: (rec[3], float(first[coord][0] - rec[3]), first[coord][1], first[coord][2])
        for coord, rec in inputs.records.items()
        if coord in first
    }


def _window(values: Latencies, start_ms: int, end_ms: int, column: int = 1) -> list[float]:
    return [row[column] for row in values.values() if start_ms <= row[0] <= end_ms]


def _produce_backlog(bootstrap: str, topic: str, frames: list[Message]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
    for message in frames:
        while True:
            try:
                producer.produce(
                    topic, value=message.value, key=message.key, headers=list(message.headers)
                )
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("video backlog not acknowledged within 60 s")


def _run_one(
    args: argparse.Namespace,
    name: str,
    checkout: Path,
    run: int,
    bootstrap: str,
    frames: list[Message],
    work: Path,
) -> Row:
    suffix = uuid.uuid4().hex[:6]
    trades_in, video_in = f"prio.trades.{suffix}", f"prio.video.{suffix}"
    ensure_topics(bootstrap, {trades_in: PARTITIONS, video_in: PARTITIONS})
    port = free_port()
    config = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": f"prio-{suffix}"},
        "pipelines": [
            {
                "name": "trades",
                "input_topic": trades_in,
                "output_topic": f"{trades_in}.out",
                "workload": "trades",
            },
            {
                "name": "video",
                "input_topic": video_in,
                "output_topic": f"{video_in}.out",
                "workload": "video",
            },
        ],
        "metrics": {"port": port},
    }
    count = int(args.rate * args.seconds)
    with consumer(
        config, checkout, work, f"{name}-{run}", args.ready_timeout_s, args.stop_timeout_s
    ):
        alone_ms = int(time.time() * 1000)
        produce("trades", trades_in, bootstrap, PARTITIONS, count, args.rate, progress=False)
        alone_end_ms = int(time.time() * 1000)
        load_alone = load_average()
        _produce_backlog(bootstrap, video_in, frames)
        backlog_ms = int(time.time() * 1000)
        produce("trades", trades_in, bootstrap, PARTITIONS, count, args.rate, progress=False)
        backlog_end_ms = int(time.time() * 1000)
        load_backlog = load_average()
    trades = _latencies(read_topic(bootstrap, trades_in), read_topic(bootstrap, f"{trades_in}.out"))
    skip_ms = int(args.skip_s * 1000)
    alone = _window(trades, alone_ms + skip_ms, alone_end_ms)
    backlog = _window(trades, backlog_ms + skip_ms, backlog_end_ms)
    video_ts = [ts for _, _, _, ts in read_topic(bootstrap, f"{video_in}.out").records.values()]
    during = [ts for ts in video_ts if backlog_ms <= ts <= backlog_end_ms]
    if not alone or not backlog:
        raise RuntimeError(
            f"{name} run {run}: no trades results matched (log: {work}/{name}-{run}.log)"
        )
    a99, b99 = (float(np.percentile(v, 99)) for v in (alone, backlog))
    return Row(
        checkout=name,
        run=run,
        alone_p50_ms=float(np.percentile(alone, 50)),
        alone_p99_ms=a99,
        alone_max_ms=max(alone),
        backlog_p50_ms=float(np.percentile(backlog, 50)),
        backlog_p99_ms=b99,
        backlog_max_ms=max(backlog),
        ratio_p99=b99 / a99,
        alone_pipeline_p99_ms=float(
            np.percentile(_window(trades, alone_ms + skip_ms, alone_end_ms, 2), 99)
        ),
        backlog_pipeline_p99_ms=float(
            np.percentile(_window(trades, backlog_ms + skip_ms, backlog_end_ms, 2), 99)
        ),
        alone_model_p99_ms=float(
            np.percentile(_window(trades, alone_ms + skip_ms, alone_end_ms, 3), 99)
        ),
        backlog_model_p99_ms=float(
            np.percentile(_window(trades, backlog_ms + skip_ms, backlog_end_ms, 3), 99)
        ),
        video_msg_s=len(during) / max(1e-3, (backlog_end_ms - backlog_ms) / 1000.0),
        backlog_outlasted_phase=any(ts > backlog_end_ms for ts in video_ts),
        trades_matched=len(trades),
        load_alone=load_alone,
        load_backlog=load_backlog,
    )


def _print_row(row: Row) -> None:
    flag = "" if row.backlog_outlasted_phase else " !"
    print(
        f"run {row.run} {row.checkout:<8} alone P50/P99/max {row.alone_p50_ms:5.1f} "
        f"{row.alone_p99_ms:6.1f} {row.alone_max_ms:6.0f} | backlog {row.backlog_p50_ms:5.1f} "
        f"{row.backlog_p99_ms:6.1f} {row.backlog_max_ms:6.0f} | P99 ratio "
        f"{row.ratio_p99:4.2f} | in-pipeline P99 {row.alone_pipeline_p99_ms:5.1f} "
        f"{row.backlog_pipeline_p99_ms:5.1f} | model P99 {row.alone_model_p99_ms:5.2f} "
        f"{row.backlog_model_p99_ms:5.2f} | video {row.video_msg_s:5.1f} msg/s{flag} | load "
        f"{row.load_alone:.1f} {row.load_backlog:.1f}",
        flush=True,
    )


def _summary(rows: list[Row], names: list[str]) -> None:
    print(
        "\nper checkout, median [min-max] over the runs (ms; video msg/s during the backlog phase)"
    )
    header = (
        f"{'checkout':<8} {'alone P99':>18} {'backlog P99':>18} {'P99 ratio':>18} "
        f"{'in-pipeline ratio':>18} {'video msg/s':>18}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        mine = [r for r in rows if r.checkout == name]
        in_pipeline = [r.backlog_pipeline_p99_ms / r.alone_pipeline_p99_ms for r in mine]
        print(
            f"{name:<8} {format_spread([r.alone_p99_ms for r in mine]):>18} "
            f"{format_spread([r.backlog_p99_ms for r in mine]):>18} "
            f"{format_spread([r.ratio_p99 for r in mine]):>18} "
            f"{format_spread(in_pipeline):>18} "
            f"{format_spread([r.video_msg_s for r in mine]):>18}"
        )
    if len(names) == 2:
        first, second = ([r for r in rows if r.checkout == n] for n in names)
        paired = [
            b.ratio_p99 / a.ratio_p99 for a, b in zip(first, second, strict=False) if a.run == b.run
        ]
        if paired:
            print(
                f"paired per run: {names[1]} P99 ratio / {names[0]} P99 ratio "
                f"{statistics.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}]"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        help="NAME=PATH of a checkout to run (repeatable; default: this one as 'this')",
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rate", type=float, default=50.0, help="trades msg/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--frames", type=int, default=1480, help="video backlog, frames")
    parser.add_argument("--skip-s", type=float, default=1.0, help="left out of each phase")
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--stop-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", help="append each run's row to this file (JSON lines)")
    args = parser.parse_args()
    checkouts = [spec.split("=", 1) for spec in args.checkout] or [["this", "."]]
    names = [name for name, _ in checkouts]
    paths = {name: Path(path).resolve() for name, path in checkouts}
    frames = list(itertools.islice(messages("video"), args.frames))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="streamproc-prio-") as tmp:
        work = Path(tmp)
        with broker_unless_given(args.bootstrap, work / "kafka") as bootstrap:
            for run, offset in zip(range(1, args.runs + 1), itertools.cycle((0, 1)), strict=False):
                order = names[offset:] + names[:offset]
                for name in order:
                    row = _run_one(args, name, paths[name], run, bootstrap, frames, work)
                    rows.append(row)
                    _print_row(row)
                    if args.out:
                        with open(args.out, "a") as out:
                            out.write(json.dumps(asdict(row)) + "\n")
    _summary(rows, names)


if __name__ == "__main__":
    threading.current_thread().name = "priority-bench"
    main()
