"""What tracing costs per message: the whole pipeline (``benchmarks/pipeline_ab.py``, one
process per run) over the same pre-produced input, alternating the contenders within each
repetition, for trades and iot (``make bench-tracing``; docs/benchmarks.md "Tracing")::

    off        tracing.enabled: false (this checkout)
    without    a checkout without tracing (``--without PATH``, its own .venv; optional)
    ratio-1%   on: the local backend (streamproc tracing start's Zipkin and collector), records
               without a traceparent, tracing.sample_ratio 0.01 (1 % of batches traced)
    all        on, tracing.sample_ratio 1.0: every batch traced (a process span, 5 stage
               spans; the results carry the batch span's context)
    contexts   on, every input record with a sampled traceparent of its own (a copy of the
               input): every batch traced, linked to each record, and one create span per
               result

First, the hooks alone (``--hooks-only`` stops there): the tracing work on the hot path per
record, measured in this process on real records of each workload (its replay data, batches of
256): a batch's cut and its four stage laps (``StageRecorder.cut``, ``StageClock.lap``) without a
tracer, and with one sampling 1 % of roots (the records' headers read, a process span started
and, 99 times in 100, dropped by the sampler). Thread CPU time, alternating, 5 repetitions; the
difference per record is what tracing at 1 % adds before any span is exported, to set against
the pipeline's CPU per message.

The broker is ``--bootstrap`` or ``$KAFKA_BOOTSTRAP_SERVERS``, else a local one for the run. Per
repetition the contenders run in rotated order; the summary prints, per workload and contender,
the process CPU-µs per message (model loading excluded) as median [min-max], and the ratio to
``off`` of the same repetition, median [min-max]: the question is the cost per message, which
the shared cores disturb far less as CPU time than as wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamproc.config.sections import TracingConfig
from streamproc.metrics import Metrics
from streamproc.records import Record, TopicPartition
from streamproc.stages import BATCH_STAGES, StageRecorder
from streamproc.tools.bench.measure import format_spread
from streamproc.tools.kafka_local import broker_unless_given
from streamproc.tools.replay import messages
from streamproc.tools.tracing_local import LocalTracing
from streamproc.tracing.batch import BatchTracer
from streamproc.tracing.export import Tracing

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pipeline_ab.py"


Contender = tuple[Path, dict[str, Any], bool]
"""The checkout a contender runs from, its tracing section, and whether it reads the traced
copy of the input."""


def contenders(endpoint: str, without: Path | None) -> dict[str, Contender]:
    """The contenders of the module docstring, by name."""
    found: dict[str, Contender] = {"off": (ROOT, {"enabled": False}, False)}
    if without is not None:
        found["without"] = (without, {}, False)
    found["ratio-1%"] = (ROOT, {"endpoint": endpoint, "sample_ratio": 0.01}, False)
    found["all"] = (ROOT, {"endpoint": endpoint, "sample_ratio": 1.0}, False)
    found["contexts"] = (ROOT, {"endpoint": endpoint, "sample_ratio": 0.0}, True)
    return found


def run_once(
    contender: Contender,
    workload: str,
    label: str,
    args: argparse.Namespace,
    bootstrap: str,
    out: Path,
    script: Path,
) -> dict[str, Any]:
    """One pipeline run of ``contender``'s checkout (its own .venv); its JSON row."""
    checkout, tracing, traced = contender
    command = [
        str(checkout / ".venv" / "bin" / "python"),
        str(script),
        "--workload", workload, "--messages", str(args.messages), "--bootstrap", bootstrap,
        "--out", str(out), "--label", label, "--tracing", json.dumps(tracing),
        *(["--traced-input"] if traced else []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{label} {workload} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def hook_costs(workload: str, batch: int = 256, batches: int = 400, repetitions: int = 5) -> None:
    """Print the CPU-µs per record of a batch's cut and laps without and with a tracer (1 %
    roots), alternating; see the module docstring."""
    records = [
        Record(TopicPartition("t", i % 4), i, m.key, m.value, m.headers, 0, 0.0)
        for i, m in enumerate(islice(messages(workload), batch))
    ]
    consumed = np.zeros(batch)
    metrics = Metrics()
    tracing = Tracing(TracingConfig(sample_ratio=0.01), metrics, InMemorySpanExporter())
    tracer = BatchTracer(
        tracing.tracer, "t", "g", 128,
        metrics.trace_context_invalid.labels("t"), metrics.trace_links_dropped.labels("t"),
    )  # fmt: skip
    recorders = {
        "off": StageRecorder(metrics.stage, "t"),
        "1% roots": StageRecorder(metrics.stage, "t", tracer=tracer),
    }
    per_record: dict[str, list[float]] = {name: [] for name in recorders}
    for rep in range(repetitions):
        for name in list(recorders)[:: 1 if rep % 2 == 0 else -1]:
            recorder = recorders[name]
            started_s = time.thread_time()
            for _ in range(batches):
                clock = recorder.cut(records, consumed, 0.0, 0.0)
                for stage in BATCH_STAGES:
                    clock.lap(stage)
                if clock.trace is not None:
                    clock.trace.finish()
            per_record[name].append(1e6 * (time.thread_time() - started_s) / (batches * batch))
    tracing.shutdown()
    added = [on - off for on, off in zip(per_record["1% roots"], per_record["off"], strict=True)]
    print(
        f"  hooks {workload:6} per record: off {format_spread(per_record['off'])} CPU-us, "
        f"1% roots {format_spread(per_record['1% roots'])} CPU-us, "
        f"added {statistics.median(added):.3f} [{min(added):.3f}-{max(added):.3f}] CPU-us "
        f"(headers per record: {len(records[0].headers)})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--workloads", default="trades,iot")
    parser.add_argument("--without", type=Path, help="a checkout without tracing (its .venv)")
    parser.add_argument("--hooks-only", action="store_true", help="the hooks alone, no pipeline")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    workloads = args.workloads.split(",")
    print("tracing's hot-path hooks, per record (batches of 256, 5 alternating repetitions):")
    for workload in workloads:
        hook_costs(workload)
    if args.hooks_only:
        return
    with tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp:
        work = Path(tmp)
        script = work / "pipeline_ab.py"  # the same script for every checkout
        script.write_text(SCRIPT.read_text())
        backend = LocalTracing(work / "tracing")
        endpoint = backend.start()
        try:
            with broker_unless_given(args.bootstrap, work / "kafka") as bootstrap:
                runs = contenders(endpoint, args.without)
                names = list(runs)
                for rep in range(args.repetitions):
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for workload in workloads:
                        for name in order:
                            row = run_once(
                                runs[name], workload, name, args, bootstrap,
                                work / "rows.jsonl", script,
                            )  # fmt: skip
                            row["rep"] = rep
                            rows.append(row)
                            print(
                                f"rep {rep} {workload:6} {name:9} "
                                f"{row['cpu_us_per_msg']:7.1f} CPU-us/msg  "
                                f"{row['msg_s'] or 0:9,.0f} msg/s  "
                                f"messages {row['messages']}  spans {row.get('spans') or '-'}",
                                flush=True,
                            )
        finally:
            backend.stop()
    print(f"\n{args.messages} messages per run, {args.repetitions} repetitions")
    for workload in workloads:
        for name in names:
            mine = [r for r in rows if r["workload"] == workload and r["label"] == name]
            cpu = [r["cpu_us_per_msg"] for r in mine]
            ratios = [
                r["cpu_us_per_msg"]
                / next(
                    o["cpu_us_per_msg"]
                    for o in rows
                    if o["workload"] == workload and o["label"] == "off" and o["rep"] == r["rep"]
                )
                for r in mine
            ]
            print(
                f"  {workload:6} {name:9} CPU-us/msg {format_spread(cpu)}  "
                f"/ off {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
            )


if __name__ == "__main__":
    main()
