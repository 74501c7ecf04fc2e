"""``streamproc demo``: local broker + replay + consumer + verification report.

1. Start a local Apache Kafka broker (or use ``$KAFKA_BOOTSTRAP_SERVERS``).
2. Create the input topic (4 partitions), output and dead-letter topics.
3. Start the consumer pipeline, replay every real video frame at ``rate`` msg/s (open loop).
4. Run until idle, then verify from the broker: one result per frame, no duplicates, committed
   offsets == end offsets; print throughput, end-to-end latency percentiles, batch sizes and
   example labels.
5. Stop the broker.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson

from streamproc.admin import ensure_topics
from streamproc.config import load_config
from streamproc.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.replay import produce, recording_size
from streamproc.verify import Verdict, verify


@dataclass
class DemoReport:
    verdict: Verdict
    summary: RunSummary
    produced: int
    processing_s: float

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.summary.exit_code == 0 and self.verdict.inputs > 0

    def render(self) -> str:
        v = self.verdict
        pct = v.latency_percentiles()
        sizes = self.summary.batch_sizes.get(v.topic, {})
        lines = [
            "streamproc demo report",
            "======================",
            f"input topic            {v.topic} ({len(v.end_offsets)} partitions)",
            f"frames in              {v.inputs}",
            f"results out            {v.results}   dead-lettered {v.dead_lettered}",
            f"missing                {len(v.missing)}",
            f"duplicates             {v.duplicates}",
            f"throughput             {v.inputs / self.processing_s:.1f} msg/s "
            f"({v.inputs} frames in {self.processing_s:.1f} s)",
            "end-to-end latency     "
            + "  ".join(f"{k.upper()} {val:.0f} ms" for k, val in pct.items()),
            "batch sizes            "
            + "  ".join(f"{size}:{count}" for size, count in sorted(sizes.items())),
            f"committed offsets      {dict(sorted(v.committed.items()))}",
            f"end offsets            {dict(sorted(v.end_offsets.items()))}",
            f"committed == end       {v.committed_equals_end}",
            "example results:",
        ]
        for value in v.examples:
            doc = orjson.loads(value)
            labels = ", ".join(f"{t['label']} {t['score']:.2f}" for t in doc["top5"][:3])
            src = doc["source"]
            lines.append(
                f"  {doc['camera_id']:<16} frame {doc['frame_no']:>4}  "
                f"[{src['partition']}@{src['offset']}]  {labels}"
            )
        lines.append(f"RESULT                 {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def run_demo(
    bootstrap_servers: str | None = None,
    rate: float = 20.0,
    limit: int | None = None,
    partitions: int = 4,
    work_dir: Path | None = None,
) -> DemoReport:
    """Run the whole demo; see the module docstring. Stops the broker it started."""
    broker: LocalKafka | None = None
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    run_dir = work_dir or Path(tempfile.mkdtemp(prefix="streamproc-demo-"))
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
        input_topic, output_topic = f"video.frames.{suffix}", f"video.labels.{suffix}"
        dlq_topic = f"{input_topic}.dlq"
        ensure_topics(bootstrap, {input_topic: partitions, output_topic: partitions, dlq_topic: 1})
        group_id = f"streamproc-demo-{suffix}"
        config = load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group_id},
                "pipelines": [
                    {
                        "name": "frames",
                        "input_topic": input_topic,
                        "output_topic": output_topic,
                        "workload": "video",
                    }
                ],
                "metrics": {"port": 0},
            }
        )
        total = limit or recording_size("video")
        print(
            f"replaying {total} real video frames at {rate:g} msg/s into {input_topic} ...",
            flush=True,
        )
        pipeline = Pipeline(config)
        pipeline.start()
        started_s = time.monotonic()
        produced: list[int] = []
        producer = threading.Thread(
            target=lambda: produced.append(
                produce("video", input_topic, bootstrap, partitions, total, rate, progress=False)
            ),
            name="replay",
        )
        producer.start()
        producer.join()
        summary = pipeline.run(exit_when_idle_s=3.0)
        processing_s = max(1e-9, time.monotonic() - started_s - 3.0)
        verdict = verify(bootstrap, input_topic, output_topic, dlq_topic, group_id)
        return DemoReport(verdict, summary, produced[0] if produced else 0, processing_s)
    finally:
        if broker is not None:
            broker.stop()
