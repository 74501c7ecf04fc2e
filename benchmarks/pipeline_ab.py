"""One streamproc run over pre-produced input, for A/B comparisons of two checkouts.

Usage (from a checkout's root, with its .venv)::

    .venv/bin/python benchmarks/pipeline_ab.py --workload trades --messages 20000 \\
        --bootstrap 127.0.0.1:9092 --out /tmp/ab.jsonl

The input topic ``ab-<workload>-<messages>`` is produced once (the workload's replay data, 4
partitions) and reused by every later run, so two checkouts read the same bytes. Each run uses
a fresh consumer group and output topic, runs the pipeline until idle and appends one JSON line:
throughput from the output records' timestamps (``(n - 1) / (last - first)``, the same rule as
``streamproc bench``) and the process CPU seconds per message of the run (``time.process_time``
between the start of the run and its end, model loading excluded), which the shared cores
disturb far less than wall time. Run the two checkouts alternately (A B A B ...) and compare
medians. The row also holds each Python thread's CPU-µs per message (``threads``: from
``/proc/self/task/<tid>/stat`` in 10 ms ticks, read every 0.2 s so a thread that ends at close
keeps its last reading; decode threads summed as ``decode_*``, librdkafka's by thread name), printed
one line per thread, and ``fetched``: the messages the consumer fetched from the broker
(librdkafka's statistics; more than ``messages`` where paused partitions were fetched again).
``--max-age-ms 1`` gives the pipeline a deadline every record of the reused input is past: each
gets an expired result, and the row measures what shedding a record costs (the floor beside it:
``benchmarks/shed_floor.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

import streamproc
from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.tools.bench.cpu import thread_cpu
from streamproc.tools.replay import produce


def ensure_input(bootstrap: str, workload: str, messages: int, traced: bool = False) -> str:
    """The input topic, produced once; ``traced``: a copy of it in which every record carries a
    sampled ``traceparent`` of its own (a trace per record, as a traced producer writes)."""
    topic = f"ab-{workload}-{messages}"
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    if topic not in metadata.topics:
        produce(workload, topic, bootstrap, partitions=4, limit=messages, progress=False)
    if not traced:
        return topic
    copy = f"{topic}-traced"
    if copy not in metadata.topics:
        _copy_traced(bootstrap, topic, copy, messages)
    return copy


def _copy_traced(bootstrap: str, source: str, copy: str, messages: int) -> None:
    ensure_topics(bootstrap, {copy: 4})
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ab-copy-{copy}"})
    consumer.assign([TopicPartition(source, p, 0) for p in range(4)])
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    copied = 0
    while copied < messages:
        for message in consumer.consume(1000, 5.0):
            if message.error() is not None:
                continue
            parent = b"00-%032x-%016x-01" % (
                random.getrandbits(128) | 1,
                random.getrandbits(64) | 1,
            )
            producer.produce(
                copy,
                message.value(),
                message.key(),
                partition=message.partition() or 0,
                headers=[*(message.headers() or []), ("traceparent", parent)],
            )
            producer.poll(0)
            copied += 1
    consumer.close()
    producer.flush(60)


def _output_rate(bootstrap: str, topic: str, expected: int) -> tuple[int, float | None]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"ab-read-{uuid.uuid4().hex[:6]}"}
    )
    parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    stamps: list[int] = []
    idle_since = time.monotonic()
    while len(stamps) < expected and time.monotonic() - idle_since < 10:
        for message in consumer.consume(1000, 1.0):
            if message.error() is None:
                stamps.append(message.timestamp()[1])
                idle_since = time.monotonic()
    consumer.close()
    if len(stamps) < 2:
        return len(stamps), None
    stamps.sort()
    return len(stamps), (len(stamps) - 1) / max(1e-3, (stamps[-1] - stamps[0]) / 1000.0)


class _FetchedCounter:
    """The messages the source's consumer fetched from the broker (librdkafka's statistics:
    ``rxmsgs`` summed over the partitions, every 0.5 s): more than were consumed where a
    paused partition's prefetch was dropped and fetched again."""

    def __init__(self) -> None:
        self.messages = 0

    def consumer(self, settings: dict[str, Any]) -> Consumer:
        return Consumer({**settings, "statistics.interval.ms": 500, "stats_cb": self._stats})

    def _stats(self, raw: str) -> None:
        topics = json.loads(raw).get("topics", {}).values()
        total = sum(
            p.get("rxmsgs", 0)
            for t in topics
            for name, p in t.get("partitions", {}).items()
            if name != "-1"
        )
        self.messages = max(self.messages, total)


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Per live thread id: its name and CPU seconds. Python threads by their Python name
    (decode threads as ``decode_*``), librdkafka's by their ``comm`` (``rdk:broker1``,
    ``rdk:main``: every client's threads of one name add up); other native threads left out."""
    stats = thread_cpu()
    named = {
        t.native_id: re.sub(r"^decode_\d+$", "decode_*", t.name)
        for t in threading.enumerate()
        if t.native_id in stats and t.name != "ab-sampler"
    }
    named |= {tid: stat.name for tid, stat in stats.items() if stat.name.startswith("rdk:")}
    return {tid: (name, stats[tid].cpu_s) for tid, name in named.items()}


def threads_since(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """Per thread name, the CPU seconds its threads spent from ``before`` to ``after`` (two
    :func:`thread_cpu_s` readings; a thread born in between counts from zero)."""
    threads: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        earlier = before.get(tid, (name, 0.0))[1]
        threads[name] = threads.get(name, 0.0) + seconds - earlier
    return threads


def per_message_us(threads: dict[str, float], messages: int) -> dict[str, float]:
    """Each thread's CPU-µs per message, busiest first (threads that used none left out)."""
    return {
        name: round(1e6 * seconds / max(1, messages), 2)
        for name, seconds in sorted(threads.items(), key=lambda kv: -kv[1])
        if seconds > 0
    }


def write_row(row: dict[str, Any], out: str) -> None:
    """Append ``row`` to the JSON-lines file ``out`` and print it."""
    with open(out, "a") as file:
        file.write(json.dumps(row) + "\n")
    print(json.dumps(row))


def overrides(
    workload: str,
    source: str,
    run_id: str,
    worker: dict[str, Any],
    tracing: dict[str, Any] | None = None,
    consumer: dict[str, Any] | None = None,
    ring_capacity: int | None = None,
    max_batch_size: int | None = None,
    max_age_ms: int | None = None,
) -> dict[str, Any]:
    """The config of one run (the bench's sizes: batches up to 256, 16 for video; one torch
    thread), ``worker`` merged into its worker section; ``tracing``: the tracing section (None
    or empty: none given, as a checkout without tracing needs); ``consumer``: librdkafka
    settings of the source's consumer (``kafka.consumer``); ``ring_capacity``: the rings'
    capacity (None: the bench's, 16,384 records, 256 for video); ``max_batch_size``: the batches'
    cap (None: the bench's, 256, 16 for video); ``max_age_ms``: the pipeline's
    ``max_age_ms`` (None: no deadline; 1 on the reused input: every record expires at its cut,
    which measures what shedding a record costs)."""
    video = workload == "video"
    kafka: dict[str, Any] = {"group_id": f"ab-{run_id}"}
    pipeline: dict[str, Any] = {
        "name": workload,
        "input_topic": source,
        "output_topic": f"ab-out-{run_id}",
        "workload": workload,
    }
    if max_age_ms is not None:
        pipeline["max_age_ms"] = max_age_ms
    if consumer:
        kafka["consumer"] = consumer
    return ({"tracing": tracing} if tracing else {}) | {
        "kafka": kafka,
        "pipelines": [pipeline],
        "metrics": {"port": 0},
        "batching": {"max_batch_size": max_batch_size or (16 if video else 256)},
        "buffers": {"ring_capacity": ring_capacity or (256 if video else 16384)},
        "worker": {"torch_threads": 1, **worker},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="trades")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--worker",
        default="{}",
        help='JSON merged into the worker section, e.g. \'{"decode_inline": "never"}\'',
    )
    parser.add_argument(
        "--tracing",
        default="{}",
        help="JSON of the tracing section, e.g. '{\"enabled\": false}' (empty: none given)",
    )
    parser.add_argument(
        "--consumer",
        default="{}",
        help="JSON of librdkafka consumer settings, e.g. '{\"queued.min.messages\": 4096}'",
    )
    parser.add_argument(
        "--ring-capacity", type=int, default=None, help="buffers.ring_capacity (default: 16384)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="batching.max_batch_size (default: 256)"
    )
    parser.add_argument(
        "--max-age-ms",
        type=int,
        default=None,
        help="pipelines[].max_age_ms (1: every record of the reused input expires: the cost of "
        "shedding)",
    )
    parser.add_argument(
        "--traced-input",
        action="store_true",
        help="read a copy of the input whose every record carries a sampled traceparent",
    )
    args = parser.parse_args(argv)
    source = ensure_input(args.bootstrap, args.workload, args.messages, args.traced_input)
    run_id = uuid.uuid4().hex[:8]
    config = load_config(
        overrides=overrides(
            args.workload,
            source,
            run_id,
            json.loads(args.worker),
            json.loads(args.tracing),
            json.loads(args.consumer),
            args.ring_capacity,
            args.max_batch_size,
            args.max_age_ms,
        ),
        bootstrap=args.bootstrap,
    )
    fetched = _FetchedCounter()
    pipeline = streamproc.Pipeline(config, consumer_factory=fetched.consumer)
    pipeline.start()  # model load, warm-up and calibration are not counted
    before = thread_cpu_s()
    last: dict[int, tuple[str, float]] = {}  # per thread id: name and its latest CPU seconds
    done = threading.Event()

    def sample() -> None:  # a thread's counters vanish with it: keep its last reading
        while not done.wait(0.2):
            last.update(thread_cpu_s())

    sampler = threading.Thread(target=sample, name="ab-sampler", daemon=True)
    sampler.start()
    cpu_start_s = time.process_time()
    summary = pipeline.run(exit_when_idle_s=2.0)
    cpu_s = time.process_time() - cpu_start_s
    done.set()
    sampler.join()
    threads = threads_since(before, last)
    produced, rate = _output_rate(args.bootstrap, f"ab-out-{run_id}", args.messages)
    metrics = pipeline.metrics
    spans: dict[str, float] = {}
    if hasattr(metrics, "trace_spans_exported"):  # absent from a checkout without tracing
        spans["exported"] = metrics.counter_value(metrics.trace_spans_exported)
        spans["dropped"] = sum(
            metrics.counter_value(metrics.trace_spans_dropped, reason=reason)
            for reason in ("queue_full", "export_failed")
        )
    row = {
        "label": args.label,
        "worker": json.loads(args.worker),
        "tracing": json.loads(args.tracing),
        "spans": spans,
        "workload": args.workload,
        "max_age_ms": args.max_age_ms,
        "messages": produced,
        "exit_code": summary.exit_code,
        "msg_s": rate,
        "cpu_us_per_msg": 1e6 * cpu_s / max(1, produced),
        "batch_sizes": next(iter(summary.batch_sizes.values()), {}),
        "fetched": fetched.messages,
        "threads": per_message_us(threads, produced),
    }
    write_row(row, args.out)


if __name__ == "__main__":
    main()
