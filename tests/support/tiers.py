"""The test tiers: every collected test belongs to exactly one, and each tier is one make target.

A tier is a pytest marker (registered in pyproject.toml). A module names its tier in one line,
``pytestmark = pytest.mark.<tier>``; a test without one gets its folder's default tier
(``FOLDER_TIER``). ``tests/integration`` has no default: a new module there must say which tier
it belongs to (the collection fails naming it), so a test can neither fall out of CI nor land
in the fast loop by accident. A new test in an existing module inherits the module's tier; no
Makefile edit is needed. docs/testing.md has the table of tiers, targets and times.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath

# tier marker -> (make target, in .ci/run?, what the tier proves)
TIERS: dict[str, tuple[str, bool, str]] = {
    "core": (
        "test",
        True,
        "the fast loop: unit tests, deployment checks and the core guarantees on a real broker",
    ),
    "models": (
        "test-models",
        True,
        "model versions (folder and MLflow sources), swaps, rollbacks, model failures",
    ),
    "registry": (
        "test-registry",
        True,
        "schema-managed topics on a real Schema Registry, its outage included",
    ),
    "failures": (
        "test-failures",
        True,
        "delivery guarantees under crashes, lost assignments and idle exits",
    ),
    "workloads": (
        "test-workloads",
        True,
        "every built-in workload together in one process, precision agreement",
    ),
    "slow": ("test-slow", False, "long failure scenarios (not in CI)"),
    "faults": ("test-faults", True, "a three-node cluster under faults (CI: test-faults-ci)"),
    "gpu": ("test-gpu", False, "the CUDA backend on a real GPU (collected only with CUDA)"),
    "k8s": ("k8s-test", True, "the Helm chart on a real cluster (CI: K8S_CHECKS=ci)"),
}

# first folder under tests/ -> the tier of a test whose module names none
FOLDER_TIER: dict[str, str] = {
    "unit": "core",
    "deploy": "core",
    "k8s": "core",  # test_chart_*.py name k8s; the helpers' own tests are unit tests
    "gpu": "gpu",
    "faults": "faults",
}


def tier_of(path: PurePosixPath, markers: Iterable[str]) -> tuple[str | None, str | None]:
    """``(tier, problem)`` of one test: ``path`` relative to the repository root
    (``tests/unit/test_cli.py``), ``markers`` the names of its markers. ``tier`` is the single
    tier marker, else the folder's default; ``problem`` says why there is none (no tier where
    the folder has no default, or several tier markers), else None."""
    named = sorted(set(markers) & TIERS.keys())
    if len(named) > 1:
        return None, f"{path}: several tiers {named}: a test belongs to exactly one"
    if named:
        return named[0], None
    folder = path.parts[1] if len(path.parts) > 2 and path.parts[0] == "tests" else ""
    default = FOLDER_TIER.get(folder)
    if default is None:
        choices = ", ".join(TIERS)
        return None, (
            f"{path}: no tier: add one line near the top, `pytestmark = pytest.mark.<tier>` "
            f"with <tier> one of {choices} (tests/support/tiers.py)"
        )
    return default, None
