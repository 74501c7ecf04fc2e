"""The bench's contenders, each run inside its own process by :mod:`streamproc.tools.bench.child`.

======================  ================================================================
``passthrough``         bare confluent-kafka consume -> produce: no headers, no delivery
                        callback, not idempotent, no commits (a ceiling for Kafka I/O, not an
                        at-least-once pipeline)
``floor``               the honest at-least-once floor (:mod:`~streamproc.tools.bench.floor`)
``floor+work``          the floor + the workload's decode/model/encode, all in one thread
``serial``              consume one -> decode -> model(batch of 1) -> produce -> flush -> commit
``streamproc``          the real pipeline (``decode_mode`` threads or processes; adaptive or
                        fixed batch size)
``model-only``          the model alone on preloaded, decoded rows, no Kafka; per batch size
``quixstreams``         Quix Streams (its own virtual environment; ``benchmarks/quix_app.py``)
======================  ================================================================

Each Kafka contender takes a :class:`~streamproc.tools.bench.cpu.CpuMeter`, opens its window
when the first input arrives and closes it when the last result is acknowledged, and returns a
small JSON-able summary.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from confluent_kafka import Consumer, Producer

from streamproc.config import Config, load_config
from streamproc.errors import RecordError
from streamproc.pipeline import Pipeline
from streamproc.records import Priority, Record, TopicPartition
from streamproc.stages import stage_quantiles
from streamproc.tools.bench.cpu import CpuMeter, own_cpu_s
from streamproc.workloads import BUILTIN_WORKLOADS, load_workload

REPO = Path(__file__).resolve().parents[3]
"""The repository root (``benchmarks/quix_app.py`` lives there)."""


def pipeline_config(
    bootstrap: str,
    source: str,
    sink: str,
    workload: str,
    group: str,
    decode_mode: str = "thread",
    fixed_batch_size: int | None = None,
    linger_ms: float | None = None,
    fused_lane: str = "auto",
) -> Config:
    """The bench's streamproc config (also the floor's: its consumer and producer settings and
    commit interval). ``fixed_batch_size`` turns the adaptive batch size off and cuts batches of
    that size. ``linger_ms`` overrides the results producer's ``linger.ms``; ``fused_lane`` is
    ``worker.fused_lane``."""
    batching: dict[str, Any] = {
        # the adaptive batch size measures and picks the best size up to this cap
        "max_batch_size": 16 if workload == "video" else 256
    }
    if fixed_batch_size is not None:
        batching = {"max_batch_size": fixed_batch_size, "adaptive_batch_size": False}
    return load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap,
                "group_id": group,
                "producer": {} if linger_ms is None else {"linger.ms": linger_ms},
            },
            "pipelines": [
                {
                    "name": workload,
                    "input_topic": source,
                    "output_topic": sink,
                    "workload": workload,
                }
            ],
            "metrics": {"port": 0},
            "batching": batching,
            # light messages: rings deeper than a fetch; librdkafka drops a paused partition's
            # prefetched messages and fetches them again on resume (docs/operations.md)
            "buffers": {"ring_capacity": 256 if workload == "video" else 16384},
            # One torch thread: on 2 shared cores, intra-op threads wait at every parallel
            # region for a core the broker, decode or Python holds (measured: a 256-row trades
            # batch took 5-30 ms instead of 0.6 ms, and video used 25-35 CPU-s per 370 frames
            # instead of 17-21 at equal or better throughput; docs/benchmarks.md).
            "worker": {
                "decode_mode": decode_mode,
                "torch_threads": 1,
                "fused_lane": fused_lane,
            },
        }
    )


def _consumer(bootstrap: str, topic: str) -> Consumer:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    return consumer


def _record(message: Any) -> Record:
    return Record(
        TopicPartition(message.topic(), message.partition()),
        message.offset(),
        message.key(),
        message.value(),
        tuple(message.headers() or ()),
        message.timestamp()[1],
        time.monotonic(),
    )


def passthrough(bootstrap: str, source: str, sink: str, n: int, meter: CpuMeter) -> dict[str, Any]:
    """Bare consume -> produce, batched polls, no model; no headers, no delivery callback, not
    idempotent, no commits."""
    consumer = _consumer(bootstrap, source)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, "acks": "all"})
    done = 0
    while done < n:
        for message in consumer.consume(500, 1.0):
            if message.error() is None:
                if not done:
                    meter.mark_start()
                producer.produce(sink, key=message.key(), value=message.value())
                done += 1
        producer.poll(0)
    producer.flush(60)
    meter.mark_end()
    consumer.close()
    return {}


def serial(
    bootstrap: str,
    source: str,
    sink: str,
    n: int,
    workload_name: str,
    meter: CpuMeter,
) -> dict[str, Any]:
    """The naive loop: one message at a time, flush and commit after each."""
    workload = load_workload(workload_name)
    model = workload.build_model(torch.device("cpu"))
    row = np.zeros((1, *workload.item_shape), dtype=workload.item_dtype)
    consumer = _consumer(bootstrap, source)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    done = 0
    while done < n:
        message = consumer.poll(1.0)
        if message is None or message.error() is not None:
            continue
        if not done:
            meter.mark_start()
        record = _record(message)
        try:
            workload.decode(record, row[0])
        except RecordError:
            continue
        outputs = model(torch.from_numpy(row))
        value = workload.encode(record, tuple(o[0].numpy() for o in outputs)).value
        producer.produce(sink, key=message.key(), value=value)
        producer.flush(10)
        consumer.commit(message=message, asynchronous=False)
        done += 1
    meter.mark_end()
    consumer.close()
    return {}


def model_only(
    workload_name: str, records: list[Record], sizes: tuple[int, ...], budget_s: float
) -> dict[str, Any]:
    """The model alone on preloaded, decoded rows, per batch size: batches cycle over
    ``records`` until ``budget_s`` seconds have passed (after one warm-up batch).

    Returns:
        ``per_batch_size``: size -> msg/s; ``cpu_us_per_msg``: size -> process CPU-µs per row.
    """
    workload = load_workload(workload_name)
    model = workload.build_model(torch.device("cpu"))
    rows = np.zeros((len(records), *workload.item_shape), dtype=workload.item_dtype)
    for i, record in enumerate(records):
        workload.decode(record, rows[i])
    batch = torch.from_numpy(rows)
    rates: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for size in (s for s in sizes if s <= len(records)):
        starts = list(range(0, len(records) - size + 1, size))
        model(batch[:size])  # warm-up
        cpu_before_s = own_cpu_s()
        started_s = time.perf_counter()
        done = 0
        for start in itertools.cycle(starts):  # at least one batch, then until the budget
            model(batch[start : start + size])
            done += size
            if time.perf_counter() - started_s >= budget_s:
                break
        elapsed_s = time.perf_counter() - started_s
        rates[str(size)] = done / elapsed_s
        cpu[str(size)] = (own_cpu_s() - cpu_before_s) / done * 1e6
    return {"per_batch_size": rates, "cpu_us_per_msg": cpu}


class _FirstInput:
    """The pipeline's consumer, noting when its first message arrives (the CPU window opens):
    one more Python call per ``consume()`` (per poll, not per message), nothing else."""

    def __init__(self, consumer: Any, on_first: Callable[[], None]) -> None:
        self._consumer = consumer
        self._on_first: Callable[[], None] | None = on_first

    def consume(self, num_messages: int = 1, timeout: float = -1) -> Any:
        messages = self._consumer.consume(num_messages, timeout)
        if messages and self._on_first is not None:
            self._on_first()
            self._on_first = None
        return messages

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def run_streamproc(
    config: Config,
    messages: int,
    meter: CpuMeter,
    ready: Callable[[], None],
    idle_s: float,
) -> dict[str, Any]:
    """Run the real pipeline until ``messages`` results are acknowledged (or ``idle_s`` seconds
    without input once assigned).

    The CPU window opens when the consumer returns its first message and closes when a watcher
    (every 20 ms) sees ``messages`` results acknowledged; so it ends up to 20 ms after the
    last acknowledgement, with the pipeline idle.

    Args:
        ready: called once the pipeline runs and owns its partitions (a paced replay may start).

    Returns:
        ``batch_sizes`` (size -> batches), ``bound_ms`` (max wait of the workload's priority
        class + 2 x the mean batch device time), ``mean_batch_device_ms``, ``stages_ms``
        (per stage of :data:`~streamproc.stages.STAGES`, its P50 and P99 in ms from
        ``streamproc_stage_seconds``, None where nothing was counted).
    """
    spec = config.pipelines[0]
    pipeline = Pipeline(
        config, consumer_factory=lambda settings: _FirstInput(Consumer(settings), meter.mark_start)
    )
    produced = pipeline.metrics.produced.labels(spec.output_topic)
    stop = threading.Event()

    def watch() -> None:  # close the window and stop once every result is acknowledged
        while not stop.wait(0.02):
            if produced._value.get() >= messages:  # private, as cli.py reads it
                meter.mark_end()
                pipeline.request_stop()
                return

    pipeline.start()
    deadline_s = time.monotonic() + 120
    while not pipeline.readiness()[0] and time.monotonic() < deadline_s:
        time.sleep(0.02)
    ready()
    watcher = threading.Thread(target=watch, name="bench-watch", daemon=True)
    watcher.start()
    summary = pipeline.run(exit_when_idle_s=idle_s)
    stop.set()
    if summary.exit_code != 0:
        raise RuntimeError(f"streamproc failed: {summary.error}")
    registry = pipeline.metrics.registry
    batches = registry.get_sample_value(
        "streamproc_inference_seconds_count", {"topic": spec.input_topic}
    )
    spent_s = registry.get_sample_value(
        "streamproc_inference_seconds_sum", {"topic": spec.input_topic}
    )
    priority = Priority.parse(spec.priority or BUILTIN_WORKLOADS[spec.workload].default_priority)
    mean_device_ms = 1000 * (spent_s or 0.0) / max(1.0, batches or 0.0)
    sizes = next(iter(summary.batch_sizes.values()), {})
    stages = stage_quantiles(pipeline.metrics.stage, spec.input_topic)
    return {
        "batch_sizes": {str(k): v for k, v in sorted(sizes.items())},
        "bound_ms": 1000 * config.batching.max_wait_s[priority] + 2 * mean_device_ms,
        "mean_batch_device_ms": mean_device_ms,
        "stages_ms": {
            name: [None if s is None else 1000 * s for s in quantiles]
            for name, quantiles in stages.items()
        },
    }


def run_quix(
    bootstrap: str, source: str, sink: str, workload: str, n: int, torch_threads: int
) -> tuple[str, dict[str, Any]]:
    """Run the Quix Streams contender in its own environment, torch on ``torch_threads``.

    Returns:
        A note ("" when it ran) and its CPU window (:class:`~streamproc.tools.bench.cpu.CpuTrace`
        fields, as JSON from its last output line).
    """
    python = quix_python()
    if python is None:
        return "skipped: Quix Streams environment could not be built", {}
    app = REPO / "benchmarks" / "quix_app.py"
    if not app.exists():
        return "skipped: benchmarks/quix_app.py not found (run from the repository)", {}
    proc = subprocess.run(
        [str(python), str(app), bootstrap, source, sink, workload, str(n), str(torch_threads)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        return f"failed: {(proc.stdout + proc.stderr)[-300:]}", {}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH-TRACE ")]
    trace: dict[str, Any] = json.loads(lines[-1].removeprefix("BENCH-TRACE ")) if lines else {}
    return "", trace


def quix_python() -> Path | None:
    """A virtualenv with the latest quixstreams, layered over this environment for torch."""
    from streamproc.tools.kafka_local import cache_dir

    venv = cache_dir() / "quix-venv"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "quixstreams"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            return None
        marker.touch()
    # Re-pointed on every run (this environment's path changes with requirements.lock):
    # appended after quix's own packages, so its pins win and torch & co. come from here.
    site = next((venv / "lib").glob("python*/site-packages"))
    ours = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz-streamproc.pth").write_text("\n".join([*ours, str(REPO)]) + "\n")
    return python
