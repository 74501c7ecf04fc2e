"""End-to-end latency of a light workload at a paced rate, per lane route (issue 28).

Runs the bench's own paced run (``streamproc.tools.bench.runner``: a fresh input and output
topic, ``streamproc`` in a child process with the bench config, the workload's real recording
replayed at ``--rate`` msg/s for ``--seconds``, latencies matched by the source headers) once
per route and repetition, the routes alternating, with ``worker.fused_lane`` set through
``STREAMPROC_WORKER__FUSED_LANE``. Prints each run and, per route, the median and range of the
end-to-end and in-pipeline P99 over the repetitions.

Usage::

    .venv/bin/streamproc kafka start --dir /tmp/kafka-lanes       # prints the bootstrap address
    .venv/bin/python benchmarks/lane_routes.py --bootstrap 127.0.0.1:<port> \\
        --workload trades --rate 37000 --repetitions 5

Measured output: docs/benchmarks.md, "The latest table (issue 28: fused lanes)".
"""

from __future__ import annotations

import argparse
import os
import statistics

from streamproc.tools.bench import runner

ROUTES = ("always", "never")
"""``worker.fused_lane`` values compared: fused, staged."""


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="broker host:port")
    parser.add_argument("--workload", default="trades", choices=("trades", "iot"))
    parser.add_argument("--rate", type=float, default=37_000.0, help="msg/s")
    parser.add_argument("--seconds", type=float, default=4.0, help="replay length per run")
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    ctx = runner._Context(args.bootstrap, args.workload, runner.PLANS[args.workload], "", "", ())
    p99: dict[str, list[float]] = {route: [] for route in ROUTES}
    inside: dict[str, list[float]] = {route: [] for route in ROUTES}
    for repetition in range(args.repetitions):
        for route in ROUTES:
            os.environ["STREAMPROC_WORKER__FUSED_LANE"] = route
            run = runner._paced_run(ctx, "streamproc", args.rate, args.seconds)
            latency = run.info.get("latency") or {}
            if "p99_ms" not in latency:
                print(f"{route:<7} {repetition + 1}: no latency ({run.info.get('error')})")
                continue
            p99[route].append(latency["p99_ms"])
            inside[route].append(latency["p99_processing_ms"])
            print(
                f"{route:<7} {repetition + 1}: P50 {latency['p50_ms']:.1f} ms, P99 "
                f"{latency['p99_ms']:.1f} ms, in-pipeline P99 "
                f"{latency['p99_processing_ms']:.1f} ms, {run.messages} results, "
                f"CPU {run.cpu_us_per_msg or float('nan'):.1f} µs/msg",
                flush=True,
            )
    print(f"{args.workload} at {args.rate:,.0f} msg/s for {args.seconds:g} s; median [min-max]:")
    for route in ROUTES:
        if p99[route]:
            print(
                f"  fused_lane {route:<7} P99 {_spread(p99[route])} ms, in-pipeline P99 "
                f"{_spread(inside[route])} ms ({len(p99[route])} runs)"
            )


if __name__ == "__main__":
    main()
