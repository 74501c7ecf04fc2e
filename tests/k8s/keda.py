"""KEDA on the test cluster: its own kustomize manifests (copied from the KEDA module by
deploy/k8s/build.sh) with the images swapped for the local builds of the same version, and the
settings a cluster without DNS and without the admission webhook needs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import yaml

from tests.k8s.kube import diagnosis, kubectl, kubectl_json, wait_for

OPERATOR_IP = "10.96.0.110"  # fixed: the metrics server reaches the operator by address (no DNS)
OPERATOR_NAME = "keda-operator.keda.svc.cluster.local"  # in the certificate KEDA generates


def _image(ref: str) -> dict[str, str]:
    name, tag = ref.rsplit(":", 1)
    return {"newName": name, "newTag": tag}


def kustomization() -> dict[str, object]:
    operator, adapter = os.environ["KEDA_IMAGE"], os.environ["KEDA_ADAPTER_IMAGE"]

    def patch(kind: str, name: str, ops: list[dict[str, object]]) -> dict[str, object]:
        return {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(ops)}

    pull = {"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy",
            "value": "IfNotPresent"}  # fmt: skip
    args = "/spec/template/spec/containers/0/args/-"
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # KEDA's config/default without the admission webhooks (a third binary and image)
        "resources": [
            "../crd",
            "../general",
            "../rbac",
            "../manager",
            "../metrics-server",
            "../service_account",
        ],
        "images": [
            {"name": "ghcr.io/kedacore/keda", **_image(operator)},
            {"name": "ghcr.io/kedacore/keda-metrics-apiserver", **_image(adapter)},
        ],
        "patches": [
            patch(
                "Deployment",
                "keda-operator",
                [
                    pull,
                    {"op": "add", "path": args, "value": "--enable-webhook-patching=false"},
                ],
            ),
            patch(
                "Deployment",
                "keda-metrics-apiserver",
                [
                    pull,
                    {
                        "op": "add",
                        "path": args,
                        "value": f"--metrics-service-address={OPERATOR_IP}:9666",
                    },
                    {
                        "op": "add",
                        "path": args,
                        "value": f"--metrics-service-grpc-authority={OPERATOR_NAME}",
                    },
                ],
            ),
            patch(
                "Service",
                "keda-operator",
                [
                    {"op": "add", "path": "/spec/clusterIP", "value": OPERATOR_IP},
                ],
            ),
        ],
    }


def deploy_keda(config_dir: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="streamproc-keda-"))
    try:
        shutil.copytree(config_dir, work / "config")
        overlay = work / "config" / "streamproc"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization()))
        rendered = kubectl("kustomize", str(overlay))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kubectl("apply", "--server-side", "-f", "-", stdin=rendered)
    for deployment in ("keda-operator", "keda-metrics-apiserver"):
        try:
            kubectl("rollout", "status", "-n", "keda", f"deployment/{deployment}", "--timeout=300s")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnosis('keda')}") from None
    wait_for(
        "the external metrics API available",
        lambda: any(
            c["type"] == "Available" and c["status"] == "True"
            for c in kubectl_json("get", "apiservice", "v1beta1.external.metrics.k8s.io")[
                "status"
            ].get("conditions", [])
        ),
        180,
        2,
    )
