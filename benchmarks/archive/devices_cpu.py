"""Several devices on a CPU machine: one device against two logical CPU devices, on a real broker.

    .venv/bin/python benchmarks/devices_cpu.py video 370 3
    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092 .venv/bin/python benchmarks/devices_cpu.py trades 20000

For each round (the last argument, default 2), and for each variant below in turn (alternating,
so a shared machine's load drifts over all of them alike), a backlog of ``messages`` records of
``workload`` is produced into a fresh 4-partition topic and the real pipeline (the bench's
config, ``streamproc.tools.bench.contenders.pipeline_config``) consumes it until idle. Prints
per run the throughput (from the output records' timestamps), the batches each device got and
its busy fraction (device seconds over the run), and the most results that waited for an earlier
batch; then the median throughput per variant.

Variants (``worker`` keys):

* ``1 device, torch_threads 1`` -- the bench's default;
* ``1 device, torch_threads 2``;
* ``2 devices [cpu, cpu], torch_threads 1`` -- two model calls at once, one thread each;
* ``2 devices [cpu, cpu], torch_threads 2``.

Uses ``$KAFKA_BOOTSTRAP_SERVERS`` when set, else starts a local broker for the run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from streamproc import logs
from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline
from streamproc.tools.bench.contenders import pipeline_config
from streamproc.tools.bench.measure import output_stats
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic

VARIANTS: dict[str, dict[str, Any]] = {
    "1 device, torch_threads 1": {"torch_threads": 1},
    "1 device, torch_threads 2": {"torch_threads": 2},
    "2 devices, torch_threads 1": {"devices": ["cpu", "cpu"], "torch_threads": 1},
    "2 devices, torch_threads 2": {"devices": ["cpu", "cpu"], "torch_threads": 2},
}


def run_once(bootstrap: str, workload: str, messages: int, worker: dict[str, Any]) -> str:
    """One backlog through one pipeline; returns a report line (throughput first)."""
    tag = uuid.uuid4().hex[:6]
    source, sink = f"dev.in.{tag}", f"dev.out.{tag}"
    ensure_topics(bootstrap, {source: 4, sink: 4})
    produce(workload, source, bootstrap, 4, messages, None, progress=False)
    data = pipeline_config(bootstrap, source, sink, workload, f"dev-{tag}").model_dump()
    data["worker"].update(worker)
    pipeline = Pipeline(load_config(overrides=data))
    started_s = time.monotonic()
    summary = pipeline.run(exit_when_idle_s=3.0)
    elapsed_s = time.monotonic() - started_s
    assert summary.exit_code == 0, summary.error
    assert not pipeline.leaks, pipeline.leaks
    stats = output_stats(read_topic(bootstrap, sink))  # count and rate from timestamps
    count, rate = stats.count, stats.rate_msg_s
    assert count == messages, (count, messages)
    placed = summary.device_batches[source]
    busy = {
        label: (
            pipeline.metrics.registry.get_sample_value(
                "streamproc_device_busy_seconds_total", {"topic": source, "device": label}
            )
            or 0.0
        )
        for label in placed
    }
    devices = ", ".join(
        f"{label}: {n} batches, busy {busy[label]:.1f} s" for label, n in placed.items()
    )
    sizes = summary.batch_sizes[source]
    mean_size = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
    waited = max(s.resequencer.max_waiting for s in pipeline.stages.topics)
    return (
        f"{rate or 0:8.0f} msg/s  mean batch {mean_size:5.1f}  ({devices}; run {elapsed_s:.0f} s;"
        f" at most {waited} results waited for an earlier batch)"
    )


def main(workload: str, messages: int, rounds: int) -> None:
    logs.configure("warning", "console")
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    broker = None
    if given:
        bootstrap = given
    else:
        run_dir = Path(f"/tmp/streamproc-dev-{uuid.uuid4().hex[:6]}")
        broker = LocalKafka(run_dir, ensure_kafka_jars())
        bootstrap = broker.start()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        for round_ in range(1, rounds + 1):
            for name, worker in VARIANTS.items():
                line = run_once(bootstrap, workload, messages, worker)
                rates[name].append(float(line.split()[0]))
                print(f"round {round_}  {name:<28} {line}", flush=True)
    finally:
        if broker is not None:
            broker.stop()
    print(f"{workload}, {messages} messages, median of {rounds} rounds:")
    for name, values in rates.items():
        print(f"  {name:<28} {statistics.median(values):8.0f} msg/s  (runs: {values})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
