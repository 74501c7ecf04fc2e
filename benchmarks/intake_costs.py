"""Per-message CPU of intake alone, without Kafka or a model: the source's routing of real
``confluent_kafka.Message`` objects into a lane (``Source._route``: a ``Record`` each, the ring
push, the offset tracker's consumed offsets, the consumer position), the dispatcher's cuts
(``Lane.next_cut``: the ring take) and the acknowledgement (``OffsetTracker.done_many``).

    .venv/bin/python -m benchmarks.intake_costs [--messages 200000] [--partitions 4] [--poll 100]
        [--backlog 40]

Polls of ``--poll`` messages spread round-robin over ``--partitions`` partitions (trades-like
values, no headers; a partition's messages together in each poll), routed ``--backlog`` polls at
a time, then cut (256 a cut) until the rings are empty. Prints the CPU-µs per message of each
part (``time.thread_time``, this thread only, the garbage collector's passes included), median
and range of ``--rounds`` rounds. Run two checkouts alternately and compare medians.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Sequence

from confluent_kafka import Message

from streamproc.config import load_config
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.intake.source import Source
from streamproc.kafka.protocols import MessageLike, ktp
from streamproc.logs import configure
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.records import TopicPartition
from tests.support.kafka_fakes import FakeConsumer, factory

TOPIC = "in"


def _round(messages: int, partitions: int, poll: int, backlog: int) -> tuple[float, float, float]:
    config = load_config(
        overrides={
            "pipelines": [
                {"name": "p", "input_topic": TOPIC, "output_topic": "out", "workload": "trades"}
            ],
            "buffers": {"ring_capacity": messages},
        },
        bootstrap="fake:9092",
    )
    tracker = OffsetTracker()
    metrics = Metrics()
    lane = Lane(TOPIC, PartitionBuffers(messages, 0.99, 0.5), Batcher(256, 1 << 40, 0.0), tracker)
    tps = [TopicPartition(TOPIC, p) for p in range(partitions)]
    consumer = FakeConsumer({tp: [] for tp in tps})
    source = Source(
        config,
        {TOPIC: lane},
        tracker,
        AtLeastOnce(tracker, metrics),
        metrics,
        lambda exc: None,
        factory(consumer),
    )
    source.subscribe()
    source.rebalance.on_assign(consumer, [ktp(tp) for tp in tps])
    value = b'{"symbol":"AAPL","price":189.25,"size":100,"ts":1733356800000}'
    offsets = [0] * partitions
    polls: list[list[MessageLike]] = []
    for start in range(0, messages, poll):
        batch: list[MessageLike] = []
        for i in range(start, min(messages, start + poll)):
            p = i % partitions
            batch.append(
                Message(  # type: ignore[arg-type]
                    topic=TOPIC,
                    partition=p,
                    offset=offsets[p],
                    key=b"AAPL",
                    value=value,
                    timestamp=(1, 1_733_356_800_000 + i),
                )
            )
            offsets[p] += 1
        polls.append(batch)
    # sort each poll by partition: librdkafka hands a fetched batch over partition by partition
    polls = [sorted(b, key=lambda m: (m.partition() or 0, m.offset() or 0)) for b in polls]
    stop = threading.Event()
    route_s = cut_s = ack_s = 0.0
    cut_count = 0
    for first in range(0, len(polls), backlog):
        t0 = time.thread_time()
        for batch in polls[first : first + backlog]:
            source._route(batch, time.monotonic())
        t1 = time.thread_time()
        cuts = []
        while lane.fill_ratios() and any(lane.fill_ratios().values()):
            cut = lane.next_cut(stop)
            assert cut is not None
            cuts.append(cut.records)
        t2 = time.thread_time()
        for records in cuts:
            tracker.done_many(records)
        t3 = time.thread_time()
        route_s, cut_s, ack_s = route_s + t1 - t0, cut_s + t2 - t1, ack_s + t3 - t2
        cut_count += sum(len(c) for c in cuts)
    assert cut_count == messages
    scale = 1e6 / messages
    return route_s * scale, cut_s * scale, ack_s * scale


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--poll", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--backlog", type=int, default=40, help="polls routed before the rings are cut empty"
    )
    args = parser.parse_args(argv)
    configure("warning")
    rounds = [
        _round(args.messages, args.partitions, args.poll, args.backlog) for _ in range(args.rounds)
    ]
    for name, column in zip(("route", "cut", "ack"), zip(*rounds, strict=True), strict=True):
        print(
            f"{name:6s} CPU-µs/msg median {statistics.median(column):.3f} "
            f"[{min(column):.3f}-{max(column):.3f}]"
        )
    totals = [sum(r) for r in rounds]
    print(
        f"total  CPU-µs/msg median {statistics.median(totals):.3f} "
        f"[{min(totals):.3f}-{max(totals):.3f}]"
    )


if __name__ == "__main__":
    main()
