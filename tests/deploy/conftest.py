"""Fixtures of the deployment tests: pinned tools, chart rendering, paths.

The tools (helm, kubeconform, hadolint, shellcheck, the Compose and Kubernetes schemas) come from
``deploy/tools.sh``, which installs them once into ``$STREAMPROC_CACHE_DIR/tools`` (a few minutes
on a cold machine, well under a second afterwards) and prints the path of a ``KEY=VALUE`` file
naming each of them. Nothing here needs a network once that cache exists, nor Docker, nor a
Kubernetes cluster.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "streamproc"
CI_VALUES = sorted((ROOT / "deploy" / "helm" / "ci").glob("*.yaml"))
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest with schemas.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
RENDER_KUBE_VERSION = KUBE_VERSIONS[-1]

Manifests = list[dict[str, Any]]


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    """Paths of the pinned tools and schemas (installed on first use)."""
    result = subprocess.run(
        [str(ROOT / "deploy" / "tools.sh")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"deploy/tools.sh failed:\n{result.stderr}"
    env_file = Path(result.stdout.strip().splitlines()[-1])
    pairs = (line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    return dict(pairs)


def helm_template(
    tools: dict[str, str],
    values: Path | None = None,
    sets: tuple[str, ...] = (),
    kube_version: str = RENDER_KUBE_VERSION,
    release: str = "ci",
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart; the caller checks the return code."""
    cmd = [tools["HELM"], "template", release, str(CHART), "--kube-version", kube_version]
    cmd += ["--namespace", "streaming"]
    if values is not None:
        cmd += ["--values", str(values)]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def kubeconform(
    tools: dict[str, str], kube: str, rendered: str
) -> subprocess.CompletedProcess[str]:
    """kubeconform -strict on ``rendered`` (manifests as YAML text) for Kubernetes ``kube``,
    against the Kubernetes schemas and the CRD schemas (KEDA's) of :func:`tools`."""
    k8s = "{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}"
    return subprocess.run(
        [
            tools["KUBECONFORM"],
            "-strict",
            "-summary",
            "-kubernetes-version",
            kube,
            "-schema-location",
            f"{tools['K8S_SCHEMAS']}/{k8s}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
            "-schema-location",
            f"{tools['CRD_SCHEMAS']}/{{{{ .Group }}}}/"
            "{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json",
        ],
        input=rendered,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="session")
def render(tools: dict[str, str]) -> Callable[..., Manifests]:
    """Render the chart (memoised) and return its manifests as parsed documents."""
    cache: dict[tuple[Any, ...], Manifests] = {}

    def _render(values: str | Path | None = None, *sets: str) -> Manifests:
        path = (
            ROOT / "deploy" / "helm" / "ci" / f"{values}.yaml"
            if isinstance(values, str)
            else values
        )
        key = (path, sets)
        if key not in cache:
            result = helm_template(tools, path, sets)
            assert result.returncode == 0, result.stderr
            cache[key] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return cache[key]

    return _render


def by_kind(manifests: Manifests, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in manifests if doc["kind"] == kind]


def one(manifests: Manifests, kind: str) -> dict[str, Any]:
    found = by_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def workload(manifests: Manifests) -> dict[str, Any]:
    found = [doc for doc in manifests if doc["kind"] in ("Deployment", "StatefulSet")]
    assert len(found) == 1, [doc["kind"] for doc in manifests]
    return found[0]


def container(manifests: Manifests, name: str = "streamproc") -> dict[str, Any]:
    pod = workload(manifests)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def rendered_config(manifests: Manifests) -> dict[str, Any]:
    return yaml.safe_load(one(manifests, "ConfigMap")["data"]["config.yaml"])
