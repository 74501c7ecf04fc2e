"""Prometheus on the test cluster (deploy/k8s/manifests/prometheus.yaml): deployed by the checks
that need it (the share group's KEDA scaling rule), queried from this host through its fixed
cluster IP with Prometheus' HTTP API."""

from __future__ import annotations

import json
import os
import string
import urllib.parse
import urllib.request

from tests.k8s.kube import ROOT, diagnosis, kubectl, wait_for

PROMETHEUS_IP = "10.96.0.120"  # fixed: no DNS add-on on the test cluster
ADDRESS = f"http://{PROMETHEUS_IP}:9090"
MANIFEST = ROOT / "deploy" / "k8s" / "manifests" / "prometheus.yaml"


def deploy_prometheus(scraped_namespace: str) -> None:
    """Applies the manifest (idempotent) and waits until the server answers queries.

    Raises AssertionError when the rollout or the first query does not succeed in time."""
    manifest = string.Template(MANIFEST.read_text()).substitute(
        PROMETHEUS_IMAGE=os.environ["PROMETHEUS_IMAGE"],
        PROMETHEUS_IP=PROMETHEUS_IP,
        SCRAPED_NAMESPACE=scraped_namespace,
    )
    kubectl("apply", "-f", "-", stdin=_namespace(scraped_namespace) + manifest)
    try:
        kubectl("rollout", "status", "-n", "monitoring", "deployment/prometheus", "--timeout=180s")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnosis('monitoring')}") from None
    wait_for("Prometheus to answer a query from this host", _answers, 60, 2)


def _answers() -> bool:
    try:
        return query("vector(1)") == {(): 1.0}
    except OSError:  # the Service's address not routed yet
        return False


def _namespace(name: str) -> str:
    return f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n---\n"


def query(promql: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query's samples: {sorted label pairs: value}. Raises AssertionError when
    Prometheus answers with an error, OSError when it does not answer."""
    url = f"{ADDRESS}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return {tuple(sorted(sample["metric"].items())): float(sample["value"][1]) for sample in result}
