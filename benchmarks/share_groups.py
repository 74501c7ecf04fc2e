"""Past the partition count: the same ``streamproc run`` processes as a consumer group and as a
share group (``kafka.group_type``), on a topic with fewer partitions than processes.

Usage (from a checkout's root, with its .venv; a local broker is started unless
``--bootstrap`` or ``$KAFKA_BOOTSTRAP_SERVERS`` names one)::

    .venv/bin/python benchmarks/share_groups.py --reps 5

Per repetition and mode (the modes alternate, the first one swapping each repetition):
``--processes`` processes (6) join one group on a video topic of ``--partitions`` partitions (2),
each with the slow model plug-in of the tests (``tests/support/slow.py``: the built-in video
workload, its model sleeping ``--delay-s``, 0.8 s, per batch of 4, as a slow device would; on
the CPU device; the latency target raised so that batches stay at 4). Once every process is
ready (a consumer group: every partition owned and no rebalance for 2 s; a share group: every
member assigned), ``--frames`` real frames (960) are produced, frame ``i`` to partition
``i % partitions`` (the recording's keys would put 4 of 5 on one partition, and a share group
assigns each member some of the partitions, not all), paced (``--rate``, 150/s) so that a
record batch holds about one frame: the broker hands a share member whole record batches, so a
poll of 16 then holds four full batches of 4. The processes exit when idle (10 s). Throughput is
frames over the span from the first to the last result (the output records' timestamps);
records per process come from each process's summary line. Every input must have exactly one
result.

On 2 CPU cores the model's sleep, not the decode, must bound the processes: at 0.2 s per batch
six processes decoding video took the cores (load 2.6) and the ratio measured the CPU instead.

The summary prints per mode the median [min-max] throughput and the share/consumer ratio per
repetition; the per-process counts show how many members were busy.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_PARTITION
from streamproc.tools.bench.measure import format_spread
from streamproc.tools.kafka_local import broker_unless_given
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic

MODES = ("consumer", "share")
IDLE_S = 10.0  # members assigned first wait for the others before the frames come
READY_TIMEOUT_S = 180.0


@dataclass
class Run:
    """One mode of one repetition."""

    mode: str
    rep: int
    frames_per_s: float
    taken: list[int]  # records per process
    results: int
    duplicates: int


def config(bootstrap: str, mode: str, topic: str, delay_s: float) -> dict[str, object]:
    """The processes' config: one group of ``mode`` over ``topic`` (a slow video model)."""
    suffix = topic.rsplit(".", 1)[-1]
    return {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": f"bench-{mode}-{suffix}",
            "group_type": mode,
            # 4 of 6 consumer-group members never get a partition: they must outwait the run
            "assignment_timeout_s": 1800,
            "consume_batch_messages": 16,  # a share member's poll: four batches of 4
        },
        "pipelines": [
            {
                "name": "p",
                "input_topic": topic,
                "output_topic": f"{topic}.out",
                "workload": "tests.support.slow:make_workload",
                "options": {"base": "video", "delay_s": delay_s},
                # a slow device: batches of 4 are what it is for (the default target of a
                # low-priority pipeline would cap batches at 1 record against a 200 ms model)
                "latency_target_ms": 60_000,
            }
        ],
        "batching": {"max_batch_size": 4, "max_wait_ms": 10},
        "worker": {"torch_threads": 1},
        "metrics": {"port": 0},
        "logging": {"format": "json"},
    }


def ready(mode: str, logs: list[Path], partitions: int) -> bool:
    """Every process running and, for a share group, assigned; for a consumer group, every
    partition owned and no ownership change for 2 s (the group has settled)."""
    texts = [log.read_text() for log in logs]
    if not all('"event": "pipeline running"' in text for text in texts):
        return False
    if mode == "share":
        return all('"event": "share group assignment"' in text for text in texts)
    owned: dict[str, str] = {}
    last_s = 0.0
    for i, text in enumerate(texts):
        for line in text.splitlines():
            if '"event": "partitions assigned"' in line or '"event": "partitions revoked"' in line:
                last_s = max(last_s, logs[i].stat().st_mtime)
                names = re.findall(r"\[(\d+)\]", line)
                for name in names:
                    if "assigned" in line:
                        owned[name] = str(i)
                    else:
                        owned.pop(name, None)
    return len(owned) >= partitions and time.time() - last_s > 2.0


def run_once(bootstrap: str, mode: str, rep: int, args: argparse.Namespace, work: Path) -> Run:
    """Start the processes, wait until they are ready, produce, wait for them to exit."""
    topic = f"share-bench.{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {topic: args.partitions, f"{topic}.out": args.partitions})
    path = work / f"{mode}-{rep}.yaml"
    path.write_text(yaml.safe_dump(config(bootstrap, mode, topic, args.delay_s)))
    logs = [work / f"{mode}-{rep}-{i}.log" for i in range(args.processes)]
    procs = []
    for log in logs:
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "streamproc",
                        "run",
                        "--config",
                        str(path),
                        "--exit-when-idle-s",
                        str(IDLE_S),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=os.environ.copy(),
                )
            )
    try:
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while not ready(mode, logs, args.partitions):
            exited = [
                (log, p.returncode)
                for log, p in zip(logs, procs, strict=True)
                if p.poll() is not None
            ]
            if time.monotonic() > deadline_s or exited:
                # the logs go with the temporary folder: what failed is in the message
                log, code = exited[0] if exited else (logs[0], None)
                state = f"exited {code}" if exited else f"not ready after {READY_TIMEOUT_S:.0f} s"
                why = f"{log.name} {state}:\n{log.read_text()[-1500:]}"
                raise RuntimeError(f"{mode}: the processes did not get ready ({why})")
            time.sleep(0.5)  # polling the processes' logs, as an operator would
        # frame i to partition i % partitions: the recording's keys put 480 of 600 frames on
        # one of 2 partitions, and a share group assigns each member some partitions, not all
        produce(
            "video", topic, bootstrap, args.partitions, args.frames, args.rate, False, spread=True
        )
        codes = [p.wait(args.frames * args.delay_s + 300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0] * len(procs):
        failed = next(log for log, code in zip(logs, codes, strict=True) if code != 0)
        raise RuntimeError(f"{mode}: exit codes {codes}; {failed}: {failed.read_text()[-1500:]}")
    taken = []
    for log in logs:
        match = re.search(rf"p: (\d+) consumed from {re.escape(topic)}", log.read_text())
        taken.append(int(match.group(1)) if match else 0)
    dump = read_topic(bootstrap, f"{topic}.out")
    inputs = Counter(
        (int(h[H_PARTITION]), int(h[H_OFFSET])) for _, _, h, _ in dump.records.values()
    )
    stamps = sorted(ts for _, _, _, ts in dump.records.values())
    span_s = max(1e-3, (stamps[-1] - stamps[0]) / 1000.0)
    if len(inputs) != args.frames:
        sent = read_topic(bootstrap, topic).records
        missing = sorted(set(sent) - set(inputs))
        raise RuntimeError(
            f"{mode}: {len(inputs)} of {args.frames} inputs have a result; missing {missing}"
        )
    return Run(mode, rep, args.frames / span_s, taken, len(inputs), len(dump.records) - len(inputs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--frames", type=int, default=960)
    parser.add_argument("--rate", type=float, default=150.0, help="frames/s produced")
    parser.add_argument("--delay-s", type=float, default=0.8, help="model sleep per batch")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="share-bench-") as tmp:
        work = Path(tmp)
        with broker_unless_given(args.bootstrap, work / "kafka") as bootstrap:
            for rep in range(args.reps):
                order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    run = run_once(bootstrap, mode, rep, args, work)
                    runs.append(run)
                    print(
                        f"rep {rep} {mode:8} {run.frames_per_s:7.1f} frames/s  "
                        f"per process {sorted(run.taken, reverse=True)}  "
                        f"busy {sum(1 for n in run.taken if n > 0)}/{args.processes}  "
                        f"duplicates {run.duplicates}",
                        flush=True,
                    )
    print(
        f"\n{args.processes} processes, {args.partitions} partitions, {args.frames} frames, "
        f"model {args.delay_s * 1000:.0f} ms per batch of 4, {args.reps} repetitions"
    )
    for mode in MODES:
        rates = [r.frames_per_s for r in runs if r.mode == mode]
        print(f"  {mode:8} frames/s {format_spread(rates)}")
    ratios = [
        next(r.frames_per_s for r in runs if r.mode == "share" and r.rep == rep)
        / next(r.frames_per_s for r in runs if r.mode == "consumer" and r.rep == rep)
        for rep in range(args.reps)
    ]
    print(f"  share / consumer throughput {format_spread(ratios)} (per repetition)")
    busiest = [max(r.taken) / max(1, min(r.taken)) for r in runs if r.mode == "share"]
    print(f"  share: busiest / least busy process {format_spread(busiest)}")
    print(f"  median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
