"""The test tiers (tests/support/tiers.py): one tier per test, a make target per tier, and every
tier CI runs is a step of .ci/run, so a test cannot fall out of CI."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path, PurePosixPath

from tests.support.tiers import FOLDER_TIER, TIERS, tier_of

ROOT = Path(__file__).resolve().parents[2]


def test_a_module_tier_wins_and_a_folder_default_applies_only_without_one() -> None:
    assert tier_of(PurePosixPath("tests/unit/test_cli.py"), []) == ("core", None)
    assert tier_of(PurePosixPath("tests/unit/models/test_precision.py"), ["workloads"]) == (
        "workloads",
        None,
    )
    assert tier_of(PurePosixPath("tests/faults/test_faults.py"), ["faults", "timeout"]) == (
        "faults",
        None,
    )


def test_an_integration_module_without_a_tier_is_refused_naming_it() -> None:
    tier, problem = tier_of(PurePosixPath("tests/integration/test_new.py"), ["integration"])
    assert tier is None
    assert problem is not None and "tests/integration/test_new.py: no tier" in problem
    assert "pytestmark = pytest.mark.<tier>" in problem and "models" in problem


def test_two_tiers_on_one_test_are_refused() -> None:
    tier, problem = tier_of(PurePosixPath("tests/unit/test_x.py"), ["core", "slow"])
    assert tier is None and problem is not None and "several tiers ['core', 'slow']" in problem


def test_every_tier_and_default_is_a_registered_marker() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    registered = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(TIERS) <= registered, set(TIERS) - registered
    assert set(FOLDER_TIER.values()) <= set(TIERS)


def test_each_tier_has_its_make_target_and_each_ci_tier_is_a_step_of_ci_run() -> None:
    makefile = (ROOT / "Makefile").read_text()
    ci_run = (ROOT / ".ci" / "run").read_text()
    for tier, (target, in_ci, _) in TIERS.items():
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n|.*\\\n)*)", makefile, re.M)
        assert recipe, f"no make target {target} for the tier {tier}"
        if tier not in ("k8s", "faults"):  # those select by their own folder and checks
            selects = rf"(-m \"?|run_tier,)[^\"\n,]*\b{tier}\b"
            assert re.search(selects, recipe.group(1)), (target, tier)
        if in_ci:
            steps = re.findall(r"^\s*(?:\w+=\S+ )*step (?:\S+=\S+ )*make (\S+)", ci_run, re.M)
            ci_target = {"faults": "test-faults-ci", "k8s": "k8s-test"}.get(tier, target)
            assert ci_target in steps, f".ci/run does not run make {ci_target} ({tier})"
