"""Where the CPU goes: one streamproc run on a local broker, CPU seconds per thread and of the
broker, for a pre-produced backlog (the profile behind docs/benchmarks.md).

    .venv/bin/python benchmarks/archive/thread_cpu.py trades 50000
    .venv/bin/python benchmarks/archive/thread_cpu.py video 370 \\
        '{"worker": {"decode_mode": "process"}}'

The optional JSON merges into the config sections of the bench's own config. Prints the
throughput (from output record timestamps), the CPU seconds of each Python thread of the
consumer (from ``/proc/self/task/<tid>/stat``), of the whole consumer process (librdkafka and
torch threads included) and of the broker.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import uuid
from pathlib import Path

from streamproc import logs
from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline
from streamproc.tools.bench.contenders import pipeline_config
from streamproc.tools.bench.measure import output_stats
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(stat_path: str) -> float:
    """User + system CPU seconds from a ``/proc/.../stat`` file."""
    with open(stat_path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def main(workload: str, messages: int, extra: dict[str, dict[str, object]]) -> None:
    logs.configure("warning", "console")
    broker = LocalKafka(Path(f"/tmp/streamproc-cpu-{uuid.uuid4().hex[:6]}"), ensure_kafka_jars())
    bootstrap = broker.start()
    try:
        source, sink = f"cpu.in.{uuid.uuid4().hex[:6]}", f"cpu.out.{uuid.uuid4().hex[:6]}"
        ensure_topics(bootstrap, {source: 4, sink: 4})
        produce(workload, source, bootstrap, 4, messages, None, progress=False)
        data = pipeline_config(bootstrap, source, sink, workload, "cpu").model_dump()
        for section, values in extra.items():
            data[section].update(values)
        threads: dict[str, float] = {}
        done = threading.Event()

        def sample() -> None:  # a thread's counters vanish with it: keep the last reading
            while not done.wait(0.2):
                for thread in threading.enumerate():
                    path = f"/proc/self/task/{thread.native_id}/stat"
                    if os.path.exists(path):
                        threads[thread.name] = cpu_s(path)

        sampler = threading.Thread(target=sample, name="sampler", daemon=True)
        before = {t.name for t in threading.enumerate()}
        own = resource.getrusage(resource.RUSAGE_SELF)
        broker_before = cpu_s(f"/proc/{broker._proc.pid}/stat")  # type: ignore[union-attr]
        sampler.start()
        summary = Pipeline(load_config(overrides=data)).run(exit_when_idle_s=3.0)
        done.set()
        sampler.join()
        after = resource.getrusage(resource.RUSAGE_SELF)
        broker_cpu = cpu_s(f"/proc/{broker._proc.pid}/stat") - broker_before  # type: ignore[union-attr]
        stats = output_stats(read_topic(bootstrap, sink))  # count and rate from timestamps
        print(
            f"{workload}: {stats.count} results, {stats.rate_msg_s or 0:.0f} msg/s, "
            f"batch sizes {summary.batch_sizes}"
        )
        for name, seconds in sorted(threads.items(), key=lambda kv: -kv[1]):
            if name not in before | {"sampler"} and seconds >= 0.01:
                print(f"  thread {name:<28} {seconds:6.2f} s")
        process_s = (after.ru_utime - own.ru_utime) + (after.ru_stime - own.ru_stime)
        print(f"  consumer process total         {process_s:6.2f} s (all threads)")
        print(f"  broker                         {broker_cpu:6.2f} s")
    finally:
        broker.stop()


if __name__ == "__main__":  # the guard decode processes (spawn) need
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
