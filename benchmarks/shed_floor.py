"""The floor of shedding: the CPU a record costs when all that is done with it is giving it an
expired result, in the simplest code with the same guarantee (at-least-once: its offset is
committed only after its expired result is acknowledged).

Usage (from a checkout's root, with its .venv; the input of ``benchmarks/pipeline_ab.py``)::

    .venv/bin/python benchmarks/shed_floor.py --workload trades --messages 200000 \\
        --bootstrap 127.0.0.1:9092 --out /tmp/shed.jsonl

One thread and one confluent-kafka consumer and producer (the results producer's settings:
idempotent, ``acks=all``, ``linger.ms`` 2, lz4): ``consume(1000)``, then per message one
``produce`` of an empty value with the four headers of streamproc's expired result (source
topic, partition and offset; ``streamproc.result.kind: expired``) and one shared delivery
callback, ``poll(0)`` after each poll's messages; at the end a flush and one synchronous commit
of the consumed positions. No ring, no batcher, no metrics, no per-record offset tracking. Prints
one JSON line (also appended to ``--out``): the process CPU-µs per message (``/proc``,
librdkafka's threads included) from the first consume to the commit, the msg/s, and each
thread's CPU-µs per message. ``--consume-only``: no expired results, only the consume and the
commit (what merely reading a record costs). Compare with ``pipeline_ab.py --max-age-ms 1``
(streamproc shedding the same input) and without it (streamproc serving it), alternating.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Sequence
from typing import cast

from confluent_kafka import Consumer, KafkaError, Message, Producer

from benchmarks.pipeline_ab import (
    ensure_input,
    per_message_us,
    thread_cpu_s,
    threads_since,
    write_row,
)
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import EXPIRED, H_OFFSET, H_PARTITION, H_TOPIC


def expired_result_headers(
    topic: bytes, partition: int, offset: int
) -> list[tuple[str, str | bytes | None]]:
    """The headers of an expired result, as streamproc writes them
    (:meth:`~streamproc.output.headers.ResultHeaders.expired`), built the plain way."""
    return [
        (H_TOPIC, topic),
        (H_PARTITION, b"%d" % partition),
        (H_OFFSET, b"%d" % offset),
        EXPIRED,
    ]


def shed(
    bootstrap: str, source: str, output: str | None, messages: int
) -> tuple[int, float, float]:
    """Give each of ``messages`` records of ``source`` an expired result on ``output`` (None:
    only consume them and commit: what reading a record costs, with no trace of it).

    Returns:
        The messages shed, the process CPU seconds and the wall seconds it took.

    Raises:
        RuntimeError: a delivery report carried an error (the floor does not recover).
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"shed-floor-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    failed: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failed.append(err)

    consumer.subscribe([source])
    topic = source.encode()
    shed_count = 0
    start_cpu_s = start_wall_s = 0.0
    while shed_count < messages:
        batch = consumer.consume(1000, 1.0)
        if not batch:
            continue
        if not start_wall_s:  # from the first consume: the group's join is not counted
            start_cpu_s, start_wall_s = time.process_time(), time.monotonic()
        for message in batch:
            if message.error() is not None:
                continue
            if output is None:
                shed_count += 1
                continue
            headers = expired_result_headers(
                topic, cast(int, message.partition()), cast(int, message.offset())
            )
            while True:
                try:
                    producer.produce(
                        output, b"", message.key(), headers=headers, on_delivery=delivered
                    )
                    break
                except BufferError:
                    producer.poll(0.01)
            shed_count += 1
        producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("expired results still unacknowledged after 60 s")
    if failed:
        raise RuntimeError(f"{len(failed)} expired results failed, first: {failed[0]}")
    consumer.commit(asynchronous=False)
    cpu_s, wall_s = time.process_time() - start_cpu_s, time.monotonic() - start_wall_s
    consumer.close()
    return shed_count, cpu_s, wall_s


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="trades")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--consume-only",
        action="store_true",
        help="no expired results: consume and commit only (what reading a record costs)",
    )
    args = parser.parse_args(argv)
    source = ensure_input(args.bootstrap, args.workload, args.messages)
    output = None
    if not args.consume_only:
        output = f"shed-floor-out-{uuid.uuid4().hex[:8]}"
        ensure_topics(args.bootstrap, {output: 4})
    before = thread_cpu_s()
    count, cpu_s, wall_s = shed(args.bootstrap, source, output, args.messages)
    threads = threads_since(before, thread_cpu_s())
    row = {
        "label": "consume-floor" if args.consume_only else "shed-floor",
        "workload": args.workload,
        "messages": count,
        "msg_s": count / wall_s,
        "cpu_us_per_msg": 1e6 * cpu_s / max(1, count),
        "threads": per_message_us(threads, count),
    }
    write_row(row, args.out)


if __name__ == "__main__":
    main()
