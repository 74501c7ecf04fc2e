"""Prometheus on the test cluster (deploy/k8s/manifests/prometheus.yaml): deployed by the checks
that need it (the share group's KEDA scaling rule), queried from this host through its fixed
cluster IP with Prometheus' HTTP API.

Debian's Prometheus has no Kubernetes service discovery, so :class:`Targets` serves Prometheus'
HTTP service discovery from this host, on the node's bridge address (the pods reach the API
server there too): per pod behind a Service labelled ``streamproc.io/metrics=true`` in the
scraped namespace, its metrics address with the labels ``namespace``, ``service`` and ``pod``
(what a ServiceMonitor of the Prometheus Operator gives the series), read from the Endpoints
objects at each refresh."""

from __future__ import annotations

import json
import os
import string
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.k8s.kube import ROOT, diagnosis, kubectl, kubectl_json, wait_for

PROMETHEUS_IP = "10.96.0.120"  # fixed: no DNS add-on on the test cluster
ADDRESS = f"http://{PROMETHEUS_IP}:9090"
NODE_IP = "10.244.0.1"  # deploy/k8s/cluster.sh: the bridge the pods route through
MANIFEST = ROOT / "deploy" / "k8s" / "manifests" / "prometheus.yaml"
METRICS_PORT_NAME = "http-metrics"  # the chart's metrics Service


def scrape_targets(namespace: str) -> list[dict[str, Any]]:
    """Prometheus HTTP SD target groups: one per pod behind the metrics Services of
    ``namespace`` (ready or not: the chart publishes not-ready addresses too)."""
    groups = []
    selector = "streamproc.io/metrics=true"
    for endpoints in kubectl_json("get", "endpoints", "-n", namespace, "-l", selector)["items"]:
        service = endpoints["metadata"]["name"]
        for subset in endpoints.get("subsets") or []:
            ports = [p["port"] for p in subset.get("ports", []) if p["name"] == METRICS_PORT_NAME]
            addresses = subset.get("addresses", []) + subset.get("notReadyAddresses", [])
            for port in ports:
                for address in addresses:
                    pod = (address.get("targetRef") or {}).get("name", address["ip"])
                    labels = {"namespace": namespace, "service": service, "pod": pod}
                    groups.append({"targets": [f"{address['ip']}:{port}"], "labels": labels})
    return groups


class Targets:
    """The HTTP service discovery endpoint, on ``NODE_IP`` (a free port), until :meth:`stop`."""

    def __init__(self, namespace: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the http.server hook
                body = json.dumps(scrape_targets(namespace)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # every 5 s: not worth a line
                pass

        self._server = ThreadingHTTPServer((NODE_IP, 0), Handler)
        self.url = f"http://{NODE_IP}:{self._server.server_address[1]}/targets"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="prometheus-targets", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def deploy_prometheus(scraped_namespace: str) -> Targets:
    """Starts the discovery endpoint, applies the manifest (idempotent) and waits until the
    server answers queries; the caller stops the returned endpoint when done.

    Raises AssertionError when the rollout or the first query does not succeed in time."""
    targets = Targets(scraped_namespace)
    try:
        manifest = string.Template(MANIFEST.read_text()).substitute(
            PROMETHEUS_IMAGE=os.environ["PROMETHEUS_IMAGE"],
            PROMETHEUS_IP=PROMETHEUS_IP,
            TARGETS_URL=targets.url,
        )
        kubectl("apply", "-f", "-", stdin=manifest)
        # a config changed since a previous deployment is read by a new pod only
        kubectl("rollout", "restart", "-n", "monitoring", "deployment/prometheus")
        try:
            kubectl(
                "rollout", "status", "-n", "monitoring", "deployment/prometheus", "--timeout=180s"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnosis('monitoring')}") from None
        wait_for("Prometheus to answer a query from this host", _answers, 60, 2)
    except BaseException:
        targets.stop()
        raise
    return targets


def _answers() -> bool:
    try:
        return query("vector(1)") == {(): 1.0}
    except OSError:  # the Service's address not routed yet
        return False


def query(promql: str, at: float | None = None) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query's samples: {sorted label pairs: value}, evaluated now or AT (Unix
    seconds; a series' value there is its last sample scraped at or before AT). Raises
    AssertionError when Prometheus answers with an error, OSError when it does not answer."""
    params = {"query": promql} | ({} if at is None else {"time": f"{at:.3f}"})
    url = f"{ADDRESS}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return {tuple(sorted(sample["metric"].items())): float(sample["value"][1]) for sample in result}
