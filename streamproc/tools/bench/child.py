"""One contender run in a process of its own, so that its process CPU time is its own.

The parent describes the run as a :class:`Job`; :func:`run_child` starts a process from a
``forkserver`` that has torch, confluent-kafka and streamproc imported already (a fresh
interpreter would spend 3 s of this machine's 2 cores importing them for each of the ~100 runs
of a bench; a plain ``fork`` of the parent would copy its librdkafka and OpenMP threads' state,
which is not fork-safe). The child measures its own CPU window
(:class:`~streamproc.tools.bench.cpu.CpuMeter`), runs the contender and sends back an
:class:`ChildReport`; for a paced run it first says when it is ready (owns its partitions), and the
parent then starts the replay.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

from streamproc.records import Record
from streamproc.tools.bench.cpu import CpuMeter, CpuTrace

PRELOAD = [
    "torch",
    "numpy",
    "confluent_kafka",
    "streamproc.pipeline",
    "streamproc.workloads.trades",
    "streamproc.workloads.iot",
    "streamproc.workloads.video",
    "streamproc.tools.bench.child",
    "streamproc.tools.bench.contenders",
    "streamproc.tools.bench.floor",
    "streamproc.tools.replay",
]
"""Modules the forkserver imports once; every child starts with them."""

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


@dataclass(frozen=True)
class Job:
    """One contender run.

    Attributes:
        contender: ``passthrough``, ``floor``, ``floor+work``, ``serial``, ``streamproc`` or
            ``model-only`` (Quix Streams runs in its own environment, not here).
        workload: built-in workload name.
        bootstrap, source, sink: broker and topics (unused by ``model-only``).
        group: consumer group id.
        messages: results to wait for.
        batch_size: floor: most messages per ``consume``; floor+work: messages per batch.
        decode_mode: streamproc's ``worker.decode_mode``; ``process`` also counts the decode
            processes' CPU.
        fixed_batch_size: streamproc with the adaptive batch size off, at this size.
        fused_lane: streamproc's ``worker.fused_lane`` (``auto``, ``never``: staged,
            ``always``: fused).
        linger_ms: the results producer's ``linger.ms`` (None: streamproc's default).
        idle_s: streamproc stops after this many seconds without input (a fallback: it stops
            once ``messages`` results are acknowledged).
        records, model_sizes, model_budget_s: ``model-only``'s preloaded rows, batch sizes and
            seconds per size.
    """

    contender: str
    workload: str
    bootstrap: str = ""
    source: str = ""
    sink: str = ""
    group: str = ""
    messages: int = 0
    batch_size: int = 256
    decode_mode: str = "thread"
    fixed_batch_size: int | None = None
    fused_lane: str = "auto"
    linger_ms: float | None = None
    idle_s: float = 10.0
    records: tuple[Record, ...] = ()
    model_sizes: tuple[int, ...] = ()
    model_budget_s: float = 1.0


@dataclass
class ChildReport:
    """What a child sends back: its CPU trace, the contender's summary, or the error."""

    trace: CpuTrace
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


TORCH_THREADS = 1
"""torch's intra-op threads in every contender (streamproc's bench config says the same). On
2 shared cores, two OpenMP threads wait at every parallel region for a core someone else holds:
measured here under a load average of 6.5, EfficientNet-Lite0 at batch 1 took 401 ms per image
with torch's default 2 threads and 38 ms with 1."""


def _run(job: Job, meter: CpuMeter, ready: Callable[[], None]) -> dict[str, Any]:
    import torch

    from streamproc.tools.bench import contenders, floor

    torch.set_num_threads(TORCH_THREADS)
    if job.contender == "passthrough":
        return contenders.passthrough(job.bootstrap, job.source, job.sink, job.messages, meter)
    if job.contender == "serial":
        return contenders.serial(
            job.bootstrap, job.source, job.sink, job.messages, job.workload, meter
        )
    if job.contender == "model-only":
        return contenders.model_only(
            job.workload, list(job.records), job.model_sizes, job.model_budget_s
        )
    config = contenders.pipeline_config(
        job.bootstrap,
        job.source,
        job.sink,
        job.workload,
        job.group,
        job.decode_mode,
        job.fixed_batch_size,
        job.linger_ms,
        job.fused_lane,
    )
    if job.contender in ("floor", "floor+work"):
        work = floor.Work(job.workload, job.batch_size) if job.contender == "floor+work" else None
        return floor.run_floor(config, job.messages, work, job.batch_size, meter, ready)
    if job.contender == "streamproc":
        return contenders.run_streamproc(config, job.messages, meter, ready, job.idle_s)
    raise ValueError(f"unknown contender {job.contender!r}")


def _child_main(job: Job, conn: Connection, ready: Event) -> None:
    from streamproc import logs

    logs.configure("warning", "console")
    # The heap inherited from the forkserver (torch, streamproc: ~200,000 objects) moves out of
    # the collector's reach, as streamproc's pipeline does with its own at start: otherwise the
    # first full collection inside a contender's window walks all of it and copies every page
    # it touches (copy-on-write). Measured on the floor, 20,000 trades, 3 alternating pairs:
    # 5.2-6.5 CPU-µs/msg in the parent process, 11.6-11.7 in a child (15,500 page faults
    # against 2,300, one gen-2 collection against none).
    gc.collect()
    gc.freeze()
    meter = CpuMeter(children=job.decode_mode == "process")
    try:
        outcome = ChildReport(meter.trace, _run(job, meter, ready.set))
    except BaseException:
        outcome = ChildReport(meter.trace, {}, traceback.format_exc()[-3000:])
    conn.send(outcome)
    conn.close()


def run_child(
    job: Job, on_ready: Callable[[], None] | None = None, timeout_s: float = 900.0
) -> ChildReport:
    """Run ``job`` in a child process and return its outcome.

    Args:
        on_ready: called in this process once the child owns its partitions (then the child
            waits for input: a paced replay runs here); None for a backlog run.
        timeout_s: the child is killed after this many seconds.
    """
    receive, send = _CONTEXT.Pipe(duplex=False)
    ready = _CONTEXT.Event()
    process = _CONTEXT.Process(
        target=_child_main, args=(job, send, ready), name=f"bench-{job.contender}", daemon=False
    )
    process.start()
    send.close()
    deadline_s = time.monotonic() + timeout_s
    try:
        if on_ready is not None:
            while not ready.wait(0.2):
                if receive.poll() or not process.is_alive() or time.monotonic() > deadline_s:
                    break
            if ready.is_set():
                on_ready()
        while not receive.poll(0.5):
            if not process.is_alive() or time.monotonic() > deadline_s:
                break
        if receive.poll():
            outcome: ChildReport = receive.recv()
        else:
            outcome = ChildReport(
                CpuTrace(), {}, f"child exited ({process.exitcode}) without result"
            )
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(5)
        receive.close()
    return outcome


def run_replay(
    workload: str, topic: str, bootstrap: str, partitions: int, count: int, rate: float
) -> None:
    """The paced replay (:func:`streamproc.tools.replay.produce`, open loop at ``rate`` msg/s)
    from a process of its own, as a real producer: in the contender's it would compete for the
    GIL, and a fresh ``streamproc produce`` would first spend 3 s importing.

    Raises:
        RuntimeError: the replay failed (not every message acknowledged).
    """
    process = _CONTEXT.Process(
        target=_replay_main,
        args=(workload, topic, bootstrap, partitions, count, rate),
        name="bench-replay",
    )
    process.start()
    process.join(600)
    if process.is_alive():
        process.kill()
        process.join(5)
    if process.exitcode != 0:
        raise RuntimeError(f"replay into {topic} failed (exit code {process.exitcode})")


def _replay_main(
    workload: str, topic: str, bootstrap: str, partitions: int, count: int, rate: float
) -> None:
    from streamproc import logs
    from streamproc.tools.replay import produce

    logs.configure("warning", "console")
    produce(workload, topic, bootstrap, partitions, count, rate, progress=False)
