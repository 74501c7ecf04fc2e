"""The Helm chart on a real Kubernetes cluster (``make k8s-test``).

deploy/k8s/k8s-test.sh starts the cluster and the broker, then runs these tests with
``STREAMPROC_K8S=1``, ``KUBECONFIG``, ``HELM`` and ``KAFKA_BOOTSTRAP`` (the broker's fixed cluster
IP, reachable from this host through the cluster's own bridge). Without ``STREAMPROC_K8S=1`` the
chart's checks are not collected, so ``make test`` neither runs nor skips them; the tests of the
helpers themselves (test_kube_helpers.py, no cluster needed) run in ``make test``.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("STREAMPROC_K8S") == "1" else ["test_chart_*.py"]
