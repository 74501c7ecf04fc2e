"""Operator tools stay apart from the stages; the built-in workload registry feeds them."""

from __future__ import annotations

import ast
import itertools
import sys
import tomllib
from pathlib import Path

import pytest

from streamproc.tools.bench import report
from streamproc.tools.replay import messages, recording_size
from streamproc.workloads.registry import BUILTIN_WORKLOADS

PACKAGE = Path(__file__).resolve().parents[3] / "streamproc"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_stage_module_imports_the_tools() -> None:
    stages = [
        path
        for path in PACKAGE.rglob("*.py")
        if "tools" not in path.relative_to(PACKAGE).parts and path.name != "cli.py"
    ]
    assert len(stages) > 20
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(n for n in _imports(path) if "streamproc.tools" in n)
        for path in stages
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_matplotlib_is_only_the_optional_bench_extra() -> None:
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("matplotlib") for dep in project["dependencies"])
    assert any(dep.startswith("matplotlib") for dep in project["optional-dependencies"]["bench"])


def test_bench_without_matplotlib_says_how_to_install_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    report.plot([], tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()
    assert "pip install 'streamproc[bench]'" in capsys.readouterr().err


def test_registry_names_its_classes_and_the_replay_stamps_its_priority() -> None:
    assert list(BUILTIN_WORKLOADS) == ["video", "iot", "trades"]
    for name, workload in BUILTIN_WORKLOADS.items():
        assert workload.load_class().name == name
        assert workload.load_class().default_priority == workload.default_priority
    for name in ("iot", "trades"):  # video decodes every clip first: covered by integration
        first = list(itertools.islice(messages(name), 3))
        assert [m.headers for m in first] == [
            (("priority", BUILTIN_WORKLOADS[name].default_priority.label.encode()),)
        ] * 3
        assert recording_size(name) == BUILTIN_WORKLOADS[name].size() > 0
    with pytest.raises(ValueError, match="allowed: \\['video', 'iot', 'trades'\\]"):
        recording_size("nope")
