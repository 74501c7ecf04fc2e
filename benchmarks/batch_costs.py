"""Per-batch fixed costs of the in-process path, without Kafka: lane -> dispatcher (cut, lease,
decode) -> device worker (the real trades model on CPU) -> completion -> resequencer -> a
result handler that only counts. Tiny batches make the per-batch costs dominate.

    .venv/bin/python benchmarks/batch_costs.py --batch 4 --messages 20000 [--inline never]
    .venv/bin/python benchmarks/batch_costs.py --messages 64       # a check, in seconds

Prints the process CPU-µs per batch and per message over the run, and each Python thread's
CPU-µs per batch (``/proc/self/task/<tid>/stat``, 10 ms ticks: run enough batches). One torch
thread, like the bench. Run two checkouts alternately and compare medians.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from collections.abc import Sequence

import torch

from streamproc.decode import DecodeThreads, ThreadDecoder
from streamproc.device import DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.placement import DeviceLoad
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.models.precision import build_model
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.resequencer import Resequencer
from streamproc.records import Record, TopicPartition
from streamproc.tools.bench.cpu import thread_cpu
from streamproc.workloads import load_workload
from streamproc.workloads.registry import BUILTIN_WORKLOADS


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of every live Python thread, by name (``/proc``, see ``tools/bench/cpu``)."""
    stats = thread_cpu()
    return {t.name: stats[t.native_id].cpu_s for t in threading.enumerate() if t.native_id in stats}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="trades")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--inline", choices=("never", "always"), default="always")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = load_workload(args.workload)
    tp = TopicPartition("in", 0)
    tracker = OffsetTracker()
    generation = tracker.assign([tp])[tp]
    metrics = Metrics()
    lane = Lane(
        "in",
        PartitionBuffers(args.messages + 1, 1.0, 0.5),
        Batcher(args.batch, 1 << 30, 0.0, adaptive=False),
        tracker,
    )
    lane.assign([tp])
    values = [
        v
        for _, v, _ in itertools.islice(BUILTIN_WORKLOADS[args.workload].messages(), args.messages)
    ]
    pool = StagingPool(8, args.batch, workload.item_shape, workload.item_dtype, pin=False)
    load = DeviceLoad("in", ["cpu:0"], 2, 30.0, metrics)
    done = threading.Event()
    handled = [0]

    def handle(result: DeviceResult) -> None:
        handled[0] += len(result.batch)
        if handled[0] >= args.messages:
            done.set()

    fatal: list[BaseException] = []
    resequencer = Resequencer("in", handle, load.released, fatal.append, metrics=metrics)

    def completed(result: DeviceResult, release: Release) -> None:
        load.completed(result.batch.batch_id, result.inference_s)
        resequencer.put(result, release)

    model = build_model(workload, torch.device("cpu"), "fp32", "worker.precision")
    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 1, completed, fatal.append)
    threads = DecodeThreads(2)
    decoder = (
        ThreadDecoder(workload, threads, 1 << 20, lane="in")  # the pool (any checkout)
        if args.inline == "never"
        else ThreadDecoder(workload, threads, 1 << 20, lane="in", route="inline")
    )
    dispatcher = Dispatcher(
        lane, decoder, pool, [worker], load, lambda flow: None, metrics, fatal.append
    )
    worker.start()
    resequencer.start()
    records = [
        Record(tp, o, None, v, (), 0, time.monotonic(), generation) for o, v in enumerate(values)
    ]
    lane.offer(records)
    before = thread_cpu_s()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    dispatcher.start()
    assert done.wait(600), "not finished"
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    after = thread_cpu_s()
    dispatcher.stop(5)
    worker.close(5)
    resequencer.close(5)
    threads.shutdown(wait=True)
    assert not fatal, fatal
    batches = args.messages / args.batch
    print(
        f"{args.workload} batch {args.batch} inline={args.inline}: {batches:.0f} batches, "
        f"{1e6 * cpu_s / batches:.1f} CPU-us/batch, {1e6 * cpu_s / args.messages:.2f} "
        f"CPU-us/msg, {args.messages / wall_s:,.0f} msg/s"
    )
    for name, seconds in sorted(after.items(), key=lambda kv: -kv[1]):
        used = seconds - before.get(name, 0.0)
        if used > 0:
            print(f"  thread {name:<16} {1e6 * used / batches:7.1f} CPU-us/batch")


if __name__ == "__main__":
    main()
