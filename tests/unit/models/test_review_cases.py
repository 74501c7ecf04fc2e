"""The defects a review of issue 26 found, one test each (every one failed before its fix):
poison rows and in-flight batches of the predecessor never count against a new version, a bad
version never kills the model thread, a failed download is tried again, a shadow candidate can be
dropped, the operator's "keep this one" cancels a pending switch, a stopped model thread answers
at once, a blank admin token is refused, and a shadow's call is not the serving version's time."""

from __future__ import annotations

import contextlib
import json
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import SecretStr, ValidationError

from streamproc.config.sections import ModelConfig
from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.errors import ModelError
from streamproc.metrics import Metrics
from streamproc.models.admin import AdminApi
from streamproc.models.loading import LoadedVersion, VersionRefused, load_version
from streamproc.models.manager import ModelManager
from streamproc.models.sources import FolderSource, ModelSourceError, ModelVersionFiles
from streamproc.models.versions import ModelVersions
from streamproc.records import Batch, Record, TopicPartition
from streamproc.workloads.torchscript import TorchScriptWorkload
from tests.support.waiting import wait_until

TP = TopicPartition("iot", 0)


def config(**overrides: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {"name": "m", "repository": "/models", "poll_interval_s": 0, **overrides}
    )


def no_negative(x: torch.Tensor) -> None:
    if bool((x[:, 0] < 0).any()):
        raise ValueError("cannot handle a negative x")


def old_fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    no_negative(x)  # the serving version cannot handle a poison row either
    return (x[:, 0] * 2,)


def new_fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    no_negative(x)  # exactly as good as the old one
    return (x[:, 0] * 3,)


def batch(batch_id: int, n: int) -> Batch:
    records = tuple(Record(TP, batch_id * 100 + i, None, b"v", (), 0, 0.0, 1) for i in range(n))
    return Batch(batch_id, records, 0.0)


@contextlib.contextmanager
def bound_worker(
    versions: ModelVersions, observe: bool
) -> Iterator[Callable[[int, list[float]], DeviceResult]]:
    """A started CPU :class:`DeviceWorker` (its own model: ``old_fn``); yields
    ``run(batch_id, values)``: one batch of ``values`` (float32, one column), bound by
    ``versions`` on device 0, submitted, and its result once done (given to
    ``versions.observe`` first when ``observe``). The worker is closed on exit."""
    pool = StagingPool(4, rows=64, item_shape=(1,), dtype=np.dtype(np.float32), pin=False)
    done: queue.Queue[DeviceResult] = queue.Queue()

    def on_complete(result: DeviceResult, release: Release) -> None:
        if observe:
            versions.observe(result)
        done.put(result)
        release()

    worker = DeviceWorker(
        old_fn, torch.device("cpu"), pool, 2, 1, on_complete, lambda e: None, label="cpu:0"
    )
    worker.start()

    def run(batch_id: int, values: list[float]) -> DeviceResult:
        slab = pool.lease(timeout_s=10)
        assert slab is not None
        slab.array[: len(values), 0] = values
        job = DeviceJob(batch(batch_id, len(values)), slab)
        versions.bind(job, 0)
        worker.submit(job)
        return done.get(timeout=30)

    try:
        yield run
    finally:
        worker.close(10)


def test_a_poison_row_does_not_roll_back_a_version_as_good_as_its_predecessor() -> None:
    """One input record that the OLD version also fails on, in the first 10 batches of
    probation, rolls the new version back ('errors'): input faults are counted as the new
    version's faults (BoundCall sets raised even when the fallback raises too)."""
    versions = ModelVersions("iot", LoadedVersion("1", (old_fn,)), config(), Metrics())
    versions.offer(LoadedVersion("2", (new_fn,)), "swap", "new")
    with bound_worker(versions, observe=True) as run:
        for batch_id in range(20):
            values = [1.0] * 8
            if batch_id == 3:
                values[5] = -1.0  # one poison record in 160
            run(batch_id, values)
    kinds = [(e["kind"], e["version"]) for e in versions.state()["events"]]
    print(versions.state()["events"])
    assert ("rolled_back", "2") not in kinds, "a good version was rolled back for a poison row"


def test_errors_of_old_version_batches_in_flight_do_not_count_against_the_new_version() -> None:
    """Batches bound to version 1 before the switch, finishing after it with an error (every
    row failed: e.g. a 1-row batch of a poison record at low traffic), count as errors of
    version 2's probation: version 2 is rolled back without having run a single batch."""
    versions = ModelVersions("iot", LoadedVersion("1", (old_fn,)), config(), Metrics())
    versions.offer(LoadedVersion("2", (new_fn,)), "swap", "new")
    job = DeviceJob(batch(1, 1), slab=None)  # type: ignore[arg-type]
    versions.bind(job, 0)  # the switch: version 2 serves from here
    error = ModelError("model failed on batch 0: cannot handle a negative x")
    versions.observe(DeviceResult(batch(0, 1), (), {0: error}, error, 0.01, version="1"))
    for i in range(9):
        versions.observe(DeviceResult(batch(i + 1, 1), (np.zeros(1),), {}, None, 0.01, version="2"))
    state = versions.state()
    print(state["events"], state["pending"])
    assert state["pending"] is None and "2" not in state["refused"], state["events"]


def test_fallback_batches_in_probation_are_not_taken_for_version_switches() -> None:
    """A fallback batch (made by version 1 while version 2 is bound) is a transaction boundary
    under exactly-once, not a switch: the swap pause is recorded once."""
    boundaries: list[float] = []
    versions = ModelVersions(
        "iot",
        LoadedVersion("1", (old_fn,)),
        config(),
        Metrics(),
        boundary=lambda: boundaries.append(time.monotonic()),
    )
    versions.observe(DeviceResult(batch(0, 1), (np.zeros(1),), {}, None, 0.01, version="1"))
    versions.offer(LoadedVersion("2", (new_fn,)), "swap", "new")
    versions.bind(DeviceJob(batch(1, 1), slab=None), 0)  # type: ignore[arg-type]
    seq = ["2", "1", "2", "1", "2"]  # 1 = fallback batches (raised)
    for i, name in enumerate(seq):
        versions.observe(
            DeviceResult(
                batch(i + 1, 1),
                (np.zeros(1),),
                {},
                None,
                0.01,
                version=name,
                bound_version="2",
                raised=name == "1",
            )
        )
    # under exactly-once no transaction may hold results of two versions, fallback batches'
    # included, so each change of the results' version is a boundary; but one switch
    assert len(boundaries) == len(seq)
    pauses = versions._metrics.registry.get_sample_value(
        "streamproc_model_swap_pause_seconds_count", {"topic": "iot"}
    )
    assert pauses == 1, f"{pauses} switches recorded for one"


def test_operator_keeping_the_serving_version_cancels_a_pending_switch() -> None:
    """Polling offered version 2 (pending: e.g. an idle topic, no batch cut yet); the operator
    asks to keep version 1: 'serving' is answered (and polling is paused on 1), yet the next
    batch switches to 2."""
    versions = ModelVersions("iot", LoadedVersion("1", (old_fn,)), config(), Metrics())
    versions.offer(LoadedVersion("2", (new_fn,)), "swap", "new")
    assert versions.use("1") == "serving"
    job = DeviceJob(batch(1, 1), slab=None)  # type: ignore[arg-type]
    versions.bind(job, 0)
    assert job.binding is not None
    assert job.binding.version == "1", "the operator was told 1 keeps serving"


class FlakySource(FolderSource):
    """A source whose download fails once (an MLflow blip: 'server unreachable')."""

    def __init__(self, root: Path, model: str) -> None:
        super().__init__(root, model)
        self.failures = 1

    def fetch(self, version: str) -> ModelVersionFiles:
        if self.failures:
            self.failures -= 1
            raise ModelSourceError("MLflow model 'm' version '2': server unreachable (timeout)")
        return super().fetch(version)


def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x,)


def test_a_transient_fetch_failure_is_tried_again_at_the_next_poll(tmp_path: Path) -> None:
    for name in ("1", "2"):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "model.pt").write_bytes(b"x")
    cfg = config(repository=str(tmp_path))
    versions = ModelVersions("iot", LoadedVersion("1", (fn,)), cfg, Metrics())
    loaded: list[str] = []

    def load(files: ModelVersionFiles, serving: LoadedVersion) -> LoadedVersion:
        loaded.append(files.version)
        return LoadedVersion(files.version, (fn,))

    manager = ModelManager("p", cfg, versions, FlakySource(tmp_path, "m"), load)
    manager._poll()  # the blip
    manager._poll()  # the server is back
    manager._poll()
    print("refused:", versions.refused, "loaded:", loaded)
    assert loaded == ["2"], "version 2 is never loaded by polling after one failed download"


class Tuple5(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x, 5


def identity(device: torch.device) -> torch.nn.Module:
    return torch.nn.Identity()


def returns_an_int(device: torch.device) -> torch.nn.Module:
    return Tuple5()


def test_a_version_returning_a_non_tensor_is_refused_and_the_model_thread_lives(
    tmp_path: Path,
) -> None:
    model_file = tmp_path / "workload.pt"
    model_file.write_bytes(b"unused: versions replace it")
    workload = TorchScriptWorkload(str(model_file), [2])
    for name, plugin in (("1", f"{__name__}:identity"), ("2", f"{__name__}:returns_an_int")):
        folder = tmp_path / "m" / name
        folder.mkdir(parents=True)
        (folder / "version.json").write_text(json.dumps({"plugin": plugin}))
    cfg = config(repository=str(tmp_path), poll_interval_s=0.05)
    cpu = [torch.device("cpu")]
    source = FolderSource(tmp_path, "m")
    serving = load_version(source.fetch("1"), workload, cpu, "fp32", 4)
    versions = ModelVersions("iot", serving, cfg, Metrics())

    def load(files: ModelVersionFiles, serving: LoadedVersion) -> LoadedVersion:
        return load_version(files, workload, cpu, "fp32", 4, serving)

    manager = ModelManager("p", cfg, versions, source, load)
    manager.start()
    wait_until(lambda: "2" in versions.refused, "version 2 polled, loaded and refused", 30.0)
    alive = manager._thread.is_alive()
    answer = manager.request("1")
    try:
        print("thread alive:", alive, "refused:", versions.refused)
        assert alive, "the models thread died: polling stopped for good"
        assert answer.result(2)["done"] == "serving"
    finally:
        manager.stop(1)


def test_a_request_after_the_model_thread_stopped_is_answered_at_once(tmp_path: Path) -> None:
    """A POST during a drain (the model threads stop first) is refused with 503 at once, not
    after the admin timeout (600 s)."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"x")
    cfg = config(repository=str(tmp_path))
    versions = ModelVersions("iot", LoadedVersion("1", (fn,)), cfg, Metrics())
    manager = ModelManager("p", cfg, versions, FolderSource(tmp_path, "m"), lambda f, s: s)
    manager.start()
    manager.stop(5)
    api = AdminApi(SecretStr("t"), {"p": manager}, timeout_s=2.0)
    started = time.monotonic()
    status, body, _ = api.post("/models/p", "Bearer t", b'{"version": "1"}')
    assert status == 503 and b"stopped" in body, body
    assert time.monotonic() - started < 2.0, "a POST after stop waits the whole timeout"


def test_a_shadow_candidate_can_be_dropped_to_make_room(
    tmp_path: Path,
) -> None:
    """model.mode shadow (promote_after_batches None, the default): a bad candidate stays
    resident for good; every other version is refused 'busy'; the only way out is to
    promote it (serve a version known to be bad) or restart."""
    for name in ("1", "2", "3"):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "model.pt").write_bytes(b"x")
    cfg = config(repository=str(tmp_path))
    versions = ModelVersions("iot", LoadedVersion("1", (fn,)), cfg, Metrics())

    def load(files: ModelVersionFiles, serving: LoadedVersion) -> LoadedVersion:
        return LoadedVersion(files.version, (fn,))

    manager = ModelManager("p", cfg, versions, FolderSource(tmp_path, "m"), load)
    manager.start()
    try:
        assert manager.request("2", "shadow").result(5)["done"] == "shadowing"
        with pytest.raises(VersionRefused, match="2 is scoring in shadow"):
            manager.request("3").result(5)
        assert manager.request("2", "drop").result(5)["done"] == "dropped"
        assert versions.state()["candidate"] is None and "2" in versions.refused
        assert manager.request("3").result(5)["done"] == "pending"  # room again
    finally:
        manager.stop(5)


def test_a_blank_admin_token_is_refused_at_start() -> None:
    from streamproc.config.sections import AdminConfig

    for blank in ("", "   ", "short"):
        with pytest.raises(ValidationError, match=r"token\n.*at least 16 characters"):
            AdminConfig.model_validate({"token": blank})


def test_the_shadow_call_is_not_counted_in_the_serving_versions_batch_time() -> None:
    """A shadowed batch's inference_s (the timing header, the adaptive batcher's sample, the
    RecentTimes baseline a successor's probation P99 is judged against) includes the
    candidate's call: after a shadow promotion the baseline P99 is the serving+shadow time."""

    def slow(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        time.sleep(0.05)
        return (x[:, 0] * 2,)

    versions = ModelVersions(
        "iot", LoadedVersion("1", (old_fn,)), config(shadow={"sample": 1.0}), Metrics()
    )
    versions.offer(LoadedVersion("2", (slow,)), "shadow", "new")
    with bound_worker(versions, observe=False) as run:
        result = run(1, [1.0] * 8)
    assert result.shadow is not None
    print("inference_s", result.inference_s, "serving_s", result.shadow.serving_s)
    assert result.inference_s < 0.04, "the serving version's batch time includes the shadow"
