"""Smoke tests of the kept benchmark scripts (benchmarks/README.md lists them).

Each script runs in-process on a tiny input (its ``--smoke`` option or a few messages), so an
API change in streamproc fails here, not in the next measurement. Scripts that need a broker
(lane_routes, overload, pipeline_ab, priority_isolation, results_path, shed_floor, soak,
quix_app, tracing_cost) run only their pure parts: the config a run builds, the latency
bookkeeping and summary, the results handed to the sink, the floor's expired headers, the RSS
summary, Quix's per-message step. The archived one-off studies
(benchmarks/archive/) are type-checked only. The scripts change process-wide state (torch's
thread count, structlog's configuration): every test restores both.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch

from benchmarks import (
    batch_costs,
    codecs,
    decode_workers,
    formats,
    gpu_bundle,
    gpu_check,
    gpu_perf,
    intake_costs,
    lane_routes,
    overload,
    pipeline_ab,
    precision,
    priority_isolation,
    quix_app,
    rebalance_gaps,
    results_path,
    share_groups,
    shed_floor,
    soak,
    tracing_cost,
)
from streamproc.config import load_config
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.headers import ResultHeaders
from streamproc.records import Record, TopicPartition
from streamproc.tools.bench import runner
from streamproc.tools.bench.cpu import CpuMeter
from streamproc.tools.replay import messages
from streamproc.tools.verify import TopicDump
from streamproc.workloads import load_workload, video


@pytest.fixture(autouse=True)
def _process_state() -> Iterator[None]:
    threads = torch.get_num_threads()
    logging = structlog.get_config()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.set_num_threads(threads)
    structlog.configure(**logging)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


# -- scripts that run whole, on a tiny input ---------------------------------------------------


@pytest.mark.parametrize("inline", ["always", "never"])
def test_batch_costs_runs_a_tiny_backlog(inline: str, capsys: pytest.CaptureFixture[str]) -> None:
    batch_costs.main(["--messages", "16", "--batch", "4", "--inline", inline])
    assert "4 batches" in capsys.readouterr().out


def test_intake_costs_routes_cuts_and_acknowledges_every_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    intake_costs.main(["--messages", "600", "--rounds", "1", "--backlog", "2"])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["route", "cut", "ack", "total"]


def test_codecs_compares_the_frozen_codecs_with_the_live_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    codecs.main(["--smoke"])
    out = capsys.readouterr().out
    for line in ("trades decode_many", "trades encode_many", "iot    decode_many"):
        assert line in out


def test_formats_measures_every_format_and_the_stock_deserialisers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    medians = formats.main(["--smoke"])
    labels = {"json", "avro", "protobuf", "jsonschema", "avro-stock", "protobuf-stock"}
    assert set(medians) == {"trades", "iot"}
    assert all(set(costs) == labels and min(costs.values()) > 0 for costs in medians.values())
    assert "trades avro-stock" in capsys.readouterr().out


def test_the_frozen_codecs_do_not_lean_on_the_live_workloads() -> None:
    for frozen in (codecs.TradesCodecPre15, codecs.IotCodecPre15):
        assert frozen.__mro__ == (frozen, object)


def test_precision_runs_the_light_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    precision.main(["trades", "iot", "--smoke"])
    out = capsys.readouterr().out
    assert "trades: 8 held-out rows" in out and "iot: 8 held-out rows" in out
    assert "r 1.000000" in out  # fp32 against itself


# torchvision's decode_jpeg (one of the decoders gpu_perf compares) warns of its deprecation
@pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
def test_gpu_perf_runs_its_code_paths_on_two_logical_cpu_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpu_perf.main(["--device", "cpu", "--smoke"])
    out = capsys.readouterr().out
    assert "leaks: none" in out
    assert "fp32  1.000  1.000" in out  # the precision check's reference against itself


def test_gpu_check_compares_every_output_and_fails_with_a_nonzero_exit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Issue 29: the whole check on two logical CPU devices (CUDA columns n/a), the pipeline
    # row against a local broker; one planted fault must turn its row and the exit code.
    # Issue 39: frames from the bundle's frames file (no PyAV on the GPU machine), a CPU fp32
    # reference row, frames/s and P99 per batch size, and the product's TF32 setting untouched.
    def planted(ctx: gpu_check.Context) -> gpu_check.Row:
        raise gpu_check.Fault("planted: batch 1 output 0 differs")

    frames = tmp_path / "frames.bin"
    gpu_bundle.write_frames(frames, itertools.islice(video.iter_frames(), 0, 12, 4))
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    monkeypatch.setattr(gpu_check, "check_close_in_flight", planted)
    argv = ["--device", "cpu", "--smoke", "--local-broker", "--frames", str(frames)]
    assert gpu_check.main(argv) == 1
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    out = capsys.readouterr().out
    assert f"TF32 matmul {tf32[0]}, cuDNN {tf32[1]} (the product's setting" in out
    assert "6 real frames (3 distinct frames)" in out  # the file's 3, cycled
    table = out.split("\n\n")[-1]
    status = {line[:26].strip(): line[27:33].strip() for line in table.splitlines()[1:-1]}
    assert status.pop("close in flight") == "FAULT"
    assert "planted: batch 1 output 0 differs" in table
    assert status.pop("decode processes") == "n/a"  # --smoke starts no decode process
    assert set(status.values()) == {"ok"}, table
    assert {
        "one device, 1 stream(s)", "all devices (2)", "pipeline (2 lanes)",
        "cpu fp32 reference", "batch 1", "batch 3",
    } <= set(status)  # fmt: skip
    p99 = {line[:26].strip(): line.split()[-1] for line in table.splitlines()[1:-1]}
    assert float(p99["batch 3"]) > 0.0, table  # the P99 column: milliseconds per batch


def test_gpu_check_pipeline_row_needs_no_broker_unless_asked() -> None:
    # Issue 39: a lent GPU machine has no Java and no broker; the row says how to ask for it
    ctx = gpu_check.Context(
        video.VideoWorkload(), [], [], [("cpu:0", torch.device("cpu"))],
        argparse.Namespace(bootstrap=None, local_broker=False),
    )  # fmt: skip
    row = gpu_check.check_pipeline(ctx)
    assert (row.status, row.note) == ("n/a", "not asked: --bootstrap HOST:PORT or --local-broker")


def test_gpu_check_asserts_copy_compute_overlap_and_compares_with_the_cpu() -> None:
    # Issue 39: H2D/compute overlap is asserted on CUDA (a copy stream that serialises fails)
    gpu_check.assert_overlap("one device, 2 stream(s)", 0.9, 0.5)
    with pytest.raises(gpu_check.Fault, match=r"H2D overlap 0\.10 under 0\.5"):
        gpu_check.assert_overlap("one device, 2 stream(s)", 0.1, 0.5)
    with pytest.raises(gpu_check.Fault, match="no H2D overlap measured"):
        gpu_check.assert_overlap("one device, 2 stream(s)", None, 0.5)
    # against the CPU fp32 reference: scores within the tolerance; top-1 ids equal unless the
    # reference's first two scores are within twice the tolerance (a near tie may swap)
    want = [(np.array([[0.6, 0.3], [0.41, 0.40]], np.float32), np.array([[7, 2], [5, 9]]))]
    near = {1: (want[0][0] + np.float32(0.004), np.array([[7, 2], [9, 5]]))}
    assert gpu_check.compare_to_cpu("t", near, want, 0.01) == pytest.approx(0.004, abs=1e-6)
    swapped = {1: (want[0][0], np.array([[2, 7], [5, 9]]))}
    with pytest.raises(gpu_check.Fault, match=r"batch 1 row 0: top class 2, the CPU's 7"):
        gpu_check.compare_to_cpu("t", swapped, want, 0.01)
    far = {1: (want[0][0] + np.float32(0.05), want[0][1])}
    with pytest.raises(gpu_check.Fault, match=r"by 0\.05 .*allowed 0\.01"):
        gpu_check.compare_to_cpu("t", far, want, 0.01)


def test_gpu_check_comparison_and_overlap_arithmetic() -> None:
    want = [(np.array([[0.5, 0.25]], np.float32), np.array([[3, 1]], np.int64))]
    same = {1: (want[0][0].copy(), want[0][1].copy())}
    assert gpu_check.compare("t", same, want) == 0.0
    off = {1: (want[0][0] + np.float32(1e-3), want[0][1])}  # a stale slab or a raced copy
    with pytest.raises(gpu_check.Fault, match=r"batch 1 output 0 differs .* by 0\.001"):
        gpu_check.compare("t", off, want)
    assert gpu_check.compare("t", off, want, tolerance=2e-3) == pytest.approx(1e-3, rel=1e-3)
    ids = {1: (want[0][0], np.array([[3, 2]], np.int64))}
    with pytest.raises(gpu_check.Fault, match=r"output 1 differs .* rows \[0\]"):
        gpu_check.compare("t", ids, want, tolerance=1.0)
    with pytest.raises(gpu_check.Fault, match="batch 1 has no result"):
        gpu_check.compare("t", {}, want)
    # batch 2 copies in from 1 to 3 s while batch 1 computes from 1 to 2 s: half of its copy
    # is hidden; batch 1's own copy (0 -> 1 s) overlaps nothing: 1 s of 3 s copying
    spans = [(0.0, 1.0, 2.0), (1.0, 3.0, 4.0)]
    assert gpu_check.copy_overlap(spans) == pytest.approx(1.0 / 3.0)
    assert gpu_check.copy_overlap([(0.0, 0.0, 1.0)]) is None
    # a slab given back is poisoned: one given back before its copy finished feeds the model
    # poison, and the comparison fails
    from streamproc.device import StagingPool

    pool = gpu_check.poisoning(StagingPool(1, 2, (3,), np.dtype(np.float32), pin=False))
    slab = pool.lease()
    assert slab is not None
    slab.array[...] = 1.0
    pool.release(slab)
    assert set(slab.array.view(np.uint8).ravel().tolist()) == {gpu_check.POISON}


def test_gpu_check_fails_a_dead_device_thread_instead_of_waiting_for_ever() -> None:
    class Died(BaseException):
        """Escapes the part runner: the device thread dies, as a driver fault would."""

    armed = threading.Event()  # after warm-up and calibration

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if armed.is_set():
            raise Died("device thread gone")
        return (x.sum(dim=1),)

    def fill(index: int, rows: np.ndarray, slab: Any) -> None:
        armed.set()
        slab.array[: len(rows)] = rows

    batches = [np.full((3, 4), i, np.float32) for i in range(4)]
    started = time.monotonic()
    with pytest.raises(gpu_check.Fault, match="device thread gone"):
        gpu_check.run_lane(
            "t", [model], [("cpu:0", torch.device("cpu"))], batches, 1, 600.0, fill=fill
        )
    assert time.monotonic() - started < 60  # at once, not at the 600 s deadline


def test_decode_workers_runs_the_decode_table(capsys: pytest.CaptureFixture[str]) -> None:
    decode_workers.main(["--smoke"])  # the pipeline table needs a broker
    out = capsys.readouterr().out
    assert "self-sized 1..4 (start 1)" in out


# -- scripts that need a broker: their pure parts ------------------------------------------------


def test_pipeline_ab_builds_a_valid_config_and_reads_thread_cpu() -> None:
    overrides = pipeline_ab.overrides("video", "ab-video-8", "r1", {"decode_inline": "never"})
    config = load_config(overrides=overrides, bootstrap="127.0.0.1:9")
    assert config.batching.max_batch_size == 16
    assert config.worker.torch_threads == 1
    assert config.pipelines[0].output_topic == "ab-out-r1"
    threads = pipeline_ab.thread_cpu_s()
    assert all(seconds >= 0 for _, seconds in threads.values())


def test_pipeline_ab_counts_each_thread_from_its_first_reading_per_message() -> None:
    before = {1: ("source", 1.0), 2: ("decode_*", 2.0)}
    after = {1: ("source", 1.5), 2: ("decode_*", 2.25), 3: ("decode_*", 0.25), 4: ("idle", 0.0)}
    threads = pipeline_ab.threads_since(before, after)  # thread 3 was born in between
    assert threads == {"source": 0.5, "decode_*": 0.5, "idle": 0.0}
    assert pipeline_ab.per_message_us(threads, 1000) == {"source": 500.0, "decode_*": 500.0}


def test_pipeline_ab_gives_the_tracing_section_only_when_asked() -> None:
    traced = pipeline_ab.overrides("trades", "ab", "r1", {}, {"sample_ratio": 0.5})
    assert load_config(overrides=traced, bootstrap="127.0.0.1:9").tracing.sample_ratio == 0.5
    assert "tracing" not in pipeline_ab.overrides("trades", "ab", "r1", {}, {})


def test_pipeline_ab_gives_a_deadline_only_when_asked() -> None:
    shedding = pipeline_ab.overrides("trades", "ab", "r1", {}, max_age_ms=1)
    config = load_config(overrides=shedding, bootstrap="127.0.0.1:9")
    assert config.pipelines[0].max_age_ms == 1
    plain = load_config(overrides=pipeline_ab.overrides("trades", "ab", "r1", {}), bootstrap="x:9")
    assert plain.pipelines[0].max_age_ms is None


def test_shed_floor_writes_the_headers_streamproc_gives_an_expired_result() -> None:
    # the floor is only a floor if it writes what streamproc writes
    record = Record(TopicPartition("in", 3), 1234, b"k", b"v", (), 0, 0.0, 1)
    (ours,) = ResultHeaders("in").expired([record])
    assert shed_floor.expired_result_headers(b"in", 3, 1234) == ours


def test_tracing_cost_measures_the_hooks_and_configures_every_contender(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tracing_cost.hook_costs("trades", batch=8, batches=2, repetitions=2)
    assert "hooks trades per record: off" in capsys.readouterr().out
    found = tracing_cost.contenders("http://127.0.0.1:9", tmp_path)
    assert list(found) == ["off", "without", "ratio-1%", "all", "contexts"]
    for name, (checkout, tracing, traced) in found.items():
        if name == "without":
            assert (checkout, tracing, traced) == (tmp_path, {}, False)
            continue
        config = load_config(
            overrides=pipeline_ab.overrides("trades", "ab", "r1", {}, tracing),
            bootstrap="127.0.0.1:9",
        )
        assert config.tracing.active is (name != "off"), name
        assert traced is (name == "contexts")


def _timing(inference_ms: float, processing_ms: float) -> bytes:
    return b"queue_wait_ms=0.100;inference_ms=%.3f;processing_ms=%.3f" % (
        inference_ms,
        processing_ms,
    )


def test_priority_isolation_matches_results_to_inputs_and_summarises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    inputs = TopicDump({(0, offset): (b"v", None, {}, 1000 + offset) for offset in range(4)}, {})
    outputs = TopicDump(
        {
            (1, offset): (
                b"r",
                None,
                {
                    priority_isolation.H_PARTITION: b"0",
                    priority_isolation.H_OFFSET: b"%d" % (offset % 4),
                    priority_isolation.H_TIMING: _timing(0.5, 2.0 + offset),
                },
                1010 + offset,  # offsets 4..7 are duplicates, later: the first result counts
            )
            for offset in range(8)
        },
        {},
    )
    latencies = priority_isolation._latencies(inputs, outputs)
    assert latencies[(0, 2)] == (1002, 10.0, 4.0, 0.5)
    assert priority_isolation._window(latencies, 1001, 1002) == [10.0, 10.0]
    row = priority_isolation.Row(
        *("before", 1, 5.0, 9.0, 9.5, 6.0, 12.0, 13.0, 12.0 / 9.0),
        *(3.0, 4.0, 0.5, 0.6, 7.0, True, 4, 0.5, 0.7),
    )
    after = priority_isolation.Row(**{**row.__dict__, "checkout": "after", "ratio_p99": 1.0})
    priority_isolation._print_row(row)
    priority_isolation._summary([row, after], ["before", "after"])
    out = capsys.readouterr().out
    assert "run 1 before" in out and "paired per run: after P99 ratio / before P99 ratio" in out


def test_results_path_hands_over_decoded_batches_with_model_outputs() -> None:
    workload = load_workload("trades")
    model = workload.build_model(torch.device("cpu"))
    tp = TopicPartition("results-path-in", 0)
    tracker = OffsetTracker()
    generation = tracker.assign([tp])[tp]
    sample = list(itertools.islice(results_path.replay_messages(), results_path.BATCH + 3))
    results = results_path.batch_results(
        workload, model, sample, tp, generation, tracker, itertools.count()
    )
    assert [len(r.batch) for r in results] == [results_path.BATCH, 3]
    assert not any(r.failed for r in results)
    assert len(results[1].outputs[0]) == 3


def test_soak_reads_rss_and_summarises() -> None:
    assert soak.rss_bytes(os.getpid()) > 0
    summary = soak.summarise([100 * 2**20, 104 * 2**20, 102 * 2**20])
    assert summary["rss_mean_mib"] == 102.0 and summary["within_5_percent"]
    assert not soak.summarise([100, 120])["within_5_percent"]
    with pytest.raises(ValueError):
        soak.summarise([])


def test_quix_app_step_encodes_a_real_message_and_drops_a_bad_one() -> None:
    workload = load_workload("trades")
    meter = CpuMeter()
    infer = quix_app.make_infer(workload, workload.build_model(torch.device("cpu")), "in", meter)
    message = next(messages("trades"))
    result = infer(message.value, message.key, 0, list(message.headers))
    assert result is not None and b'"score"' in result
    assert infer(b"not json", b"k", 0, None) is None
    assert meter.trace.start_cpu_s is not None  # the first call opened the CPU window


def test_quix_app_imports_streamproc_without_the_share_group_client() -> None:
    """The Quix Streams contender runs in an environment pinned to Quix's ``confluent-kafka``
    (below 2.13: no ``ShareConsumer`` nor ``AcknowledgeType``); the streamproc modules it
    imports must load there. Simulated here by removing both names from the client first (a
    bench on a clean clone printed "0 of 300 results" for Quix until the package imported
    its pipeline lazily)."""
    tree = ast.parse(Path(quix_app.__file__).read_text())
    modules = sorted(
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streamproc")
    )
    assert "streamproc.workloads" in modules
    code = "\n".join(
        [
            "import confluent_kafka",
            "del confluent_kafka.ShareConsumer, confluent_kafka.AcknowledgeType",
            *(f"import {module}" for module in modules),
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_rebalance_gaps_measures_stretches_without_results_per_partition() -> None:
    stamps = {0: [1_000, 1_100, 4_600, 4_700], 1: [1_000, 1_050, 1_100, 4_700]}
    results = TopicDump(
        {
            (0, i): (b"r", None, {rebalance_gaps.H_PARTITION: b"%d" % p}, ts)
            for i, (p, ts) in enumerate((p, ts) for p, series in stamps.items() for ts in series)
        },
        {},
    )
    # partition 0: 3.5 s without a result; partition 1: 3.6 s; the window edges count too
    longest, unowned = rebalance_gaps.gaps(results, 1_000, 5_000, 2, gap_s=1.0)
    assert longest == pytest.approx(3.6)
    assert unowned == pytest.approx(3.5 + 3.6)
    rows = [
        rebalance_gaps.Row("consumer", True, run, "scale 3->1", 40.0 + run, 80.0) for run in (1, 2)
    ]
    text = rebalance_gaps.summary(rows)
    assert "consumer static" in text and "41" in text and "42" in text


def test_share_groups_configures_both_modes_and_knows_when_the_processes_are_ready(
    tmp_path: Path,
) -> None:
    for mode in share_groups.MODES:
        config = share_groups.config("b:9092", mode, "share-bench.abc", 0.2)
        loaded = load_config(overrides=config)  # the package accepts what the processes read
        assert loaded.kafka.group_type == mode
        assert loaded.pipelines[0].options == {"base": "video", "delay_s": 0.2}
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    running = '{"event": "pipeline running"}\n'
    for log in logs:
        log.write_text(running)
    assert not share_groups.ready("share", logs, 2)  # not assigned yet
    for log in logs:
        log.write_text(running + '{"event": "share group assignment", "partitions": 2}\n')
    assert share_groups.ready("share", logs, 2)
    # a consumer group: ready once every partition is owned and the group settled (2 s)
    logs[0].write_text(running + '{"event": "partitions assigned", "partitions": ["t[0]"]}\n')
    logs[1].write_text(running + '{"event": "partitions assigned", "partitions": ["t[1]"]}\n')
    assert not share_groups.ready("consumer", logs, 2)  # just assigned: not settled yet
    settled = time.time() - 5
    for log in logs:
        os.utime(log, (settled, settled))
    assert share_groups.ready("consumer", logs, 2)


def test_lane_routes_builds_the_bench_context_it_runs_in() -> None:
    """The paced run it calls is the bench's private one: its context still takes these."""
    ctx = runner_context()
    assert ctx.plan is runner.PLANS["trades"] and ctx.workload == "trades"
    assert lane_routes._spread([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    assert lane_routes.ROUTES == ("always", "never")
    assert callable(runner._paced_run)


def runner_context() -> runner._Context:
    return runner._Context("127.0.0.1:1", "trades", runner.PLANS["trades"], "", "", ())


def _out(
    partition: int, offset: int, ts: int, expired: bool = False
) -> tuple[None, bytes, dict[str, bytes], int]:
    headers = {overload.H_PARTITION: b"%d" % partition, overload.H_OFFSET: b"%d" % offset}
    if expired:
        headers[overload.H_RESULT_KIND] = overload.KIND_EXPIRED
    return (None, b"" if expired else b"r", headers, ts)


def test_overload_accounts_for_every_input_and_finds_the_recovery() -> None:
    """Inputs at 1 ms steps from t=0: 0-2 served fast, 3 expired, 4 dead-lettered, 5 missing;
    after the overload's end (t=3 000) one slow window, then served within the target."""
    inputs = TopicDump({(0, o): (None, b"v", {}, o) for o in range(6)}, {})
    outputs = TopicDump({(0, i): _out(0, o, o + 5) for i, o in enumerate(range(3))}, {})
    outputs.records[(0, 9)] = _out(0, 3, 50, expired=True)
    dead = TopicDump({(0, 0): (None, b"v", {**_out(0, 4, 9)[2]}, 9)}, {})
    rows = overload.outcomes(inputs, outputs, dead)
    assert [r.latency_ms for r in rows] == [5.0, 5.0, 5.0, None, None, None]
    assert [r.expired for r in rows] == [False, False, False, True, False, False]
    assert [r.dead_letter for r in rows] == [False] * 4 + [True, False]
    missing = [r for r in rows if r.latency_ms is None and not r.expired and not r.dead_letter]
    assert [(r.partition, r.offset) for r in missing] == [(0, 5)]

    end = 3_000
    after = [overload.Outcome(end + 10, 0, 0, 500.0, False, False)]  # window 0: over the target
    after += [overload.Outcome(end + 1_000 + k, 0, k, 5.0, False, False) for k in range(3)]
    after += [overload.Outcome(end + 2_000 + k, 0, k, 5.0, False, False) for k in range(3)]
    assert overload.recovery_s(after, end, target_ms=30.0) == 1.0
    expired_late = [*after, overload.Outcome(end + 2_500, 0, 9, None, True, False)]
    assert overload.recovery_s(expired_late, end, target_ms=30.0) == float("inf")
    assert overload.recovery_s(after[1:], end, target_ms=30.0) == 1.0  # an empty first window


def test_overload_counts_the_results_made_within_the_target_by_their_output_time() -> None:
    """Goodput per CPU second counts work by when it was done: a result made in the window
    counts even when its input came before it; one made after the window, a late one, an
    expired one and a dead-lettered one do not."""
    start, end = 10_000, 20_000
    rows = [
        overload.Outcome(start - 20, 0, 0, 25.0, False, False),  # input before, made in: counts
        overload.Outcome(start + 5, 0, 1, 30.0, False, False),  # exactly at the target: counts
        overload.Outcome(end - 10, 0, 2, 10.0, False, False),  # made exactly at the end: counts
        overload.Outcome(end - 10, 0, 3, 11.0, False, False),  # made after the end
        overload.Outcome(start - 40, 0, 4, 30.0, False, False),  # made before the start
        overload.Outcome(start + 100, 0, 5, 31.0, False, False),  # late
        overload.Outcome(start + 200, 0, 6, None, True, False),  # expired
        overload.Outcome(start + 300, 0, 7, None, False, True),  # dead-lettered
    ]
    assert overload.made_within(rows, start, end, target_ms=30.0) == 3


def test_overload_cpu_window_counts_a_process_cpu_between_its_ends() -> None:
    """The CPU seconds of a process between the window's ends, per second of wall time."""
    window = overload.CpuWindow(os.getpid())
    assert math.isnan(window.per_cpu_s(10))  # not closed: no CPU counted yet
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:  # burn 0.1 s of this process's CPU
        pass
    window.close()
    assert window.end_ms >= window.start_ms
    assert window.cpu_s >= 0.05  # /proc counts in clock ticks (10 ms)
    assert window.per_cpu_s(10) == pytest.approx(10 / window.cpu_s)
    assert window.cores == pytest.approx(window.cpu_s / window.wall_s)


def test_overload_timeline_splits_each_window_of_inputs_by_outcome() -> None:
    start = 10_000
    rows = [
        overload.Outcome(start - 1, 0, 0, 5.0, False, False),  # before the start: left out
        overload.Outcome(start, 0, 1, 5.0, False, False),
        overload.Outcome(start + 400, 0, 2, 45.0, False, False),
        overload.Outcome(start + 900, 0, 3, None, True, False),
        overload.Outcome(start + 999, 0, 4, None, False, True),
        overload.Outcome(start + 2_000, 0, 5, 30.0, False, False),  # at the target: within
        overload.Outcome(start + 2_999, 0, 6, None, True, True),  # expired, then dead-lettered
    ]
    windows = overload.timeline(rows, start, target_ms=30.0, step_s=1.0)
    assert [(w.start_s, w.inputs) for w in windows] == [(0.0, 4), (2.0, 2)]
    first, last = windows
    assert (first.within, first.late, first.expired, first.other) == (0.25, 0.25, 0.25, 0.25)
    assert (last.within, last.late, last.expired, last.other) == (0.5, 0.0, 0.5, 0.0)
    with pytest.raises(argparse.ArgumentTypeError, match="above 0"):
        overload._positive_seconds("0")


def test_overload_recovery_is_a_p99_over_every_input_expired_ones_counting_as_misses() -> None:
    end = 3_000
    fast = [overload.Outcome(end + k, 0, k, 5.0, False, False) for k in range(199)]
    one_expired = [*fast, overload.Outcome(end + 500, 0, 999, None, True, False)]  # 0.5 %
    assert overload.recovery_s(one_expired, end, target_ms=30.0) == 0.0
    assert overload.recovery_s(one_expired, end, 30.0, miss_share=0.0) == float("inf")
    slow = [overload.Outcome(end + 600 + k, 0, 500 + k, 31.0, False, False) for k in range(2)]
    assert overload.recovery_s([*one_expired, *slow], end, target_ms=30.0) == float("inf")  # 1.5 %
    only_expired = [overload.Outcome(end + k, 0, k, None, True, False) for k in range(3)]
    assert overload.recovery_s(only_expired, end, target_ms=30.0) == float("inf")
