"""scripts/test_durations.py: the slowest tests and the time per folder from a junit XML."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "test_durations.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.unit.test_cli" name="test_a" time="0.5" />
<testcase classname="tests.unit.models.test_versions.TestSwap" name="test_b[x]" time="2.0" />
<testcase classname="tests.integration.test_crash" name="test_kill" time="30.25">
<failure message="boom">trace</failure></testcase>
<testcase classname="tests.integration.test_groups" name="test_s" time="1.0">
<skipped message="why" /></testcase>
</testsuite></testsuites>
"""


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_durations_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_slowest_tests_and_the_time_per_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    assert load().main([str(xml), "--slowest", "2", "--modules"]) == 0
    out = capsys.readouterr().out
    slowest = out.split("### Time per folder")[0]
    assert "| 1 | 30.2 | failed | `tests/integration/test_crash.py::test_kill` |" in slowest
    second = "| 2 | 2.0 | passed | `tests/unit/models/test_versions.py::TestSwap.test_b[x]` |"
    assert second in slowest
    assert "test_a" not in slowest  # only the 2 slowest
    assert "| `tests/integration` | 2 | 31.2 | 93% |" in out
    assert "| `tests/unit` | 2 | 2.5 | 7% |" in out
    assert "| total | 4 | 33.8 | 100% |" in out
    assert "| `tests/unit/models/test_versions.py` | 1 | 2.0 | 6% |" in out


def test_a_file_without_test_cases_exits_2(tmp_path: Path) -> None:
    xml = tmp_path / "empty.xml"
    xml.write_text("<testsuites><testsuite name='pytest' tests='0'/></testsuites>")
    assert load().main([str(xml)]) == 2


def test_a_missing_file_exits_2(tmp_path: Path) -> None:
    assert load().main([str(tmp_path / "absent.xml")]) == 2
