"""The bench's pure parts: the floor's commit bookkeeping, CPU accounting from /proc lines,
throughput and latency from topic dumps, median/range formatting and the printed ratios."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamproc.output.headers import H_OFFSET, H_PARTITION, H_TIMING, TIMING_FORMAT
from streamproc.stages import STAGES
from streamproc.tools.bench.cpu import (
    TICK_S,
    CpuTrace,
    machine_busy_s,
    parse_stat,
    read_stat,
    thread_deltas,
)
from streamproc.tools.bench.floor import DeliveredOffsets
from streamproc.tools.bench.measure import (
    Spread,
    end_to_end,
    format_number,
    format_spread,
    output_stats,
    paired_ratios,
)
from streamproc.tools.bench.report import Row, Run, render, thread_group, thread_profile
from streamproc.tools.bench.runner import PLANS, _Context, _paced_row, stage_medians
from streamproc.tools.verify import TopicDump

# -- the floor's commit positions ------------------------------------------------------------


def test_commit_position_follows_the_longest_delivered_prefix() -> None:
    offsets: DeliveredOffsets[int] = DeliveredOffsets()
    for offset in range(5):
        offsets.consumed(0, offset)
    offsets.delivered(0, 1)
    offsets.delivered(0, 2)
    assert offsets.to_commit() == {}  # offset 0 still in flight: nothing is committable
    offsets.delivered(0, 0)
    assert offsets.to_commit() == {0: 3}
    assert offsets.to_commit() == {}  # reported once
    offsets.delivered(0, 4)
    assert offsets.positions() == {0: 3}
    offsets.delivered(0, 3)
    assert offsets.to_commit() == {0: 5}
    assert offsets.awaiting() == 0


def test_commit_positions_are_per_partition_and_skip_offset_gaps() -> None:
    offsets: DeliveredOffsets[int] = DeliveredOffsets()
    for partition, offset in [(0, 10), (1, 3), (0, 12), (0, 15), (1, 4)]:  # gaps: 11, 13, 14
        offsets.consumed(partition, offset)
    offsets.delivered(0, 12)
    offsets.delivered(1, 3)
    assert offsets.to_commit() == {1: 4}
    offsets.delivered(0, 10)
    assert offsets.to_commit() == {0: 13}  # one past 12: the gap at 11 was never consumed
    offsets.delivered(0, 15)
    offsets.delivered(1, 4)
    assert offsets.to_commit() == {0: 16, 1: 5}
    assert offsets.awaiting() == 0


def test_offsets_go_forward_and_are_delivered_once() -> None:
    offsets: DeliveredOffsets[int] = DeliveredOffsets()
    offsets.consumed(0, 5)
    with pytest.raises(ValueError, match="consumed after 5"):
        offsets.consumed(0, 5)
    offsets.delivered(0, 5)
    with pytest.raises(ValueError, match="consumed after 5"):
        offsets.consumed(0, 4)  # behind the committed position
    with pytest.raises(KeyError):
        offsets.delivered(0, 5)  # delivered twice
    with pytest.raises(KeyError):
        offsets.delivered(1, 0)  # never consumed


# -- CPU accounting from /proc ---------------------------------------------------------------


def _stat(pid: int, comm: str, utime: int, stime: int) -> str:
    # fields 3.. of a real line; utime and stime are fields 14 and 15
    rest = ["S", "1", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0"]
    return f"{pid} ({comm}) {' '.join(rest)} {utime} {stime} 0 0 20 0 9 0 123 456 789\n"


def test_stat_line_gives_user_plus_system_seconds_even_with_odd_thread_names() -> None:
    stat = parse_stat(_stat(4242, "rdk:broker1", 150, 50))
    assert (stat.pid, stat.name, stat.user_ticks, stat.system_ticks) == (
        4242,
        "rdk:broker1",
        150,
        50,
    )
    assert stat.cpu_s == pytest.approx(200 * TICK_S)
    odd = parse_stat(_stat(7, "a) b (c", 3, 4))  # comm may hold spaces and parentheses
    assert (odd.name, odd.user_ticks, odd.system_ticks) == ("a) b (c", 3, 4)
    with pytest.raises(ValueError, match="not a /proc stat line"):
        parse_stat("garbage")


def test_machine_busy_time_leaves_out_idle_iowait_and_guest(tmp_path: Path) -> None:
    """Busy = user + nice + system + irq + softirq + steal (guest is inside user already)."""
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 2 30 5000 70 4 6 8 900 9\ncpu0 50 1 15 2500 35 2 3 4 450 4\n")
    assert machine_busy_s(str(stat)) == pytest.approx(150 * TICK_S)
    stat.write_text("intr 1 2 3\n")
    with pytest.raises(ValueError, match="cpu line"):
        machine_busy_s(str(stat))
    assert machine_busy_s() > 0.0  # this machine's


def test_a_gone_process_reads_as_none() -> None:
    assert read_stat("/proc/999999999/stat") is None


def test_thread_deltas_name_threads_and_count_new_ones_from_zero() -> None:
    first = {1: parse_stat(_stat(1, "python", 100, 0)), 2: parse_stat(_stat(2, "rdk:main", 5, 5))}
    last = {
        1: parse_stat(_stat(1, "python", 130, 10)),  # +40 ticks
        2: parse_stat(_stat(2, "rdk:main", 5, 5)),  # idle: left out
        3: parse_stat(_stat(3, "python", 7, 3)),  # born in the window: +10 ticks
        4: parse_stat(_stat(4, "python", 2, 0)),  # same Python name as 3: added up
    }
    deltas = thread_deltas(first, last, {1: "MainThread", 3: "decode_0", 4: "decode_0"})
    assert deltas == {
        "MainThread": pytest.approx(40 * TICK_S),
        "decode_0": pytest.approx(12 * TICK_S),
    }


def test_cpu_window_needs_both_marks() -> None:
    assert CpuTrace().cpu_s() is None
    assert CpuTrace(1.0, 2.5).cpu_s() is None
    assert CpuTrace(1.0, 2.5, 3.0, 4.0).cpu_s() == pytest.approx(1.5)


# -- throughput and latency from topic dumps --------------------------------------------------


def _dump(records: dict[tuple[int, int], tuple[dict[str, bytes], int]]) -> TopicDump:
    return TopicDump({c: (None, b"v", h, ts) for c, (h, ts) in records.items()}, {})


def test_throughput_spans_the_first_to_the_last_append() -> None:
    stats = output_stats(_dump({(0, i): ({}, 1000 + 10 * i) for i in range(11)}))
    assert (stats.count, stats.first_ms, stats.last_ms) == (11, 1000, 1100)
    assert stats.rate_msg_s == pytest.approx(100.0)  # 10 gaps in 0.1 s
    assert output_stats(_dump({(0, 0): ({}, 5)})).rate_msg_s is None
    assert output_stats(_dump({})).count == 0


def test_end_to_end_matches_results_to_inputs_by_source_headers() -> None:
    inputs = _dump({(p, o): ({}, 1000 + o) for p in (0, 1) for o in range(100)})
    outputs = _dump(
        {
            (p, o): (
                {
                    H_PARTITION: b"%d" % p,
                    H_OFFSET: b"%d" % o,
                    H_TIMING: TIMING_FORMAT % (0.1, 0.2, 0.5),
                },
                1000 + o + (5 if p == 0 else 50),
            )
            for p in (0, 1)
            for o in range(100)
        }
        | {(2, 0): ({}, 9999)}  # no source headers: ignored
    )
    latency = end_to_end(inputs, outputs)
    assert latency is not None
    assert latency.count == 200
    assert latency.p50_ms == pytest.approx(27.5)
    assert latency.p99_ms == pytest.approx(50.0)
    assert latency.p99_processing_ms == pytest.approx(0.5)
    assert len(latency.quantiles_ms) == 101
    assert end_to_end(inputs, _dump({})) is None


# -- median, range and ratios -----------------------------------------------------------------


def test_numbers_keep_the_digits_that_matter() -> None:
    assert [format_number(v) for v in (175429.8, 312.4, 30.64, 2.94, 0.314)] == [
        "175,430",
        "312",
        "30.6",
        "2.9",
        "0.31",
    ]


def test_spread_prints_median_and_range_and_skips_unknown_runs() -> None:
    assert format_spread([18197.5, None, 24569.0, 15278.0, 11514.0, 14825.0]) == (
        "15,278 [11,514-24,569]"
    )
    assert format_spread([7.0]) == "7.0"
    assert format_spread([None, None]) == "-"
    spread = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert spread == Spread(2.5, 1.0, 10.0, 4)


def test_ratios_pair_runs_of_the_same_repetition() -> None:
    assert paired_ratios([30.0, None, 40.0, 50.0], [10.0, 5.0, 0.0, 25.0]) == [3.0, 2.0]


def test_table_prints_ratios_against_streamproc_and_the_floors() -> None:
    rows = [
        Row("trades", "floor", [Run(100, 80_000.0, 7.0), Run(100, 82_000.0, 7.2)]),
        Row("trades", "floor + work", [Run(100, 34_000.0, 20.0), Run(100, 30_000.0, 21.0)]),
        Row("trades", "streamproc", [Run(100, 25_000.0, 30.0), Run(100, 24_000.0, 31.5)]),
        Row(
            "trades",
            "floor @ 50%",
            [Run(100, 12_000.0, 9.0), Run(100, 12_000.0, 11.0)],
            paced=True,
            p50_ms=8,
            p99_ms=20,
        ),
        Row(
            "trades",
            "streamproc @ 50%",
            [Run(100, 12_000.0, 40.0)],
            paced=True,
            p50_ms=30,
            p99_ms=400,
            extra={"part2_bound_extra_ms": 4.0},
        ),
    ]
    table = render(rows)
    floor_line = next(line for line in table.splitlines() if line.startswith("  floor   "))
    assert "81,000 [80,000-82,000]" in floor_line
    assert "0.30" in floor_line  # msg/s: 24,500 / 81,000
    assert "4.33" in floor_line  # CPU: 30.75 / 7.1
    assert "streamproc        / floor + work CPU-µs/msg 1.5 [1.5-1.5]" in table
    assert "P99 at 50 % load: streamproc 400 ms, floor 20 ms" in table
    assert "= 24.0 ms" in table
    paced = next(line for line in table.splitlines() if line.startswith("  floor @ 50%"))
    assert "12,000 " in paced and "[12,000" not in paced  # the target rate, once
    assert "10.0 [9.0-11.0]" in paced


def test_thread_profile_groups_roles_and_takes_the_median_per_message() -> None:
    runs = [
        Run(
            1000,
            1.0,
            30.0,
            {
                "threads_cpu_s": {
                    "results": 0.009,
                    "decode_0": 0.001,
                    "decode_1": 0.002,
                    "dispatch-bench.x": 0.001,
                }
            },
        ),
        Run(1000, 1.0, 30.0, {"threads_cpu_s": {"results": 0.011, "decode_0": 0.002}}),
        Run(1000, 1.0, 30.0, {"threads_cpu_s": {"results": 0.010, "decode_1": 0.004}}),
    ]
    profile = thread_profile(Row("trades", "streamproc", runs))
    assert list(profile) == ["results", "decode_*", "dispatch"]
    assert profile["results"] == pytest.approx(10.0)
    assert profile["decode_*"] == pytest.approx(3.0)
    assert profile["dispatch"] == pytest.approx(0.0)  # median of 1, 0, 0
    assert thread_group("dispatch-bench.trades.ab12cd") == "dispatch"
    assert thread_group("rdk:broker1") == "rdk:broker1"


def test_paced_rows_print_each_stages_median_p50_and_p99_under_the_row() -> None:
    def run(consume: tuple[float, float], ring: tuple[float, float] | None) -> Run:
        stages: dict[str, list[float | None]] = {name: [None, None] for name in STAGES}
        stages["consume"] = list(consume)
        if ring is not None:
            stages["ring"] = list(ring)
        return Run(100, 50_000.0, 20.0, {"stages_ms": stages})

    runs = [run((1.0, 9.0), (300.0, 900.0)), run((3.0, 5.0), None), run((2.0, 7.0), (100.0, 500.0))]
    stages = stage_medians(runs, p50_ms=450.0, p99_ms=1200.0)
    # per stage the median over the runs that counted it; stages never counted are left out
    assert stages == {
        "consume": [2.0, 7.0],
        "ring": [200.0, 700.0],
        "total": [450.0, 1200.0],
    }
    row = Row(
        "trades", "streamproc @ 80%", runs, paced=True, p50_ms=450, p99_ms=1200,
        extra={"stages_ms": stages},
    )  # fmt: skip
    lines = render([row]).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  streamproc @ 80%"))
    assert lines[at + 1].strip() == (
        "P50/P99 ms by stage: consume 2.0/7.0, ring 200/700, total 450/1,200"
    )
    assert lines[0] == "trades: paced rows only, 3 repetitions alternating, median [min-max]"


def test_a_paced_row_notes_how_many_cores_the_machine_kept_busy() -> None:
    """The machine's busy cores while the replay ran (median over the runs that read it): a row
    whose tail comes from a saturated machine says so."""

    def run(busy: float | None) -> Run:
        latency = {"p50_ms": 3.0, "p99_ms": 9.0, "p99_processing_ms": 0.05, "quantiles_ms": {}}
        info: dict[str, object] = {"latency": latency}
        if busy is not None:
            info["machine_busy_cores"] = busy
        return Run(100, 50_000.0, 5.0, info)

    ctx = _Context("127.0.0.1:9", "trades", PLANS["trades"], "", "", ())
    row = _paced_row(ctx, "floor", 0.8, [run(1.9), run(None), run(1.1), run(1.25)])
    assert row.extra["machine_busy_cores_runs"] == [1.9, 1.1, 1.25]
    assert row.note.endswith(f"; machine busy 1.25 of {os.cpu_count()} cores")
    assert "machine busy" not in _paced_row(ctx, "floor", 0.8, [run(None)]).note
