"""``streamproc bench``: the plan, the alternating repetitions, the paced runs, the output files.

Per workload: the input is replayed once into a topic (``LogAppendTime``); then, ``repetitions``
times, every contender runs once in the same order (A B C ... A B C ...: a drift of this shared
machine's speed hits every contender alike), each in a process of its own with its own output
topic and consumer group; then the paced runs: an open-loop replay (from a separate process, as a
real producer) at 10 / 50 / 80 % of streamproc's median maximum, streamproc and (light
workloads) the honest floor alternately at each rate. Results go to
``benchmarks/results/bench.json`` and ``bench.png`` (the optional ``bench`` extra).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from streamproc.records import Priority, Record, TopicPartition
from streamproc.stages import STAGES
from streamproc.tools.bench.child import TORCH_THREADS, ChildReport, Job, run_child, run_replay
from streamproc.tools.bench.contenders import pipeline_config, run_quix
from streamproc.tools.bench.cpu import CpuTrace, machine_busy_s
from streamproc.tools.bench.measure import (
    OutputStats,
    Spread,
    create_topics,
    end_to_end,
    format_number,
    output_stats,
)
from streamproc.tools.bench.report import FLOOR, FLOOR_WORK, STREAMPROC, Row, Run, plot, render
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic
from streamproc.workloads import BUILTIN_WORKLOADS


@dataclass(frozen=True)
class WorkloadPlan:
    """What one workload runs.

    Attributes:
        messages: the pre-produced backlog each Kafka contender (but serial and Quix) processes.
        serial: messages for the serial loop and Quix Streams (they run one at a time).
        settled_batch: the size streamproc's adaptive batch size usually settles on here: the
            fixed-size row and the floor + work batches use it.
        model_sizes: batch sizes of the model-only ceiling.
        model_budget_s: seconds per batch size of the model-only ceiling.
        paced_s: replay duration (seconds) of the paced runs at 10 / 50 / 80 % load.
        paced_repetitions: how often each paced run is repeated (P50 and P99 are medians).
        light: light messages: the honest floor and floor + work run too.
    """

    messages: int
    serial: int
    settled_batch: int
    model_sizes: tuple[int, ...]
    model_budget_s: float
    paced_s: tuple[float, float, float]
    paced_repetitions: int
    light: bool

    def quick(self) -> WorkloadPlan:
        """For development: fewer serial, Quix and video messages, half the model-only time,
        one round of 2-second paced runs. Light backlogs stay as they are: their throughput is
        read off output append times, which a backlog of a few thousand messages spans in a
        few record batches."""
        return replace(
            self,
            messages=self.messages if self.light else max(60, self.messages // 3),
            serial=max(40, self.serial // 3),
            model_budget_s=self.model_budget_s / 2,
            paced_s=(2.0, 2.0, 2.0) if self.light else (6.0, 4.0, 4.0),
            paced_repetitions=1,
        )


PLANS = {
    "trades": WorkloadPlan(20_000, 300, 256, (16, 64, 256), 0.5, (4.0, 4.0, 4.0), 3, light=True),
    "iot": WorkloadPlan(20_000, 300, 256, (16, 64, 256), 0.5, (4.0, 4.0, 4.0), 3, light=True),
    "video": WorkloadPlan(370, 120, 2, (1, 2, 4, 8, 16), 1.5, (20.0, 12.0, 12.0), 1, light=False),
}
"""Per workload, in the order they run."""
LOADS = (0.1, 0.5, 0.8)
"""Paced rates as fractions of streamproc's median maximum (the issue's 50 % and 80 %, and
10 % to show the floor when the 2 cores are not saturated)."""
REPETITIONS = 5
PARTITIONS = 4
REPO = Path(__file__).resolve().parents[3]

PASSTHROUGH_NOTE = "no headers, no delivery callback, not idempotent, no commits"
FLOOR_NOTE = "idempotent acks=all lz4 linger 2; 4 headers; callback per msg; async commit"


@dataclass
class _Context:
    bootstrap: str
    workload: str
    plan: WorkloadPlan
    source: str
    suffix: str
    records: tuple[Record, ...]

    def topic(self, name: str) -> str:
        topic = f"bench.{self.workload}.{name}.{self.suffix}"
        create_topics(self.bootstrap, [topic], PARTITIONS)
        return topic


def _cpu_us_per_msg(trace: CpuTrace, stats: OutputStats) -> float | None:
    """Process CPU-µs per result from the first input to the last acknowledgement."""
    cpu_s = trace.cpu_s()
    return None if cpu_s is None or not stats.count else cpu_s / stats.count * 1e6


def _settled(sizes: dict[str, int]) -> str:
    """The batch size that carried the most messages (what the adaptive size settled on)."""
    if not sizes:
        return "-"
    return max(sizes, key=lambda size: int(size) * sizes[size])


def _kafka_run(ctx: _Context, job: Job, name: str, expected: int) -> Run:
    sink = ctx.topic(name)
    outcome = run_child(
        replace(job, source=ctx.source, sink=sink, group=f"bench-{name}-{uuid.uuid4().hex[:6]}")
    )
    return _judge(ctx, outcome, sink, expected)


def _judge(ctx: _Context, outcome: ChildReport, sink: str, expected: int) -> Run:
    stats = output_stats(read_topic(ctx.bootstrap, sink))
    info = dict(outcome.info)
    info["threads_cpu_s"] = outcome.trace.threads_cpu_s
    if outcome.error:
        info["error"] = outcome.error
        print(f"  {ctx.workload} {sink}: {outcome.error.splitlines()[-1]}", file=sys.stderr)
    if stats.count != expected:
        info["short"] = f"{stats.count} of {expected} results"
    return Run(stats.count, stats.rate_msg_s, _cpu_us_per_msg(outcome.trace, stats), info)


def _quix_run(ctx: _Context, name: str) -> Run:
    sink = ctx.topic(name)
    note, trace = run_quix(
        ctx.bootstrap, ctx.source, sink, ctx.workload, ctx.plan.serial, TORCH_THREADS
    )
    cpu = CpuTrace(**trace)
    run = _judge(ctx, ChildReport(cpu, {"note": note} if note else {}), sink, ctx.plan.serial)
    if note:
        run.rate_msg_s = None
    return run


def _model_only(ctx: _Context) -> Run:
    outcome = run_child(
        Job(
            "model-only",
            ctx.workload,
            records=ctx.records,
            model_sizes=ctx.plan.model_sizes,
            model_budget_s=ctx.plan.model_budget_s,
        )
    )
    rates: dict[str, float] = outcome.info.get("per_batch_size", {})
    if not rates:
        return Run(0, None, None, {"error": outcome.error})
    best = max(rates, key=rates.__getitem__)
    info = {**outcome.info, "best": best}
    return Run(len(ctx.records), rates[best], outcome.info["cpu_us_per_msg"][best], info)


def _contenders(ctx: _Context) -> list[tuple[str, str, Callable[[int], Run]]]:
    """``(label, note, run(repetition))`` in the order of one repetition."""
    plan, n = ctx.plan, ctx.plan.messages
    base = Job("streamproc", ctx.workload, ctx.bootstrap, messages=n, batch_size=plan.settled_batch)
    size = plan.settled_batch
    rows: list[tuple[str, str, Callable[[int], Run]]] = [
        (
            "passthrough",
            PASSTHROUGH_NOTE,
            lambda i: _kafka_run(ctx, replace(base, contender="passthrough"), f"pass-{i}", n),
        ),
    ]
    if plan.light:
        rows += [
            (
                FLOOR,
                FLOOR_NOTE,
                lambda i: _kafka_run(ctx, replace(base, contender="floor"), f"floor-{i}", n),
            ),
            (
                FLOOR_WORK,
                f"the floor + decode_many/model/encode_many in one thread, batch {size}",
                lambda i: _kafka_run(ctx, replace(base, contender="floor+work"), f"work-{i}", n),
            ),
        ]
    rows += [
        (STREAMPROC, "adaptive batch size", lambda i: _kafka_run(ctx, base, f"sp-{i}", n)),
        (
            "streamproc fused",
            "worker.fused_lane: always (one thread per lane)",
            lambda i: _kafka_run(ctx, replace(base, fused_lane="always"), f"fused-{i}", n),
        ),
        (
            "streamproc staged",
            "worker.fused_lane: never (dispatch, device, results threads)",
            lambda i: _kafka_run(ctx, replace(base, fused_lane="never"), f"staged-{i}", n),
        ),
        (
            f"streamproc fixed {size}",
            "adaptive batch size off",
            lambda i: _kafka_run(ctx, replace(base, fixed_batch_size=size), f"fixed-{i}", n),
        ),
        (
            "streamproc process-dec.",
            "decode processes (CPU includes them)",
            lambda i: _kafka_run(ctx, replace(base, decode_mode="process"), f"proc-{i}", n),
        ),
        ("quixstreams", "per message, batch 1", lambda i: _quix_run(ctx, f"quix-{i}")),
        (
            "serial",
            "flush + commit per message",
            lambda i: _kafka_run(
                ctx,
                replace(base, contender="serial", messages=plan.serial),
                f"serial-{i}",
                plan.serial,
            ),
        ),
        ("model-only", "no Kafka", lambda i: _model_only(ctx)),
    ]
    return rows


def _paced_run(ctx: _Context, contender: str, rate: float, seconds: float) -> Run:
    """One paced run of streamproc or the floor at ``rate`` msg/s for ``seconds``; its
    ``info`` holds the latency (:class:`~streamproc.tools.bench.measure.Latency` fields)."""
    suffix = uuid.uuid4().hex[:6]
    name = "sp" if contender == "streamproc" else "floor"
    source = f"bench.{ctx.workload}.lat.{name}.{suffix}"
    sink = f"bench.{ctx.workload}.lat.{name}.out.{suffix}"
    create_topics(ctx.bootstrap, [source, sink], PARTITIONS)
    count = max(20, int(rate * seconds))
    job = Job(
        contender,
        ctx.workload,
        ctx.bootstrap,
        source,
        sink,
        f"lat-{name}-{suffix}",
        messages=count,
        batch_size=ctx.plan.settled_batch,
        idle_s=30.0,
    )
    busy_cores: list[float] = []

    def replay() -> None:
        # the machine's busy cores while the replay runs: on a shared machine the producer and
        # the broker take cores from the contender (a load near the cores' sum is saturation)
        busy_s, start_s = machine_busy_s(), time.monotonic()
        run_replay(ctx.workload, source, ctx.bootstrap, PARTITIONS, count, rate)
        busy_cores.append((machine_busy_s() - busy_s) / (time.monotonic() - start_s))

    outcome = run_child(job, on_ready=replay)
    inputs = read_topic(ctx.bootstrap, source)
    outputs = read_topic(ctx.bootstrap, sink)
    stats = output_stats(outputs)
    latency = end_to_end(inputs, outputs)
    info: dict[str, Any] = {**outcome.info, "threads_cpu_s": outcome.trace.threads_cpu_s}
    if busy_cores:
        info["machine_busy_cores"] = busy_cores[0]
    if outcome.error:
        info["error"] = outcome.error
        print(f"  {ctx.workload} paced {name}: {outcome.error.splitlines()[-1]}", file=sys.stderr)
    if stats.count != count:
        info["short"] = f"{stats.count} of {count} results"
    if latency is not None:
        info["latency"] = asdict(latency)
    return Run(stats.count, rate, _cpu_us_per_msg(outcome.trace, stats), info)


def _paced_row(ctx: _Context, contender: str, load: float, runs: list[Run]) -> Row:
    """The paced runs of one contender at one load: median P50 and P99 over the repetitions
    (the P99 range and the in-consumer P99 in the note)."""
    label = f"{STREAMPROC if contender == 'streamproc' else FLOOR} @ {int(load * 100)}%"
    row = Row(ctx.workload, label, runs, paced=True)
    latencies = [r.info["latency"] for r in runs if "latency" in r.info]
    if not latencies:
        row.note = "no results matched"
        return row
    p99 = Spread.of([lat["p99_ms"] for lat in latencies])
    p50 = Spread.of([lat["p50_ms"] for lat in latencies])
    processing = Spread.of([lat["p99_processing_ms"] for lat in latencies])
    assert p99 is not None and p50 is not None
    row.p50_ms, row.p99_ms = p50.median, p99.median
    # the CDF of the run whose P99 is the median (the lower middle for an even count)
    middle = sorted(latencies, key=lambda lat: lat["p99_ms"])[(len(latencies) - 1) // 2]
    row.extra = {
        "latency_quantiles_ms": middle["quantiles_ms"],
        "p99_ms_runs": [lat["p99_ms"] for lat in latencies],
        "p50_ms_runs": [lat["p50_ms"] for lat in latencies],
        "stages_ms": stage_medians(runs, p50.median, p99.median),
    }
    notes = []
    if len(latencies) > 1:
        notes.append(f"P99 range {format_number(p99.low)}-{format_number(p99.high)}")
    where = "in-pipeline" if contender == "streamproc" else "in-loop"
    if processing is not None:
        notes.append(f"{where} P99 {format_number(processing.median)}")
    bounds = [r.info["bound_ms"] for r in runs if "bound_ms" in r.info]
    if contender == "streamproc" and bounds:
        config = pipeline_config(ctx.bootstrap, "in", "out", ctx.workload, "-")
        priority = Priority.parse(BUILTIN_WORKLOADS[ctx.workload].default_priority)
        device_ms = statistics.median(
            r.info["mean_batch_device_ms"] for r in runs if "mean_batch_device_ms" in r.info
        )
        row.extra["p99_bound_ms"] = statistics.median(bounds)
        # the part-2 target adds this to the floor's P99 at the same rate
        row.extra["part2_bound_extra_ms"] = (
            1000 * config.batching.max_wait_s[priority] + 2 * device_ms
        )
        notes.append(f"bound {format_number(row.extra['p99_bound_ms'])}")
    row.note = ", ".join(notes) + " (ms)"
    busy = [r.info["machine_busy_cores"] for r in runs if "machine_busy_cores" in r.info]
    if busy:
        row.extra["machine_busy_cores_runs"] = busy
        row.note += f"; machine busy {statistics.median(busy):.2f} of {os.cpu_count()} cores"
    short = [r.info["short"] for r in runs if "short" in r.info]
    if short:
        row.note += f"; {len(short)} runs short: {short[0]}"
    return row


def stage_medians(runs: list[Run], p50_ms: float, p99_ms: float) -> dict[str, list[float]]:
    """Per stage (:data:`~streamproc.stages.STAGES`, where the runs counted it), the median
    over ``runs`` of its P50 and of its P99 in ms; then ``total``: the row's end-to-end
    ``p50_ms`` and ``p99_ms`` (the floor, which has no stages, shows only that)."""
    out: dict[str, list[float]] = {}
    for name in STAGES:
        pairs = [r.info["stages_ms"].get(name) for r in runs if "stages_ms" in r.info]
        p50s = [pair[0] for pair in pairs if pair and pair[0] is not None]
        p99s = [pair[1] for pair in pairs if pair and pair[1] is not None]
        if p50s and p99s:
            out[name] = [statistics.median(p50s), statistics.median(p99s)]
    out["total"] = [p50_ms, p99_ms]
    return out


def paced_seconds(plan: WorkloadPlan, load: float) -> float:
    """The replay duration of a paced run at ``load``: the plan's for that load (10, 50 or
    80 %), else the plan's longest."""
    return dict(zip(LOADS, plan.paced_s, strict=True)).get(load, max(plan.paced_s))


def _paced(ctx: _Context, top_rate: float, loads: tuple[float, ...] = LOADS) -> list[Row]:
    """Paced runs at each load (fractions of ``top_rate``), ``paced_repetitions`` times,
    streamproc and (light) the floor alternately at each rate."""
    plan = ctx.plan
    contenders = ("streamproc", "floor") if plan.light else ("streamproc",)
    runs: dict[tuple[str, float], list[Run]] = {}
    for repetition in range(plan.paced_repetitions):
        for load in loads:
            seconds = paced_seconds(plan, load)
            for contender in contenders:
                run = _paced_run(ctx, contender, top_rate * load, seconds)
                runs.setdefault((contender, load), []).append(run)
                print(
                    f"  {ctx.workload} paced {repetition + 1}/{plan.paced_repetitions}: "
                    f"{contender} @ {int(load * 100)}%",
                    file=sys.stderr,
                    flush=True,
                )
    return [
        _paced_row(ctx, contender, load, runs[(contender, load)])
        for load in loads
        for contender in contenders
    ]


def run_workload(
    bootstrap: str,
    workload: str,
    plan: WorkloadPlan,
    repetitions: int,
    loads: tuple[float, ...] = LOADS,
    rate: float | None = None,
) -> list[Row]:
    """Every contender of one workload, ``repetitions`` times alternating, then paced runs at
    ``loads`` (fractions) of streamproc's median msg/s; with ``rate`` (msg/s) only the paced
    runs, at ``loads`` of that rate."""
    suffix = uuid.uuid4().hex[:6]
    if rate is not None:
        return _paced(_Context(bootstrap, workload, plan, "", suffix, ()), rate, loads)
    source = f"bench.{workload}.{suffix}"
    create_topics(bootstrap, [source], PARTITIONS)
    produce(workload, source, bootstrap, PARTITIONS, plan.messages, None, progress=False)
    records = tuple(
        Record(TopicPartition(source, p), o, k, v, tuple(h.items()), ts, 0.0)
        for (p, o), (k, v, h, ts) in list(read_topic(bootstrap, source).records.items())[:256]
    )
    ctx = _Context(bootstrap, workload, plan, source, suffix, records)
    contenders = _contenders(ctx)
    rows = {label: Row(workload, label, note=note) for label, note, _ in contenders}
    for repetition in range(repetitions):
        for label, _, run in contenders:
            started_s = time.monotonic()
            rows[label].runs.append(run(repetition))
            print(
                f"  {workload} repetition {repetition + 1}/{repetitions}: {label} "
                f"({time.monotonic() - started_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    _annotate(rows)
    out = list(rows.values())
    top = rows[STREAMPROC].median_rate()
    if top:
        out += _paced(ctx, top, loads)
    return out


def _annotate(rows: dict[str, Row]) -> None:
    """Notes from the runs: settled batch sizes, the model's best size, shortfalls, errors."""
    for row in rows.values():
        sizes = [_settled(r.info["batch_sizes"]) for r in row.runs if "batch_sizes" in r.info]
        if sizes:
            counts = {s: sizes.count(s) for s in dict.fromkeys(sizes)}
            row.note += "; batch " + ", ".join(f"{s} x{c}" for s, c in counts.items())
        best = [r.info["best"] for r in row.runs if "best" in r.info]
        if best:
            row.note = f"best batch {', '.join(dict.fromkeys(best))}; {row.note}"
        problems = [
            r.info.get("short") or r.info.get("note") or r.info["error"].splitlines()[-1]
            for r in row.runs
            if "short" in r.info or "error" in r.info or "note" in r.info
        ]
        if problems:
            row.note += f"; {len(problems)} runs: {problems[0]}"


@dataclass(frozen=True)
class Paced:
    """What the paced runs do (``streamproc bench --loads/--rate/--paced-repetitions``).

    Attributes:
        loads: fractions of the reference rate, in run order.
        rate: the reference rate (msg/s); None: streamproc's median msg/s of the backlog
            runs. Given, only the paced runs run.
        repetitions: paced repetitions (None: the plan's).
    """

    loads: tuple[float, ...] = LOADS
    rate: float | None = None
    repetitions: int | None = None


def run(
    bootstrap: str,
    out_dir: Path,
    workloads: tuple[str, ...] = tuple(PLANS),
    repetitions: int = REPETITIONS,
    quick: bool = False,
    paced: Paced = Paced(),
) -> list[Row]:
    """Run every contender of ``workloads``; write ``bench.json`` and ``bench.png`` (the
    ``bench`` extra) to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for workload in workloads:
        plan = PLANS[workload].quick() if quick else PLANS[workload]
        if paced.repetitions is not None:
            plan = replace(plan, paced_repetitions=paced.repetitions)
        rows += run_workload(bootstrap, workload, plan, repetitions, paced.loads, paced.rate)
        (out_dir / "bench.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    plot(rows, out_dir / "bench.png")
    return rows


def main(
    bootstrap: str | None = None,
    workloads: tuple[str, ...] = tuple(PLANS),
    repetitions: int = REPETITIONS,
    quick: bool = False,
    paced: Paced = Paced(),
) -> int:
    """Entry point of ``streamproc bench``: a local broker of its own unless one is given.

    Raises:
        ValueError: an unknown workload, a load outside (0, 2], a rate or paced repetitions
            below 1.
    """
    from streamproc import logs
    from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

    unknown = sorted(set(workloads) - set(PLANS))
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; allowed: {list(PLANS)}")
    if not paced.loads or any(not 0 < load <= 2 for load in paced.loads):
        raise ValueError(f"--loads: percentages in (0, 200], got {[x * 100 for x in paced.loads]}")
    if paced.rate is not None and paced.rate < 1:
        raise ValueError(f"--rate: at least 1 msg/s, got {paced.rate}")
    if paced.repetitions is not None and paced.repetitions < 1:
        raise ValueError(f"--paced-repetitions: at least 1, got {paced.repetitions}")
    logs.configure("warning", "console")
    broker = None
    bootstrap = bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    started = time.monotonic()
    load_before = os.getloadavg()
    try:
        if not bootstrap:
            broker = LocalKafka(
                Path(f"/tmp/streamproc-bench-{uuid.uuid4().hex[:6]}"), ensure_kafka_jars()
            )
            bootstrap = broker.start()
        rows = run(bootstrap, Path("benchmarks/results"), workloads, repetitions, quick, paced)
    finally:
        if broker is not None:
            broker.stop()
    load_after = os.getloadavg()
    print(render(rows))
    runs = f"{repetitions} repetitions"
    if paced.rate is not None:
        runs = f"paced rows only, 100 % = {paced.rate:,.0f} msg/s"
    print(
        f"(workloads {','.join(workloads)}; {runs}"
        f"{'; --quick' if quick else ''}; total {time.monotonic() - started:.0f} s; load average "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} after; JSON and PNG (with the `bench` "
        "extra) in benchmarks/results/)"
    )
    return 0
