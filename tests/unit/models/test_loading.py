"""Loading a version beside the serving one: memory check, load, warm-up, output contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamproc.models.loading import VersionRefused, load_version
from streamproc.models.sources import FolderSource
from streamproc.workloads.iot import IotWorkload
from tests.support.model_versions import iot_module, write_version

CPU = [torch.device("cpu")]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_version(root, "1", iot_module())
    write_version(root, "2", iot_module(scale=1.5))
    write_version(root, "3", None)
    write_version(root, "4", "tests.support.model_versions:raises_always")
    write_version(root, "5", "tests.support.model_versions:fails_on_live")
    return root


def load(repository: Path, name: str, **kwargs: object) -> object:
    files = FolderSource(repository, "iot").fetch(name)
    return load_version(files, IotWorkload(), CPU, "fp32", 8, **kwargs)  # type: ignore[arg-type]


def test_a_version_loads_warms_up_and_keeps_the_workloads_outputs(repository: Path) -> None:
    workload = IotWorkload()
    one = load(repository, "1")
    two = load(repository, "2", serving=one)
    x = torch.rand(3, *workload.item_shape)
    builtin = workload.build_model(torch.device("cpu"))(x)
    mine = one.fns[0](x)  # type: ignore[attr-defined]
    assert torch.allclose(mine[0], builtin[0]) and torch.equal(mine[1], builtin[1])
    assert not torch.allclose(two.fns[0](x)[0], builtin[0])  # type: ignore[attr-defined]
    assert one.signature == (((), torch.float32), ((), torch.bool))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "reason", "words"),
    [("3", "load", "does not load"), ("4", "warmup", "this version is broken")],
)
def test_a_version_that_does_not_load_or_warm_up_is_refused(
    repository: Path, name: str, reason: str, words: str
) -> None:
    with pytest.raises(VersionRefused) as refused:
        load(repository, name)
    assert refused.value.reason == reason and words in str(refused.value)


def test_a_version_that_raises_only_on_live_rows_passes_warm_up(repository: Path) -> None:
    loaded = load(repository, "5")
    x = torch.rand(4, *IotWorkload().item_shape)
    with pytest.raises(RuntimeError, match="fails on live data"):
        loaded.fns[0](x)  # type: ignore[attr-defined]


def test_memory_is_checked_before_loading(repository: Path) -> None:
    with pytest.raises(VersionRefused) as refused:
        load(repository, "2", headroom=1e15)
    assert refused.value.reason == "memory" and "bytes free on cpu" in str(refused.value)


def test_a_version_with_other_outputs_breaks_the_contract(repository: Path, tmp_path: Path) -> None:
    class Wider(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], 7)

    program = torch.export.export(
        Wider(), (torch.zeros(2, 128),), dynamic_shapes={"x": {0: torch.export.Dim("batch")}}
    )
    write_version(tmp_path, "9", program)
    serving = load(repository, "1")
    files = FolderSource(tmp_path, "iot").fetch("9")
    with pytest.raises(VersionRefused) as refused:
        load_version(files, IotWorkload(), CPU, "fp32", 8, serving)  # type: ignore[arg-type]
    assert refused.value.reason in ("contract", "warmup"), refused.value
