"""The results producer's ``linger.ms``: CPU per message against end-to-end latency.

Usage (from a checkout's root, with its .venv; a broker at ``--bootstrap``)::

    .venv/bin/python benchmarks/archive/linger.py --bootstrap 127.0.0.1:9092 --workload trades \\
        --rate 8000 --seconds 4 --lingers 0,2,5,10,20 --repetitions 3

For each ``linger.ms`` value, alternately (A B C ... A B C ...), a paced replay of the
workload's real messages at ``--rate`` msg/s into a fresh ``LogAppendTime`` topic (4
partitions) while streamproc runs in a process of its own (the bench's child, see
``streamproc.tools.bench``); then prints per value the median and range over the repetitions
of: the process CPU-µs per result (first input to last acknowledgement), the CPU-µs per result
of librdkafka's threads (``rdk:*``: the consumer's and the producer's), and P50/P99
end-to-end latency from the input's broker append time to the result's broker append time
(the output's linger and append counted, the replayer's leg not).
"""

from __future__ import annotations

import argparse
import statistics
import uuid

from streamproc.tools.bench.child import Job, run_child, run_replay
from streamproc.tools.bench.measure import create_topics, end_to_end, output_stats
from streamproc.tools.verify import read_topic

PARTITIONS = 4


def _run(args: argparse.Namespace, linger_ms: float) -> dict[str, float]:
    suffix = uuid.uuid4().hex[:6]
    source, sink = f"linger.in.{suffix}", f"linger.out.{suffix}"
    create_topics(args.bootstrap, [source, sink], PARTITIONS)
    count = int(args.rate * args.seconds)
    job = Job(
        "streamproc",
        args.workload,
        args.bootstrap,
        source,
        sink,
        f"linger-{suffix}",
        messages=count,
        idle_s=30.0,
        linger_ms=linger_ms,
    )
    outcome = run_child(
        job,
        on_ready=lambda: run_replay(
            args.workload, source, args.bootstrap, PARTITIONS, count, args.rate
        ),
    )
    if outcome.error:
        raise RuntimeError(outcome.error)
    outputs = read_topic(args.bootstrap, sink)
    stats = output_stats(outputs)
    latency = end_to_end(read_topic(args.bootstrap, source), outputs)
    cpu_s = outcome.trace.cpu_s()
    if latency is None or cpu_s is None or not stats.count:
        raise RuntimeError(f"linger {linger_ms}: no results matched")
    rdkafka_s = sum(s for name, s in outcome.trace.threads_cpu_s.items() if name.startswith("rdk"))
    return {
        "cpu_us": 1e6 * cpu_s / stats.count,
        "rdkafka_us": 1e6 * rdkafka_s / stats.count,
        "p50_ms": latency.p50_ms,
        "p99_ms": latency.p99_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--workload", default="trades")
    parser.add_argument("--rate", type=float, default=8000.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--lingers", default="0,2,5,10,20")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    lingers = [float(value) for value in args.lingers.split(",")]
    runs: dict[float, list[dict[str, float]]] = {linger: [] for linger in lingers}
    for repetition in range(args.repetitions):
        for linger in lingers:
            runs[linger].append(_run(args, linger))
            print(f"  {repetition + 1}/{args.repetitions} linger.ms={linger:g}", flush=True)
    print(
        f"{args.workload} at {args.rate:g} msg/s, {args.seconds:g} s, "
        f"median [range] of {args.repetitions}"
    )
    head = ("linger.ms", "CPU-µs/msg", "rdkafka µs/msg", "P50 ms", "P99 ms")
    print("  ".join(f"{h:>18}" for h in head))
    for linger, rows in runs.items():
        cells = []
        for key in ("cpu_us", "rdkafka_us", "p50_ms", "p99_ms"):
            values = [row[key] for row in rows]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        print("  ".join(f"{c:>18}" for c in (f"{linger:g}", *cells)))


if __name__ == "__main__":
    main()
