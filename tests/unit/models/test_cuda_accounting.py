"""The CUDA side of loading a version, as far as a CPU can show it (issue 39, item 5): the
memory check counts PyTorch's cached-but-free blocks as free (numbers injected), and a refused
operator request's answer does not keep the version's tensors alive. What only a GPU can show
(stream order, the hand-over) is in ``tests/gpu/test_model_loading.py``."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from streamproc.config.sections import ModelConfig
from streamproc.device import backend
from streamproc.metrics import Metrics
from streamproc.models.loading import LoadedVersion, VersionRefused, check_memory
from streamproc.models.manager import ModelManager
from streamproc.models.sources import FolderSource, ModelVersionFiles
from streamproc.models.versions import ModelVersions

GIB = 1 << 30
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU with 1 GiB free as the driver sees it, and 3 GiB reserved by PyTorch's caching
    allocator of which 1 GiB is allocated: 2 GiB cached-but-free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)


@pytest.mark.usefixtures("gpu_numbers")
def test_cached_but_free_blocks_count_as_free_on_a_gpu() -> None:
    assert backend.free_memory_bytes(CUDA) == 3 * GIB


@pytest.mark.usefixtures("gpu_numbers")
def test_a_version_that_fits_in_the_cache_is_not_refused_for_memory(tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    with model.open("wb") as out:
        out.truncate(2 * GIB)  # sparse: 2 GiB as far as the check reads its size
    files = ModelVersionFiles("2", tmp_path, model)
    check_memory(files, [CUDA], 1.25, 0)  # 2.5 GiB needed, 3 GiB free counting the cache
    with pytest.raises(VersionRefused) as refused:
        check_memory(files, [CUDA], 2.0, 0)  # 4 GiB needed
    assert refused.value.reason == "memory" and f"{3 * GIB} free" in str(refused.value)


class HoldsTensors:
    """A loader that makes the version's tensors, then refuses it (as a warm-up would)."""

    def __init__(self) -> None:
        self.weights: weakref.ref[torch.Tensor] | None = None

    def __call__(self, files: ModelVersionFiles, serving: LoadedVersion | None) -> LoadedVersion:
        weights = torch.zeros(1 << 16)  # the version's tensors: locals of the refusing frame
        self.weights = weakref.ref(weights)
        raise VersionRefused("warmup", f"version {files.version} raised on zeros")


def test_a_refused_requests_answer_does_not_keep_the_versions_tensors(tmp_path: Path) -> None:
    for name in ("1", "2"):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "model.pt").write_bytes(b"model")
    config = ModelConfig(name="m", repository=str(tmp_path), poll_interval_s=0)
    versions = ModelVersions("t", LoadedVersion("1", (lambda x: (x,),)), config, Metrics())
    loader = HoldsTensors()
    manager = ModelManager("p", config, versions, FolderSource(tmp_path, "m"), loader)
    manager.start()
    try:
        answer = manager.request("2")
        error = answer.exception(30)  # the answer (and its error) kept, as the admin route does
        assert isinstance(error, VersionRefused) and "raised on zeros" in str(error)
        assert loader.weights is not None
        assert loader.weights() is None, "the refused version's tensors are still referenced"
    finally:
        manager.stop(30)
