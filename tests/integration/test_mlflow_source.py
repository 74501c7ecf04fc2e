"""MlflowSource against a real MLflow tracking server (SQLite store, artifacts served by the
server, loopback): versions resolved by number, ``latest`` and ``@alias`` (and again after the
alias moved), artifacts fetched once and loaded, unknown names refused with their names, and an
unreachable or hung server failing within a bounded time."""

from __future__ import annotations

import gc
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from streamproc.models.mlflow_source import MlflowSource, register_version
from streamproc.models.sources import ModelSourceError
from streamproc.tools.mlflow_local import LocalMlflow, ensure_mlflow_server

# torch deprecates TorchScript (FutureWarning from torch.jit.script/save/load); TorchScript files
# stay a supported model file, so these tests of that input ignore it.
pytestmark = [
    pytest.mark.models,
    pytest.mark.filterwarnings(
        r"ignore:`torch\.jit\.(script|save|load)` is deprecated:FutureWarning"
    ),
]


def start_server(run_dir: Path) -> LocalMlflow:
    server = LocalMlflow(run_dir, ensure_mlflow_server())
    server.start()
    return server


@pytest.fixture
def model() -> str:
    return f"scorer-{uuid.uuid4().hex[:8]}"


def scripted_linear(path: Path, weight: float) -> Path:
    """A TorchScript ``Linear(2, 1)`` with every weight ``weight`` and bias 0: f(x) = w * sum(x)."""
    linear = torch.nn.Linear(2, 1)
    with torch.no_grad():
        linear.weight.fill_(weight)
        linear.bias.zero_()
    torch.jit.save(torch.jit.script(linear), str(path))
    return path


def test_latest_number_and_alias_resolve_and_follow_the_alias(
    mlflow_server: str, model: str, tmp_path: Path
) -> None:
    file = scripted_linear(tmp_path / "linear.pt", 1.0)
    assert register_version(mlflow_server, model, file, alias="champion") == "1"
    assert register_version(mlflow_server, model, file) == "2"
    source = MlflowSource(mlflow_server, model, tmp_path / "cache")
    assert source.versions() == ["1", "2"]
    assert source.resolve("latest") == "2"
    assert source.resolve("1") == "1"
    assert source.resolve("@champion") == "1"
    assert register_version(mlflow_server, model, file, alias="champion") == "3"
    assert source.resolve("@champion") == "3"
    assert source.resolve("latest") == "3"
    assert model in source.describe() and mlflow_server in source.describe()


def test_fetch_downloads_each_version_once_and_the_file_loads(
    mlflow_server: str, model: str, tmp_path: Path
) -> None:
    register_version(mlflow_server, model, scripted_linear(tmp_path / "one.pt", 1.0))
    register_version(mlflow_server, model, scripted_linear(tmp_path / "two.pt", 2.0))
    source = MlflowSource(mlflow_server, model, tmp_path / "cache")
    x = torch.tensor([[1.0, 2.0]])
    for version, expected in (("1", 3.0), ("2", 6.0)):
        files = source.fetch(version)
        assert files.version == version and files.plugin is None
        assert files.model_file is not None and files.model_file.suffix == ".pt"
        assert files.folder.is_relative_to(tmp_path / "cache")
        assert files.size_bytes == files.model_file.stat().st_size > 0
        assert torch.jit.load(str(files.model_file))(x).item() == pytest.approx(expected)
    first = source.fetch("2").model_file
    assert first is not None
    inode = first.stat().st_ino
    again = source.fetch("2").model_file
    assert again == first and again.stat().st_ino == inode  # not downloaded again


def test_plugin_version_and_the_default_cache_folder(
    mlflow_server: str, model: str, tmp_path: Path
) -> None:
    meta = tmp_path / "version.json"
    meta.write_text('{"plugin": "my_models.scorer:build", "description": "rules v2"}')
    register_version(mlflow_server, model, meta)
    source = MlflowSource(mlflow_server, model)
    files = source.fetch("1")
    assert files.model_file is None
    assert files.plugin == "my_models.scorer:build"
    assert files.metadata == {"description": "rules v2"}
    cache = files.folder
    assert cache.is_dir()
    del source, files
    gc.collect()
    assert not cache.exists()  # the per-source temporary folder went with the source


def test_unknown_version_alias_model_and_reference_are_refused_by_name(
    mlflow_server: str, model: str, tmp_path: Path
) -> None:
    register_version(mlflow_server, model, scripted_linear(tmp_path / "m.pt", 1.0))
    source = MlflowSource(mlflow_server, model, tmp_path / "cache")
    for reference, named in (("7", "'7'"), ("@nope", "'@nope'")):
        with pytest.raises(ModelSourceError, match=f"{model}.*{named}") as caught:
            source.resolve(reference)
        assert mlflow_server in str(caught.value)
    with pytest.raises(ModelSourceError, match=f"{model}.*version '7'.*{mlflow_server}"):
        source.fetch("7")
    with pytest.raises(ModelSourceError, match="not a version reference"):
        source.resolve("newest")
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ModelSourceError, match=f"'{missing}' has no version"):
        MlflowSource(mlflow_server, missing).resolve("latest")
    with pytest.raises(ModelSourceError, match=f"'{missing}'.*'1'"):
        MlflowSource(mlflow_server, missing).resolve("1")


def test_hung_and_stopped_server_fail_within_bounded_time(model: str, tmp_path: Path) -> None:
    server = start_server(tmp_path / "server")
    uri = server.tracking_uri
    try:
        register_version(uri, model, scripted_linear(tmp_path / "m.pt", 1.0))
        source = MlflowSource(uri, model, tmp_path / "cache")
        assert source.resolve("latest") == "1"
        assert server.pid is not None
        os.killpg(server.pid, signal.SIGSTOP)  # hung: connections accepted, never answered
        try:
            started = time.monotonic()
            with pytest.raises(ModelSourceError, match=f"{model}.*{uri}.*unreachable"):
                source.resolve("latest")
            assert time.monotonic() - started < 25.0  # 3 tries of 5 s + backoff
        finally:
            os.killpg(server.pid, signal.SIGCONT)
    finally:
        server.stop()
    started = time.monotonic()
    with pytest.raises(ModelSourceError, match=f"{model}.*version '1'.*{uri}.*unreachable"):
        source.fetch("1")
    with pytest.raises(ModelSourceError, match=f"{model}.*{uri}.*unreachable"):
        source.resolve("@champion")
    assert time.monotonic() - started < 20.0  # refused: 3 tries, backoff 0 + 2 s each


def test_mlflow_start_twice_and_stop_from_the_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    directory = tmp_path / "mlflow"
    cli = [sys.executable, "-m", "streamproc", "mlflow"]

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, "start", "--dir", str(directory)], capture_output=True, text=True, timeout=300
        )

    started = start()
    try:
        assert started.returncode == 0, started.stderr
        uri = started.stdout.strip().splitlines()[-1].removeprefix("export MLFLOW_TRACKING_URI=")
        assert uri.startswith("http://127.0.0.1:")
        again = start()  # the recorded server still runs: the same address, no second server
        assert again.returncode == 0 and "mlflow server already running" in again.stdout
        assert again.stdout.strip().splitlines()[-1] == started.stdout.strip().splitlines()[-1]
        assert MlflowSource(uri, "nothing-registered").versions() == []
    finally:
        stopped = subprocess.run(
            [*cli, "stop", "--dir", str(directory)], capture_output=True, text=True, timeout=60
        )
    assert stopped.returncode == 0 and "stopped MLflow server pid" in stopped.stdout
    assert not (directory / "mlflow.pid").exists()
