"""Paced soak: is the consumer's memory flat over minutes of steady load?

``make soak`` (about 6 minutes): a local broker, a `streamproc run` process on the trades
workload, an open-loop replay at ``--rate`` msg/s for ``--minutes``; the consumer's RSS is sampled
every 5 s after a 60 s warm-up. Prints min/mean/max RSS and the largest deviation from the mean
(target: within +-5 %), and writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (``/proc/<pid>/statm``, as ``ps`` reads it).

    Raises:
        OSError: no such process.
    """
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES


def summarise(rss: Sequence[int]) -> dict[str, Any]:
    """Min/mean/max of the RSS samples (bytes) in MiB, the largest deviation from the mean (a
    fraction of it) and whether it is within 5 % (the target).

    Raises:
        ValueError: no samples (the run was shorter than the warm-up).
    """
    if not rss:
        raise ValueError("no RSS sample: the run ended within the warm-up")
    mean = sum(rss) / len(rss)
    deviation = max(abs(r - mean) for r in rss) / mean
    return {
        "samples": len(rss),
        "rss_min_mib": min(rss) / 2**20,
        "rss_mean_mib": mean / 2**20,
        "rss_max_mib": max(rss) / 2**20,
        "max_deviation_from_mean": deviation,
        "within_5_percent": deviation <= 0.05,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=1000.0, help="msg/s")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--workload", default="trades")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="streamproc-soak-"))
    broker = LocalKafka(work / "kafka", ensure_kafka_jars())
    bootstrap = broker.start()
    consumer = None
    try:
        suffix = uuid.uuid4().hex[:6]
        source, sink = f"soak.{suffix}", f"soak.out.{suffix}"
        ensure_topics(bootstrap, {source: 4, sink: 4})
        config = work / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "kafka": {
                        "bootstrap_servers": bootstrap,
                        "group_id": f"soak-{suffix}",
                        "producer": {"queue.buffering.max.kbytes": 65536},
                        "consumer": {"queued.max.messages.kbytes": 16384},
                    },
                    "pipelines": [
                        {
                            "name": "soak",
                            "input_topic": source,
                            "output_topic": sink,
                            "workload": args.workload,
                        }
                    ],
                    "metrics": {"port": 0},
                    "batching": {"max_batch_size": 256},
                    "buffers": {"ring_capacity": 4096},
                }
            )
        )
        consumer = subprocess.Popen(
            [sys.executable, "-m", "streamproc", "run", "--config", str(config)],
            stdout=(work / "consumer.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        total = int(args.rate * args.minutes * 60)
        replay = threading.Thread(
            target=produce,
            args=(args.workload, source, bootstrap, 4, total, args.rate),
            kwargs={"progress": False},
        )
        started = time.monotonic()
        replay.start()
        samples: list[tuple[float, int]] = []
        while replay.is_alive():
            replay.join(5.0)  # sampling period
            elapsed = time.monotonic() - started
            if elapsed >= 60:
                samples.append((elapsed, rss_bytes(consumer.pid)))
        result = {
            "workload": args.workload,
            "rate_msg_s": args.rate,
            "minutes": args.minutes,
            "messages": total,
            **summarise([r for _, r in samples]),
        }
        out = Path("benchmarks/results")
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps({**result, "series": samples}, indent=1))
        print(json.dumps(result, indent=1))
        return 0 if result["within_5_percent"] else 1
    finally:
        if consumer is not None:
            consumer.terminate()
            consumer.wait(60)
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
