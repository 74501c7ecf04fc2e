"""``streamproc demo``: local broker + replay of every built-in workload + one consumer + report.

1. Start a local Apache Kafka broker (or use ``$KAFKA_BOOTSTRAP_SERVERS``).
2. Create one input topic per built-in workload (the registry's: video, iot, trades; 4
   partitions each), their output and dead-letter topics.
3. Start one consumer process-in-a-thread serving all their pipelines, and replay the real
   recordings concurrently, each at its own rate (open loop).
4. Run until idle, then verify from the broker, per topic: one result per input, no duplicates,
   committed offsets == end offsets; print throughput, end-to-end latency percentiles, batch
   sizes and example results.
5. Stop the broker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce, recording_size
from streamproc.tools.verify import Verdict, verify
from streamproc.workloads.registry import BUILTIN_WORKLOADS

# workload -> (messages, rate msg/s), every built-in workload as the registry sizes it
DEFAULT_PLAN = {
    name: (workload.demo_messages, workload.demo_rate_msg_s)
    for name, workload in BUILTIN_WORKLOADS.items()
}
IDLE_S = 3.0


def _describe(workload: str, doc: dict[str, Any]) -> str:
    src = doc["source"]
    where = f"[{src['partition']}@{src['offset']}]"
    if workload == "video":
        labels = ", ".join(f"{t['label']} {t['score']:.2f}" for t in doc["top5"][:3])
        return f"{doc['camera_id']:<14} frame {doc['frame_no']:>4} {where:>9}  {labels}"
    if workload == "iot":
        return (
            f"{doc['device_id']:<14} window {doc['window_id']:>4} {where:>9}  "
            f"score {doc['score']:.3f} anomaly={doc['anomaly']}"
        )
    return (
        f"{doc['trade_id']:<22} {where:>9}  score {doc['score']:.4f} "
        f"anomaly={doc['anomaly']} ret={doc['features']['log_return_vs_prev_close']:+.3f}"
    )


@dataclass
class DemoReport:
    verdicts: dict[str, Verdict]
    summary: RunSummary
    processing_s: float

    @property
    def ok(self) -> bool:
        return self.summary.exit_code == 0 and all(
            v.ok and v.inputs > 0 for v in self.verdicts.values()
        )

    def render(self) -> str:
        lines = [
            "streamproc demo report",
            "======================",
            f"one consumer process, {len(self.verdicts)} pipelines, "
            f"{self.processing_s:.1f} s from start to idle",
            "",
        ]
        header = (
            f"{'workload':<8} {'in':>6} {'out':>6} {'dlq':>4} {'missing':>7} {'dup':>4} "
            f"{'msg/s':>7} {'P50 ms':>7} {'P95 ms':>7} {'P99 ms':>7}  committed==end"
        )
        lines += [header, "-" * len(header)]
        for workload, v in self.verdicts.items():
            pct = v.latency_percentiles()
            lines.append(
                f"{workload:<8} {v.inputs:>6} {v.results:>6} {v.dead_lettered:>4} "
                f"{len(v.missing):>7} {v.duplicates:>4} {v.inputs / self.processing_s:>7.1f} "
                f"{pct.get('p50', 0):>7.0f} {pct.get('p95', 0):>7.0f} {pct.get('p99', 0):>7.0f}"
                f"  {v.committed_equals_end}"
            )
        lines.append("")
        for workload, v in self.verdicts.items():
            sizes = self.summary.batch_sizes.get(v.topic, {})
            lines.append(
                f"{workload} batch sizes (size:count)  "
                + "  ".join(f"{s}:{c}" for s, c in sorted(sizes.items()))
            )
            lines.append(
                f"{workload} committed {_offsets(v.committed)} "
                f"end {_offsets(v.end_offsets)}  (per partition; '-' = nothing committed)"
            )
        lines.append("")
        lines.append("example results:")
        for workload, v in self.verdicts.items():
            for value in v.examples:
                lines.append(f"  {workload:<7} {_describe(workload, orjson.loads(value))}")
        lines.append(f"RESULT  {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def run_demo(
    bootstrap_servers: str | None = None,
    plan: dict[str, tuple[int, float]] | None = None,
    partitions: int = 4,
    work_dir: Path | None = None,
) -> DemoReport:
    """Run the whole demo; see the module docstring. Stops the broker it started.

    Args:
        plan: workload -> (message count, replay rate msg/s); default :data:`DEFAULT_PLAN`.
    """
    plan = plan or DEFAULT_PLAN
    broker: LocalKafka | None = None
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    run_dir = work_dir or Path(tempfile.mkdtemp(prefix="streamproc-demo-"))
    passed = False
    try:
        if not bootstrap:
            print(
                "starting a local Apache Kafka broker (first run fetches it with Maven) ...",
                flush=True,
            )
            broker = LocalKafka(run_dir / "kafka", ensure_kafka_jars())
            bootstrap = broker.start()
            print(f"broker up at {bootstrap}; log: {broker.log_path}", flush=True)
        suffix = uuid.uuid4().hex[:6]
        topics = {w: (f"demo.{w}.{suffix}", f"demo.{w}.results.{suffix}") for w in plan}
        ensure_topics(
            bootstrap,
            {
                name: (1 if name.endswith(".dlq") else partitions)
                for w, (inp, out) in topics.items()
                for name in (inp, out, f"{inp}.dlq")
            },
        )
        group_id = f"streamproc-demo-{suffix}"
        config = load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group_id},
                "pipelines": [
                    {"name": w, "input_topic": inp, "output_topic": out, "workload": w}
                    for w, (inp, out) in topics.items()
                ],
                "metrics": {"port": 0},
            }
        )
        for workload, (count, rate) in plan.items():
            recording_size(workload)  # load and encode the recordings before the clock starts
            print(
                f"replaying {count} real {workload} messages at {rate:g} msg/s "
                f"into {topics[workload][0]}",
                flush=True,
            )
        pipeline = Pipeline(config)
        pipeline.start()
        started_s = time.monotonic()
        errors: list[BaseException] = []

        def replay(workload: str, count: int, rate: float) -> None:
            try:
                produce(
                    workload,
                    topics[workload][0],
                    bootstrap,
                    partitions,
                    count,
                    rate,
                    progress=False,
                )
            except BaseException as exc:
                errors.append(exc)

        producers = [
            threading.Thread(target=replay, args=(w, c, r), name=f"replay-{w}")
            for w, (c, r) in plan.items()
        ]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join()
        if errors:
            pipeline.request_stop()
            pipeline.run()
            raise errors[0]
        summary = pipeline.run(exit_when_idle_s=IDLE_S)
        processing_s = max(1e-9, time.monotonic() - started_s - IDLE_S)
        verdicts = {
            w: verify(bootstrap, inp, out, f"{inp}.dlq", group_id, examples=2)
            for w, (inp, out) in topics.items()
        }
        report = DemoReport(verdicts, summary, processing_s)
        passed = report.ok
        return report
    finally:
        if broker is not None:
            broker.stop()
        if passed and work_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif broker is not None:
            print(f"broker files kept for inspection: {run_dir}", flush=True)


def _offsets(offsets: dict[int, int]) -> str:
    """``{partition: offset}`` with librdkafka's "no offset" (negative) shown as ``-``."""
    return "{" + ", ".join(f"{p}: {o if o >= 0 else '-'}" for p, o in sorted(offsets.items())) + "}"
