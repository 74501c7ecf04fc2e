"""The Helm chart on a real Kubernetes cluster (``make k8s-test``).

deploy/k8s/k8s-test.sh starts the cluster and the broker, then runs these tests with
``STREAMPROC_K8S=1``, ``KUBECONFIG``, ``HELM`` and ``KAFKA_BOOTSTRAP`` (the broker's fixed cluster
IP, reachable from this host through the cluster's own bridge). Without ``STREAMPROC_K8S=1`` the
chart's checks are not collected, so ``make test`` neither runs nor skips them; the tests of the
helpers themselves (test_kube_helpers.py, no cluster needed) run in ``make test``.

``K8S_CHECKS`` (exported by k8s-test.sh) picks the subset by marker, never by a name's substring:
``all`` (default) every check, ``ci`` the checks marked ``k8s_ci`` (one of them, the share
group's scaling, needs KEDA: that run builds it too), ``gaps`` those marked ``k8s_gaps`` (no
KEDA built). The others are deselected, not skipped.
"""

from __future__ import annotations

import os

import pytest

collect_ignore_glob = [] if os.environ.get("STREAMPROC_K8S") == "1" else ["test_chart_*.py"]

SUBSETS = {"all": None, "ci": "k8s_ci", "gaps": "k8s_gaps"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    checks = os.environ.get("K8S_CHECKS") or "all"
    if checks not in SUBSETS:
        raise pytest.UsageError(f"K8S_CHECKS must be one of {', '.join(SUBSETS)}, not {checks!r}")
    marker = SUBSETS[checks]
    if marker is None:
        return
    chart_checks = [item for item in items if item.path.name.startswith("test_chart_")]
    left_out = [item for item in chart_checks if item.get_closest_marker(marker) is None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in dropped]
