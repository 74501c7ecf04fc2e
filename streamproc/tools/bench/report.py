"""The bench's rows, its printed table and its plots.

A :class:`Row` is one contender of one workload with its repetitions (:class:`Run`); the
table prints, per row, the median and range (min-max) of msg/s and of process CPU-µs per
message, and two ratios against the adaptive ``streamproc`` row, from the medians: its msg/s
over the row's, and its CPU-µs/msg over the row's; under each paced row, its P50/P99 per stage
of the record path (``streamproc_stage_seconds``, :mod:`streamproc.stages`; the floor has only
its total). Below each light workload's table, the
ratios against the floors per repetition (runs of one repetition ran next to each other), the
P99 comparison at 50 % load and the per-thread CPU of the floors and of streamproc.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamproc.tools.bench.measure import Spread, format_number, format_spread, paired_ratios

STREAMPROC = "streamproc"
FLOOR = "floor"
FLOOR_WORK = "floor + work"


@dataclass
class Run:
    """One repetition of one contender.

    Attributes:
        messages: results in its output topic.
        rate_msg_s: throughput (msg/s) or the paced target rate; None when unknown.
        cpu_us_per_msg: process CPU-µs per message from first input to last output append.
        info: what the contender reported (batch sizes, bound, per-thread CPU s, errors).
    """

    messages: int
    rate_msg_s: float | None
    cpu_us_per_msg: float | None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """One contender of one workload.

    Attributes:
        paced: an open-loop paced run (latency row): ``rate_msg_s`` is the target rate.
        p50_ms, p99_ms: end-to-end latency (paced rows).
        extra: for the JSON: latency quantiles, bound, per-size model rates.
    """

    workload: str
    contender: str
    runs: list[Run] = field(default_factory=list)
    note: str = ""
    paced: bool = False
    p50_ms: float | None = None
    p99_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rates(self) -> list[float | None]:
        return [r.rate_msg_s for r in self.runs]

    @property
    def cpus(self) -> list[float | None]:
        return [r.cpu_us_per_msg for r in self.runs]

    @property
    def messages(self) -> int:
        return max((r.messages for r in self.runs), default=0)

    def median_rate(self) -> float | None:
        spread = Spread.of(self.rates)
        return None if spread is None else spread.median

    def median_cpu(self) -> float | None:
        spread = Spread.of(self.cpus)
        return None if spread is None else spread.median


def _find(rows: list[Row], contender: str) -> Row | None:
    return next((r for r in rows if r.contender == contender), None)


def _ratio(mine: float | None, theirs: float | None) -> str:
    return f"{mine / theirs:.2f}" if mine and theirs else ""


def render(rows: list[Row]) -> str:
    """The printed table (see the module docstring)."""
    lines: list[str] = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        reps = max((len(r.runs) for r in mine if not r.paced), default=0)
        sp = _find(mine, STREAMPROC)
        sp_rate = sp.median_rate() if sp else None
        sp_cpu = sp.median_cpu() if sp else None
        if reps:
            lines.append(
                f"{workload}: {reps} alternating repetitions, median [min-max]; "
                "'sp/it' = streamproc's median over the row's"
            )
        else:
            paced = max((len(r.runs) for r in mine), default=0)
            lines.append(
                f"{workload}: paced rows only, {paced} repetitions alternating, median [min-max]"
            )
        lines.append(
            f"  {'contender':<24} {'msgs':>6} {'msg/s':>31} {'msg/s sp/it':>11} "
            f"{'CPU-µs/msg':>22} {'CPU sp/it':>9} {'P50 ms':>7} {'P99 ms':>7}  note"
        )
        for r in mine:
            rate_ratio = "" if r.paced else _ratio(sp_rate, r.median_rate())
            cpu_ratio = "" if r.paced else _ratio(sp_cpu, r.median_cpu())
            p50 = f"{r.p50_ms:.0f}" if r.p50_ms is not None else ""
            p99 = f"{r.p99_ms:.0f}" if r.p99_ms is not None else ""
            # a paced row's rate is its target, the same in every round
            rates = format_spread(r.rates[:1] if r.paced else r.rates)
            lines.append(
                f"  {r.contender:<24} {r.messages:>6} {rates:>31} "
                f"{rate_ratio:>11} {format_spread(r.cpus):>22} {cpu_ratio:>9} {p50:>7} "
                f"{p99:>7}  {r.note}"
            )
            if r.paced and r.extra.get("stages_ms"):
                lines.append(f"  {'':<24} {stage_line(r.extra['stages_ms'])}")
        lines.extend(_summary(mine))
    return "\n".join(lines)


def stage_line(stages_ms: dict[str, list[float]]) -> str:
    """A paced row's stages as ``P50/P99 ms by stage: consume 0.4/2.0, ring ..., total 4/17``
    (medians over the row's runs; ``total``: its end-to-end P50 and P99)."""
    shown = [
        f"{name} {format_number(p50)}/{format_number(p99)}"
        for name, (p50, p99) in stages_ms.items()
    ]
    return "P50/P99 ms by stage: " + ", ".join(shown)


FUSED, STAGED = "streamproc fused", "streamproc staged"
"""The rows with ``worker.fused_lane`` fixed to ``always`` and ``never``."""

PROFILED = (FLOOR, FLOOR_WORK, STREAMPROC, FUSED, STAGED)
"""Rows whose per-thread CPU the table prints."""


def thread_group(name: str) -> str:
    """Threads that share a role share a line: ``dispatch-<topic>`` -> ``dispatch``,
    ``decode_0``/``decode_1`` -> ``decode_*``."""
    if name.startswith("dispatch-"):
        return "dispatch"
    return re.sub(r"_\d+$", "_*", name)


def thread_profile(row: Row) -> dict[str, float]:
    """Per thread group, the median over the runs of its CPU-µs per message (largest first;
    librdkafka's threads carry their ``comm`` names, e.g. ``rdk:broker1``, shared by the
    consumer's and the producer's)."""
    per_run: list[dict[str, float]] = []
    for run in row.runs:
        threads: dict[str, float] = run.info.get("threads_cpu_s") or {}
        if not run.messages or not threads:
            continue
        grouped: dict[str, float] = {}
        for name, seconds in threads.items():
            group = thread_group(name)
            grouped[group] = grouped.get(group, 0.0) + seconds / run.messages * 1e6
        per_run.append(grouped)
    names = {name for grouped in per_run for name in grouped}
    medians = {n: statistics.median([g.get(n, 0.0) for g in per_run]) for n in names}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def _summary(rows: list[Row]) -> list[str]:
    """Per-repetition ratios against the floors and the P99 comparison at 50 % load."""
    lines: list[str] = []
    if _find(rows, STREAMPROC) is None:
        return lines
    pairs = [
        (STREAMPROC, FLOOR),
        (STREAMPROC, FLOOR_WORK),
        (FUSED, FLOOR_WORK),
        (STAGED, FLOOR_WORK),
    ]
    for name, against in pairs:
        mine, other = _find(rows, name), _find(rows, against)
        if mine is None or other is None:
            continue
        cpu = Spread.of(paired_ratios(mine.cpus, other.cpus))
        rate = Spread.of(paired_ratios(mine.rates, other.rates))
        lines.append(
            f"  {name:<17} / {against:<12} CPU-µs/msg {cpu.format() if cpu else '-':<18} "
            f"msg/s {rate.format() if rate else '-'}   (per repetition, median [min-max])"
        )
    sp50, floor50 = _find(rows, f"{STREAMPROC} @ 50%"), _find(rows, f"{FLOOR} @ 50%")
    if sp50 is not None and floor50 is not None and sp50.p99_ms is not None:
        bound = ""
        if floor50.p99_ms is not None and "part2_bound_extra_ms" in sp50.extra:
            limit_ms = floor50.p99_ms + sp50.extra["part2_bound_extra_ms"]
            bound = f"; floor P99 + max wait + 2 x batch device time = {format_number(limit_ms)} ms"
        lines.append(
            f"  P99 at 50 % load: streamproc {sp50.p99_ms:.0f} ms, floor "
            f"{floor50.p99_ms if floor50.p99_ms is not None else float('nan'):.0f} ms{bound}"
        )
    for name in PROFILED:
        row = _find(rows, name)
        profile = thread_profile(row) if row is not None else {}
        shown = [f"{n} {format_number(v)}" for n, v in profile.items() if v >= 0.05][:9]
        if shown:
            lines.append(f"  CPU-µs/msg per thread, {name} (median): {', '.join(shown)}")
    return lines


NO_MATPLOTLIB = (
    "bench.png skipped: matplotlib is not installed; the plots are the optional `bench` extra: "
    "pip install 'streamproc[bench]' (in a clone: pip install -e '.[bench]')"
)


def plot(rows: list[Row], path: Path) -> None:
    """Throughput bars (medians) and latency CDFs into ``path``; a note instead without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(NO_MATPLOTLIB, file=sys.stderr, flush=True)
        return
    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for column, workload in enumerate(workloads):
        ax = axes[0][column]
        mine = [r for r in rows if r.workload == workload and not r.paced and r.median_rate()]
        ax.bar([r.contender for r in mine], [r.median_rate() for r in mine])
        ax.set_yscale("log")
        ax.set_title(f"{workload}: throughput (msg/s, median, log scale)")
        ax.tick_params(axis="x", rotation=30)
        ax = axes[1][column]
        for r in rows:
            if r.workload == workload and "latency_quantiles_ms" in r.extra:
                ax.plot(r.extra["latency_quantiles_ms"], np.linspace(0, 1, 101), label=r.contender)
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (ms, broker append to broker append)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"{workload}: latency CDF (open loop)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
