"""A refused version is tried again when its files change (issue 39, item 4): a TorchScript
file copied into ``<repository>/iot/5/`` in place, in eight chunks, with a real
:class:`FolderSource` and the real loader polling it meanwhile."""

from __future__ import annotations

import io
import shutil
import threading
from pathlib import Path

import pytest
import torch

from streamproc.config.sections import ModelConfig
from streamproc.metrics import Metrics
from streamproc.models.loading import LoadedVersion, VersionRefused, load_version
from streamproc.models.manager import ModelManager
from streamproc.models.sources import (
    Fingerprint,
    FolderSource,
    ModelVersionFiles,
    folder_fingerprint,
    version_files,
)
from streamproc.models.versions import ModelVersions
from streamproc.workloads.iot import IotWorkload

CPU = torch.device("cpu")
CHUNKS = 8
WAIT_S = 30.0

# torch deprecates TorchScript (FutureWarning from torch.jit.trace/save/load); TorchScript files
# are what this scenario copies, as model repositories still hold them
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.(trace|trace_method|save|load)` is deprecated:FutureWarning"
)


class CountedSource(FolderSource):
    """A folder source that counts the model thread's polls (each poll resolves once)."""

    def __init__(self, repository: Path, model: str) -> None:
        super().__init__(repository, model)
        self.polls = 0
        self._changed = threading.Condition()

    def resolve(self, reference: str) -> str:
        name = super().resolve(reference)
        with self._changed:
            self.polls += 1
            self._changed.notify_all()
        return name

    def wait_polls(self, more: int) -> None:
        """Return once ``more`` further polls began (so the one before them has ended)."""
        with self._changed:
            target = self.polls + more
            assert self._changed.wait_for(lambda: self.polls >= target, WAIT_S), self.polls


def torchscript_bytes() -> bytes:
    """The iot autoencoder traced to TorchScript, as ``torch.jit.save`` writes it."""
    module = IotWorkload().load_module(CPU)
    features = module.encoder[0].in_features
    traced = torch.jit.trace(module, torch.zeros(2, features))  # type: ignore[no-untyped-call]
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    return buffer.getvalue()


def test_a_version_copied_in_place_in_chunks_is_tried_again_until_it_loads(
    tmp_path: Path,
) -> None:
    workload = IotWorkload()
    data = torchscript_bytes()
    (tmp_path / "iot" / "1").mkdir(parents=True)
    (tmp_path / "iot" / "1" / "model.pt").write_bytes(data)
    loaded: list[str] = []

    def load(files: ModelVersionFiles, serving: LoadedVersion | None) -> LoadedVersion:
        version = load_version(files, workload, [CPU], "fp32", 8, serving)
        loaded.append(files.version)
        return version

    config = ModelConfig(name="iot", repository=str(tmp_path), poll_interval_s=0.01)
    source = CountedSource(tmp_path, "iot")
    metrics = Metrics()
    versions = ModelVersions("t", load(source.fetch("1"), None), config, metrics)
    manager = ModelManager("p", config, versions, source, load)
    manager.start()
    try:
        (tmp_path / "iot" / "5").mkdir()
        step = -(-len(data) // CHUNKS)
        with (tmp_path / "iot" / "5" / "model.pt").open("wb") as out:
            for start in range(0, len(data), step):
                source.wait_polls(3)  # every state of the file is seen by polls, stable
                assert versions.resident() == ("1",), "a half-written file was served"
                out.write(data[start : start + step])
                out.flush()
        source.wait_polls(3)  # changed, then stable for a poll: tried again, and loaded
    finally:
        manager.stop(WAIT_S)
    assert loaded == ["1", "5"] and versions.resident() == ("1", "5")
    refusals = [e for e in versions.events if e.kind == "refused"]
    tries = [int(e.detail.split("(try ")[1].split(")")[0]) for e in refusals]
    assert len(tries) >= CHUNKS - 1 and tries == list(range(1, len(tries) + 1)), refusals
    assert all(e.detail.startswith("load (try ") for e in refusals), refusals

    def counted(attempt: str) -> float | None:
        labels = {"topic": "t", "reason": "load", "attempt": attempt}
        return metrics.registry.get_sample_value("streamproc_model_refused_versions_total", labels)

    assert counted("first") == 1 and counted("retry") == len(tries) - 1


class DownloadingSource(CountedSource):
    """A source that downloads a version on its first fetch, as MLflow's does: before that its
    local files (the fingerprint) are none."""

    def __init__(self, remote: Path, cache: Path) -> None:
        super().__init__(remote, "iot")
        self.cache = cache

    def fetch(self, version: str) -> ModelVersionFiles:
        local = self.cache / version
        if not local.is_dir():
            shutil.copytree(self.root / version, local)
        return version_files(version, local)

    def fingerprint(self, version: str) -> Fingerprint:
        return folder_fingerprint(self.cache / version)


def test_a_downloaded_version_refused_is_not_tried_again_while_its_copy_stays(
    tmp_path: Path,
) -> None:
    for name, text in (("1", b"model"), ("2", b"bad")):
        (tmp_path / "iot" / name).mkdir(parents=True)
        (tmp_path / "iot" / name / "model.pt").write_bytes(text)
    tries: list[str] = []

    def load(files: ModelVersionFiles, serving: LoadedVersion | None) -> LoadedVersion:
        tries.append(files.version)
        raise VersionRefused("load", f"version {files.version} does not load")

    config = ModelConfig(name="iot", repository=str(tmp_path), poll_interval_s=0.01)
    source = DownloadingSource(tmp_path, tmp_path / "cache")
    versions = ModelVersions("t", LoadedVersion("1", (lambda x: (x,),)), config, Metrics())
    manager = ModelManager("p", config, versions, source, load)
    manager.start()
    try:
        source.wait_polls(10)
    finally:
        manager.stop(WAIT_S)
    assert tries == ["2"] and "2" in versions.refused
