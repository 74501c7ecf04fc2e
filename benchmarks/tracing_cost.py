"""What tracing costs per message: the whole pipeline (``benchmarks/pipeline_ab.py``, one
process per run) over the same pre-produced input, alternating the contenders within each
repetition, for trades and iot (``make bench-tracing``; docs/benchmarks.md "Tracing")::

    off        tracing.enabled: false (this checkout)
    without    a checkout without tracing (``--without PATH``, its own .venv; optional)
    ratio-1%   on: the local backend (streamproc tracing start's Zipkin and collector), records
               without a traceparent, tracing.sample_ratio 0.01 (1 % of batches traced)
    all        on, tracing.sample_ratio 1.0: every batch and every record traced (a process
               span, 5 stage spans, one create span per result)

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
from pathlib import Path
from typing import Any

from streamproc.tools.bench.measure import format_spread
from streamproc.tools.kafka_local import broker_unless_given
from streamproc.tools.tracing_local import LocalTracing

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pipeline_ab.py"


def contenders(endpoint: str, without: Path | None) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per contender: the checkout it runs from and its tracing section."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {"off": (ROOT, {"enabled": False})}
    if without is not None:
        found["without"] = (without, {})
    found["ratio-1%"] = (ROOT, {"endpoint": endpoint, "sample_ratio": 0.01})
    found["all"] = (ROOT, {"endpoint": endpoint, "sample_ratio": 1.0})
    return found


def run_once(
    checkout: Path,
    tracing: dict[str, Any],
    workload: str,
    label: str,
    args: argparse.Namespace,
    bootstrap: str,
    out: Path,
    script: Path,
) -> dict[str, Any]:
    """One pipeline run of ``checkout`` (its own .venv); its JSON row."""
    command = [
        str(checkout / ".venv" / "bin" / "python"),
        str(script),
        "--workload", workload, "--messages", str(args.messages), "--bootstrap", bootstrap,
        "--out", str(out), "--label", label, "--tracing", json.dumps(tracing),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{label} {workload} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--workloads", default="trades,iot")
    parser.add_argument("--without", type=Path, help="a checkout without tracing (its .venv)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    workloads = args.workloads.split(",")
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
                            checkout, tracing = runs[name]
                            row = run_once(
                                checkout, tracing, workload, name, args, bootstrap,
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
