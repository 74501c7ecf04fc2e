"""The model thread (a folder source, loads faked) and the admin endpoint's routes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import orjson
import pytest
import torch
from pydantic import SecretStr

from streamproc.config.sections import ModelConfig
from streamproc.device.jobs import DeviceJob, DeviceResult
from streamproc.metrics import Metrics
from streamproc.models.admin import AdminApi
from streamproc.models.loading import LoadedVersion, VersionRefused
from streamproc.models.manager import ModelManager
from streamproc.models.sources import FolderSource, ModelVersionFiles
from streamproc.models.versions import ModelVersions
from streamproc.records import Batch, Record, TopicPartition


def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x,)


def add_version(root: Path, name: str, text: bytes = b"model") -> None:
    folder = root / "m" / name
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(text)


class Loads:
    """A loader that refuses files holding ``bad`` and records what it loaded."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.called = threading.Event()

    def __call__(self, files: ModelVersionFiles, serving: LoadedVersion) -> LoadedVersion:
        self.called.set()
        assert files.model_file is not None
        if files.model_file.read_bytes() == b"bad":
            raise VersionRefused("load", f"version {files.version} does not load")
        self.loaded.append(files.version)
        return LoadedVersion(files.version, (fn,))


@pytest.fixture
def manager(tmp_path: Path) -> ModelManager:
    add_version(tmp_path, "1")
    config = ModelConfig(name="m", repository=str(tmp_path), poll_interval_s=0)
    versions = ModelVersions("t", LoadedVersion("1", (fn,)), config, Metrics())
    made = ModelManager("p", config, versions, FolderSource(tmp_path, "m"), Loads())
    made.start()
    yield made
    made.stop(5)


def test_a_request_loads_and_offers_the_version(manager: ModelManager, tmp_path: Path) -> None:
    add_version(tmp_path, "2")
    assert manager.request("latest").result(10) == {
        "pipeline": "p",
        "version": "2",
        "done": "pending",
    }
    assert manager.versions.resident() == ("1", "2")
    assert manager.request("1").result(10)["done"] == "serving"


def test_a_refused_version_is_remembered_and_the_serving_one_stays(
    manager: ModelManager, tmp_path: Path
) -> None:
    add_version(tmp_path, "2", b"bad")
    with pytest.raises(VersionRefused, match="does not load"):
        manager.request("2").result(10)
    assert manager.versions.serving == "1" and "2" in manager.versions.refused
    with pytest.raises(VersionRefused) as unknown:
        manager.request("9").result(10)
    assert unknown.value.reason == "source" and "no version '9'" in str(unknown.value)


def test_polling_offers_a_new_version_once(tmp_path: Path) -> None:
    add_version(tmp_path, "1")
    add_version(tmp_path, "2")
    config = ModelConfig(name="m", repository=str(tmp_path), poll_interval_s=0.05)
    versions = ModelVersions("t", LoadedVersion("1", (fn,)), config, Metrics())
    loads = Loads()
    manager = ModelManager("p", config, versions, FolderSource(tmp_path, "m"), loads)
    manager.start()
    try:
        assert loads.called.wait(10)
    finally:
        manager.stop(10)  # joins the thread: the poll that loaded 2 has offered it
    assert loads.loaded == ["2"] and versions.resident() == ("1", "2")


def api(manager: ModelManager, token: str | None = "t0k") -> AdminApi:
    return AdminApi(None if token is None else SecretStr(token), {"p": manager})


def test_admin_refuses_without_a_token_or_with_a_wrong_one(manager: ModelManager) -> None:
    body = b'{"version": "1"}'
    assert api(manager, None).post("/models/p", "Bearer x", body)[0] == 403  # type: ignore[index]
    assert api(manager).post("/models/p", "Bearer wrong", body)[0] == 401  # type: ignore[index]
    assert api(manager).post("/models/p", None, body)[0] == 401  # type: ignore[index]
    assert api(manager).post("/models/q", "Bearer t0k", body)[0] == 404  # type: ignore[index]
    for bad in (b"{", b'{"version": 3}', b'{"version": "1", "mode": "x"}', b"[]"):
        assert api(manager).post("/models/p", "Bearer t0k", bad)[0] == 400  # type: ignore[index]
    assert api(manager).post("/metrics", "Bearer t0k", body) is None


def test_admin_loads_a_version_and_shows_the_state(manager: ModelManager, tmp_path: Path) -> None:
    add_version(tmp_path, "2")
    add_version(tmp_path, "3", b"bad")
    status, body, _ = api(manager).post("/models/p", "Bearer t0k", b'{"version": "2"}')  # type: ignore[misc]
    assert status == 200 and orjson.loads(body)["done"] == "pending"
    status, body, _ = api(manager).post("/models/p", "Bearer t0k", b'{"version": "3"}')  # type: ignore[misc]
    assert status == 409 and "at most two versions" in orjson.loads(body)["error"]
    answer = api(manager).get("/models")
    assert answer is not None
    state = json.loads(answer[1])["p"]
    assert state["serving"] == "1" and state["pending"] == "2"


def test_an_operator_choice_pauses_polling_until_they_follow_the_source_again(
    tmp_path: Path,
) -> None:
    add_version(tmp_path, "1")
    add_version(tmp_path, "2")
    config = ModelConfig(
        name="m",
        repository=str(tmp_path),
        poll_interval_s=0.02,
        rollback={"window_batches": 1, "min_batches": 1},
    )
    versions = ModelVersions("t", LoadedVersion("2", (fn,)), config, Metrics())
    loads = Loads()
    manager = ModelManager("p", config, versions, FolderSource(tmp_path, "m"), loads)
    manager.start()
    try:
        assert manager.request("1").result(10)["done"] == "pending"
        assert manager.pinned == "1"
        add_version(tmp_path, "3")
        manager.request("1").result(10)  # several polls ran meanwhile (interval 0.02 s)
        assert loads.loaded == ["1"]  # 3 was not loaded: the operator's choice holds
        switch_and_pass_probation(versions, "1")
        assert manager.request("latest").result(10)["version"] == "3"
        assert manager.pinned is None
    finally:
        manager.stop(5)


def switch_and_pass_probation(versions: ModelVersions, name: str) -> None:
    """One batch bound (the pending version serves) and its result (probation of one batch)."""
    record = Record(TopicPartition("t", 0), 0, None, b"x", (), 0, 0.0)
    job = DeviceJob(Batch(1, (record,), 0.0), slab=None)  # type: ignore[arg-type]
    versions.bind(job, 0)
    versions.observe(DeviceResult(job.batch, (), {}, None, 0.01, version=name))
    assert versions.resident() == (name,)


def test_a_restore_reloads_a_version_that_served_well_without_pinning_it(
    manager: ModelManager, tmp_path: Path
) -> None:
    add_version(tmp_path, "0")  # a version that served well before (an older name)
    answer = manager.restore("0").result(10)
    assert answer == {"pipeline": "p", "version": "0", "done": "pending"}
    assert manager.pinned is None  # polling goes on: a newer version may serve later
    record = Record(TopicPartition("t", 0), 1, None, b"x", (), 0, 0.0)
    job = DeviceJob(Batch(1, (record,), 0.0), slab=None)  # type: ignore[arg-type]
    manager.versions.rebind(job, 0)
    state = manager.versions.state()
    assert state["serving"] == "0" and state["probation"] is None  # served well: no probation
    assert state["events"][-1]["detail"] == "1 -> 0 (rollback)"
