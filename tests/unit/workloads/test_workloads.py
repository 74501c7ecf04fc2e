"""The plug-in API: built-in names, TorchScript files and module:factory from config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from streamproc.errors import ConfigError, DecodeError
from streamproc.records import Priority, Record, TopicPartition
from streamproc.workloads import BUILTIN_WORKLOADS, Workload, load_workload

TP = TopicPartition("t", 0)


def record(value: bytes | None) -> Record:
    return Record(TP, 0, b"k", value, (), 0, 0.0, 1)


def test_builtins_have_priorities() -> None:
    priorities = {name: load_workload(name).default_priority for name in BUILTIN_WORKLOADS}
    assert priorities == {"video": Priority.LOW, "iot": Priority.NORMAL, "trades": Priority.HIGH}
    assert all(w.default_priority == priorities[n] for n, w in BUILTIN_WORKLOADS.items())


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1)


# torch deprecates TorchScript (FutureWarning from torch.jit.script/save/load); TorchScript files
# stay a supported input (users see the warning, which points them at .pt2), so only this test
# of that input ignores it.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(script|save|load)` is deprecated:FutureWarning")
def test_torchscript_file_runs_with_json_array_codec(tmp_path: Path) -> None:
    path = tmp_path / "scale.pt"
    torch.jit.save(torch.jit.script(Scale()), str(path))
    workload = load_workload(str(path), {"input_shape": [3]})
    rows = np.zeros((2, 3), dtype=np.float32)
    workload.decode(record(b"[1, 2, 3]"), rows[0])
    workload.decode(record(b"[0.5, 0, 0]"), rows[1])
    doubled, total = workload.build_model(torch.device("cpu"))(torch.from_numpy(rows))
    assert total.tolist() == [6.0, 0.5]
    doc = orjson.loads(
        workload.encode(record(b"[1,2,3]"), (doubled[0].numpy(), total[0].numpy())).value
    )
    assert doc["outputs"] == [[2.0, 4.0, 6.0], 6.0]
    with pytest.raises(DecodeError, match="shape"):
        workload.decode(record(b"[1, 2]"), rows[0])
    with pytest.raises(DecodeError, match="malformed JSON"):
        workload.decode(record(b"[1, 2"), rows[0])


def test_torch_export_program_runs(tmp_path: Path) -> None:
    path = tmp_path / "scale.pt2"
    torch.export.save(torch.export.export(Scale(), (torch.zeros(2, 3),)), str(path))
    workload = load_workload(str(path), {"input_shape": [3]})
    rows = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    _, total = workload.build_model(torch.device("cpu"))(rows)
    assert total.tolist() == [6.0, 1.0]


def test_example_user_pipeline_loads_by_name() -> None:
    workload = load_workload("examples.zscore:make_workload", {"window": 4, "threshold": 2.0})
    assert isinstance(workload, Workload) and workload.item_shape == (4,)
    rows = np.zeros((2, 4), dtype=np.float32)
    workload.decode(record(b'{"sensor": "a", "values": [1, 1.1, 0.9, 1.0]}'), rows[0])
    workload.decode(record(b'{"sensor": "a", "values": [1, 1.1, 0.9, 9.0]}'), rows[1])
    _, alert = workload.build_model(torch.device("cpu"))(torch.from_numpy(rows))
    assert alert.tolist() == [False, True]


@pytest.mark.parametrize(
    ("spec", "options", "match"),
    [
        ("audio", {}, "allowed"),
        ("/nonexistent/model.pt", {"input_shape": [2]}, "does not exist"),
        ("examples.nope:make", {}, "cannot load"),
        ("examples.zscore:make_workload", {"bogus": 1}, "options"),
        ("json:JSONDecoder", {}, "expected a streamproc.workloads.Workload"),
    ],
)
def test_bad_workload_specs_fail_at_start_up(spec: str, options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_workload(spec, options)


@pytest.mark.parametrize("size", [0, -3, 4097, 10_000, True, 2.5, "64", None])
def test_a_workload_with_a_bad_largest_batch_fails_at_start_up_naming_it(
    size: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory's workload sizes the staging slabs with its ``max_batch_size``: a value outside
    1..4096 (or not an integer) is refused with the workload and the allowed values, not left
    to fail in torch (a negative dimension) or to pass the limit config enforces."""
    from examples import zscore

    monkeypatch.setattr(zscore.ZScoreWorkload, "max_batch_size", size)
    with pytest.raises(ConfigError, match=r"'examples.zscore:make_workload' has max_batch_size"):
        load_workload("examples.zscore:make_workload")
    monkeypatch.setattr(zscore.ZScoreWorkload, "max_batch_size", 4096)
    assert load_workload("examples.zscore:make_workload").max_batch_size == 4096


def test_a_built_in_workloads_largest_batch_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is where every workload is loaded, not only on the factory path."""
    from streamproc.workloads.trades import TradesWorkload

    monkeypatch.setattr(TradesWorkload, "max_batch_size", 0)
    with pytest.raises(ConfigError, match=r"'trades' has max_batch_size 0"):
        load_workload("trades")
