"""The subsets of ``make k8s-test`` (K8S_CHECKS): which chart checks each one runs.

Collected for real (``pytest --collect-only`` on tests/k8s with ``STREAMPROC_K8S=1``), no cluster
needed: collection imports the checks but runs none of them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.deploy.conftest import ROOT

CHECKS = ROOT / "tests" / "k8s" / "test_chart_on_cluster.py"


def collect(k8s_checks: str) -> subprocess.CompletedProcess[str]:
    """``pytest --collect-only`` of the chart checks with ``K8S_CHECKS=k8s_checks``."""
    env = {**os.environ, "STREAMPROC_K8S": "1", "K8S_CHECKS": k8s_checks}
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, str(CHECKS)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip


def collected(k8s_checks: str) -> set[str]:
    """Names of the chart checks (parameters stripped) the subset ``k8s_checks`` selects."""
    result = collect(k8s_checks)
    assert result.returncode == 0, result.stdout + result.stderr
    return {
        line.split("::", 1)[1].split("[", 1)[0]
        for line in result.stdout.splitlines()
        if line.startswith("tests/k8s/") and "::" in line
    }


def needing_keda() -> set[str]:
    """Chart checks whose body deploys KEDA (calls ``keda_up`` or ``deploy_keda``), read from
    the source."""
    tree = ast.parse(CHECKS.read_text())
    deploying = {"keda_up", "deploy_keda"}
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        and any(isinstance(n, ast.Name) and n.id in deploying for n in ast.walk(node))
    }  # fmt: skip


def test_the_ci_subset_runs_one_keda_check_the_share_groups_scaling() -> None:
    # A name filter ("exactly_once") once picked the transactional scale-to-zero KEDA check
    # into the ci run, which then built no KEDA and failed on its missing manifests. The ci
    # run builds KEDA since the share group's scaling check (issue 44) joined it; the other
    # KEDA checks stay out by marker, not by name.
    keda = needing_keda()
    assert len(keda) == 4, keda
    ci = collected("ci")
    assert ci == {
        "test_install_and_replay_the_three_workloads",
        "test_security_context_holds_inside_the_pod",
        "test_force_deleted_pod_mid_stream_loses_nothing",
        "test_liveness_restarts_a_wedged_process",
        "test_a_model_update_needs_no_pod_restart",
        "test_exactly_once_statefulset_killed_mid_stream_no_duplicates",
        "test_keda_scales_a_share_group_past_the_partition_count",
        "test_helm_test_passes",
        "test_uninstall_leaves_nothing",
    }
    assert ci & keda == {"test_keda_scales_a_share_group_past_the_partition_count"}


def test_every_check_that_needs_keda_is_marked_and_the_gap_run_has_none() -> None:
    every, gaps = collected("all"), collected("gaps")
    assert needing_keda() <= every
    assert gaps == {
        "test_rebalance_gaps_by_group_protocol_and_static_membership",
        "test_uninstall_leaves_nothing",
    }
    source = CHECKS.read_text()
    for name in needing_keda():
        assert "@pytest.mark.keda\n" in source.split(f"def {name}(")[0].rsplit("\n\n", 1)[-1], name


@pytest.mark.parametrize("value", ["CI", "keda"])
def test_an_unknown_subset_is_refused_with_the_allowed_values(value: str) -> None:
    result = collect(value)
    assert result.returncode != 0
    assert "K8S_CHECKS must be one of all, ci, gaps" in result.stdout + result.stderr
