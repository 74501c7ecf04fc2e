"""The Helm chart's versioned models: the read-only model repository volume, MLflow's location and
credentials, the admin endpoint's token, and what stays out of the config (and its checksum) so
that a new model version needs no pod restart. Every rendering is validated by kubeconform."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamproc.config import load_config
from tests.deploy.conftest import (
    CI_VALUES,
    KUBE_VERSIONS,
    ROOT,
    Manifests,
    container,
    helm_template,
    kubeconform,
    one,
    rendered_config,
    workload,
)

MODELS_CI = ROOT / "deploy" / "helm" / "ci" / "models.yaml"
MODEL_ENV = {
    "STREAMPROC_MODEL_REPOSITORY",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "STREAMPROC_ADMIN_TOKEN",
}
# Model locations (without the secrets of deploy/helm/ci/models.yaml), so that its pipelines'
# models validate.
LOCATIONS = (
    "models.repository.existingClaim=models",
    "models.mlflow.trackingUri=http://mlflow.mlops.svc:5000",
)
PIPELINE = {"name": "sensors", "input_topic": "i", "output_topic": "o", "workload": "iot"}


def render_valid(tools: dict[str, str], values: Path | None, *sets: str) -> Manifests:
    """Render for every supported Kubernetes version, validate each strictly with kubeconform,
    and return the newest version's manifests."""
    manifests: Manifests = []
    for kube in KUBE_VERSIONS:
        rendered = helm_template(tools, values, sets, kube_version=kube)
        assert rendered.returncode == 0, rendered.stderr
        result = kubeconform(tools, kube, rendered.stdout)
        assert result.returncode == 0, result.stdout + result.stderr
        assert re.search(r"Invalid: 0, Errors: 0, Skipped: 0", result.stdout), result.stdout
        manifests = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    return manifests


def values_file(tmp_path: Path, data: dict[str, Any], name: str = "values") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def env_of(manifests: Manifests) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container(manifests)["env"]}


def pod_spec(manifests: Manifests) -> dict[str, Any]:
    return workload(manifests)["spec"]["template"]["spec"]


def checksum(manifests: Manifests) -> str:
    return workload(manifests)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


@pytest.mark.parametrize(
    ("sets", "source"),
    [
        (
            ("models.repository.existingClaim=models-rox",),
            {"persistentVolumeClaim": {"claimName": "models-rox", "readOnly": True}},
        ),
        (
            ("models.repository.nfs.server=nfs.example", "models.repository.nfs.path=/exp/models"),
            {"nfs": {"server": "nfs.example", "path": "/exp/models", "readOnly": True}},
        ),
        (
            ("models.repository.hostPath=/srv/models",),
            {"hostPath": {"path": "/srv/models", "type": "Directory"}},
        ),
    ],
    ids=["existingClaim", "nfs", "hostPath"],
)
def test_the_model_repository_is_mounted_read_only(
    tools: dict[str, str], sets: tuple[str, ...], source: dict[str, Any]
) -> None:
    manifests = render_valid(tools, None, *sets)
    volumes = {v["name"]: v for v in pod_spec(manifests)["volumes"]}
    assert volumes["model-repository"] == {"name": "model-repository", **source}
    mounts = [m for m in container(manifests)["volumeMounts"] if m["name"] == "model-repository"]
    assert mounts == [{"name": "model-repository", "mountPath": "/models", "readOnly": True}]
    assert env_of(manifests)["STREAMPROC_MODEL_REPOSITORY"] == {
        "name": "STREAMPROC_MODEL_REPOSITORY",
        "value": "/models",
    }
    # the init container (when there is one) never sees the models
    for init in pod_spec(manifests).get("initContainers", []):
        assert all(m["name"] != "model-repository" for m in init["volumeMounts"])


def test_the_mount_path_is_what_the_process_is_told(tools: dict[str, str]) -> None:
    manifests = render_valid(
        tools, None, "models.repository.existingClaim=m", "models.mountPath=/srv/models"
    )
    mount = next(m for m in container(manifests)["volumeMounts"] if m["name"] == "model-repository")
    assert mount["mountPath"] == "/srv/models" and mount["readOnly"] is True
    assert env_of(manifests)["STREAMPROC_MODEL_REPOSITORY"]["value"] == "/srv/models"


@pytest.mark.parametrize(
    ("sets", "secret_env"),
    [
        (
            ("models.mlflow.existingSecret=mlflow-creds", "models.mlflow.tokenKey=api-token"),
            {"MLFLOW_TRACKING_TOKEN": "api-token"},
        ),
        (
            (
                "models.mlflow.existingSecret=mlflow-creds",
                "models.mlflow.usernameKey=user",
                "models.mlflow.passwordKey=pass",
            ),
            {"MLFLOW_TRACKING_USERNAME": "user", "MLFLOW_TRACKING_PASSWORD": "pass"},
        ),
    ],
    ids=["token", "basic"],
)
def test_mlflow_location_and_credentials_reach_the_pod_as_env(
    tools: dict[str, str], sets: tuple[str, ...], secret_env: dict[str, str]
) -> None:
    uri = "https://mlflow.mlops.svc:5000"
    manifests = render_valid(tools, None, f"models.mlflow.trackingUri={uri}", *sets)
    env = env_of(manifests)
    assert env["MLFLOW_TRACKING_URI"] == {"name": "MLFLOW_TRACKING_URI", "value": uri}
    for name, key in secret_env.items():
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": "mlflow-creds", "key": key}}
        assert "value" not in env[name]
    assert {n for n in env if n.startswith("MLFLOW_")} == {"MLFLOW_TRACKING_URI", *secret_env}
    assert "STREAMPROC_MODEL_REPOSITORY" not in env  # no volume asked for
    assert all(v["name"] != "model-repository" for v in pod_spec(manifests)["volumes"])
    text = one(manifests, "ConfigMap")["data"]["config.yaml"]
    assert "mlflow" not in text, "the chart's MLflow settings stay out of the config file"
    assert not [doc for doc in manifests if doc["kind"] == "Secret"]


def test_the_admin_token_comes_from_a_secret(tools: dict[str, str]) -> None:
    manifests = render_valid(tools, None, "admin.existingSecret=streamproc-admin")
    token = env_of(manifests)["STREAMPROC_ADMIN_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "streamproc-admin", "key": "token"}}
    custom = render_valid(tools, None, "admin.existingSecret=ops", "admin.secretKey=bearer")
    assert env_of(custom)["STREAMPROC_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "ops",
        "key": "bearer",
    }
    assert "admin" not in rendered_config(manifests)


def test_tracing_reaches_the_pod_as_env_with_its_headers_from_a_secret(
    tools: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = render_valid(
        tools,
        None,
        "tracing.endpoint=http://otel-collector.observability:4318",
        "tracing.existingSecret=otlp-auth",
    )
    env = env_of(manifests)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4318"
    assert env["STREAMPROC_TRACING__HEADERS"]["valueFrom"] == {
        "secretKeyRef": {"name": "otlp-auth", "key": "headers"}
    }
    assert "tracing" not in rendered_config(manifests)
    # what the pod's process makes of them
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"])
    monkeypatch.setenv("STREAMPROC_TRACING__HEADERS", '{"x-api-key": "hunter2"}')
    config = load_config(overrides={**rendered_config(manifests), "pipelines": [PIPELINE]})
    assert config.tracing.active
    assert config.tracing.headers["x-api-key"].get_secret_value() == "hunter2"
    assert "hunter2" not in repr(config.tracing)
    without = render_valid(tools, None)
    assert not {"OTEL_EXPORTER_OTLP_ENDPOINT", "STREAMPROC_TRACING__HEADERS"} & set(env_of(without))


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("config.admin.token=hunter2",),
            "config.admin.token: a secret in the ConfigMap; put the token in a Secret and name "
            "it in admin.existingSecret",
        ),
        (("config.admin.token=",), "config.admin.token: a secret in the ConfigMap"),
        (("admin.existingSecret=a", "admin.secretKey="), "admin.existingSecret needs"),
        (
            ("config.tracing.headers.x-api-key=hunter2",),
            "config.tracing.headers: a secret in the ConfigMap",
        ),
        (
            ("tracing.endpoint=http://c:4318", "tracing.existingSecret=a", "tracing.headersKey="),
            "tracing.existingSecret needs tracing.headersKey",
        ),
        (("tracing.existingSecret=a",), "tracing.existingSecret needs tracing.endpoint"),
        (
            ("tracing.endpoint=collector:4318",),
            "/tracing/endpoint': 'collector:4318' does not match",
        ),
        (
            ("models.repository.existingClaim=m", "models.repository.hostPath=/srv/models"),
            "models.repository: set only one of existingClaim, nfs, hostPath "
            "(got existingClaim, hostPath)",
        ),
        (("models.repository.nfs.server=nfs",), "models.repository.nfs needs both server and path"),
        (("models.mlflow.existingSecret=s",), "models.mlflow.existingSecret needs tokenKey"),
        (("models.mlflow.tokenKey=t",), "need models.mlflow.existingSecret"),
        (
            (
                "models.mlflow.existingSecret=s",
                "models.mlflow.tokenKey=t",
                "models.mlflow.usernameKey=u",
            ),
            "set tokenKey or usernameKey and passwordKey, not both",
        ),
        (
            ("models.mlflow.existingSecret=s", "models.mlflow.usernameKey=u"),
            "usernameKey and models.mlflow.passwordKey go together",
        ),
    ],
)
def test_inconsistent_model_values_are_refused(
    tools: dict[str, str], sets: tuple[str, ...], message: str
) -> None:
    result = helm_template(tools, sets=sets)
    assert result.returncode != 0, "rendered although it should be refused"
    assert message in result.stderr, result.stderr
    assert "hunter2" not in result.stderr, "the refusal must not echo the secret"


@pytest.mark.parametrize(
    ("model", "sets", "message"),
    [
        (
            {"name": "iot"},
            (),
            "config.pipelines[0] (sensors): model.source folder needs model.repository, "
            "or models.repository",
        ),
        (
            {"source": "mlflow", "name": "iot"},
            ("models.repository.existingClaim=m",),
            "config.pipelines[0] (sensors): model.source mlflow needs model.tracking_uri or "
            "models.mlflow.trackingUri",
        ),
    ],
    ids=["folder", "mlflow"],
)
def test_a_pipeline_model_without_a_location_is_refused(
    tools: dict[str, str],
    tmp_path: Path,
    model: dict[str, str],
    sets: tuple[str, ...],
    message: str,
) -> None:
    values = values_file(tmp_path, {"config": {"pipelines": [{**PIPELINE, "model": model}]}})
    result = helm_template(tools, values, sets)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    # the same model renders once its location is known (chart value, config key or extraEnv)
    source = model.get("source", "folder")
    given = {
        "folder": ("models.repository.existingClaim=m",),
        "mlflow": ("models.mlflow.trackingUri=http://mlflow:5000",),
    }[source]
    assert helm_template(tools, values, (*sets, *given)).returncode == 0
    in_config = {**model, "repository": "/data", "tracking_uri": "http://mlflow:5000"}
    inline = {"config": {"pipelines": [{**PIPELINE, "model": in_config}]}}
    assert helm_template(tools, values_file(tmp_path, inline, "inline"), sets).returncode == 0
    name = {"folder": "STREAMPROC_MODEL_REPOSITORY", "mlflow": "MLFLOW_TRACKING_URI"}[source]
    extra = f"extraEnv[0].name={name}", "extraEnv[0].value=/x"
    assert helm_template(tools, values, (*sets, *extra)).returncode == 0


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("models.s3=bucket", "at '/models': additional properties 's3' not allowed"),
        (
            "models.repository.image=models:1",
            "at '/models/repository': additional properties 'image' not allowed",
        ),
        (
            "models.mlflow.token=hunter2",
            "at '/models/mlflow': additional properties 'token' not allowed",
        ),
        ("admin.token=hunter2", "at '/admin': additional properties 'token' not allowed"),
        ("models.mountPath=models", "at '/models/mountPath': 'models' does not match pattern"),
    ],
)
def test_the_schema_refuses_unknown_model_keys(
    tools: dict[str, str], item: str, message: str
) -> None:
    result = helm_template(tools, sets=(item,))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("values", [p for p in CI_VALUES if p != MODELS_CI], ids=lambda p: p.stem)
def test_without_model_values_nothing_changes(render, values: Path) -> None:
    manifests = render(values)
    pod = pod_spec(manifests)
    env = env_of(manifests)
    assert not MODEL_ENV & set(env)
    assert all(v["name"] != "model-repository" for v in pod["volumes"])
    assert all(m["mountPath"] != "/models" for m in container(manifests)["volumeMounts"])
    if values.stem == "defaults":
        assert list(env) == ["STREAMPROC_CONFIG", "STREAMPROC_INSTANCE_ID", "POD_NAMESPACE"]
        assert [v["name"] for v in pod["volumes"]] == ["config", "tmp", "dshm"]
        assert [m["name"] for m in container(manifests)["volumeMounts"]] == [
            "config",
            "tmp",
            "dshm",
        ]


def test_model_values_stay_out_of_the_config_and_its_checksum(render, tmp_path: Path) -> None:
    """The pods roll when the config changes (checksum/config), never because of where models
    come from: new versions arrive through the volume, MLflow or the admin endpoint."""
    with_models = render("models")
    ci = yaml.safe_load(MODELS_CI.read_text())
    config_only = render(values_file(tmp_path, {"config": ci["config"]}), *LOCATIONS)
    text = one(with_models, "ConfigMap")["data"]["config.yaml"]
    assert text == one(config_only, "ConfigMap")["data"]["config.yaml"]
    assert checksum(with_models) == checksum(config_only)
    assert checksum(with_models) == hashlib.sha256(text.rstrip("\n").encode()).hexdigest()
    # other locations and secrets: the same config, the same checksum
    moved = render(
        "models",
        "models.repository.nfs.server=nfs2.storage.svc",
        "models.mountPath=/srv/models",
        "models.mlflow.trackingUri=http://mlflow2:5000",
        "admin.existingSecret=other",
    )
    assert checksum(moved) == checksum(with_models)
    assert "/models" not in text and "nfs" not in text and "streamproc-admin" not in text
    # a version pinned in the config is config: changing it is a rollout (README.md)
    pipelines = [{**p, "model": {**p["model"], "version": "7"}} for p in ci["config"]["pipelines"]]
    pinned = render(
        values_file(tmp_path, {"config": {"pipelines": pipelines}}, "pinned"), *LOCATIONS
    )
    assert checksum(pinned) != checksum(config_only)


def test_the_package_reads_the_model_locations_and_token_from_the_pod_env(
    render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the chart sets is what streamproc's loader fills pipelines[].model and admin from:
    the rendered config (no repository, no tracking URI, no token) plus the pod's env."""
    manifests = render("models")
    for name in [n for n in os.environ if n.upper().startswith(("STREAMPROC_", "MLFLOW_"))]:
        monkeypatch.delenv(name)
    for item in container(manifests)["env"]:
        if "value" in item:
            monkeypatch.setenv(item["name"], item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            monkeypatch.setenv(item["name"], f"{ref['name']}/{ref['key']}")
        else:
            monkeypatch.setenv(item["name"], "ci-streamproc-0")
    config = rendered_config(manifests)
    assert "admin" not in config
    assert all(
        "repository" not in p["model"] and "tracking_uri" not in p["model"]
        for p in config["pipelines"]
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config(path)
    folder, mlflow = (p.model for p in loaded.pipelines)
    assert folder is not None and mlflow is not None
    assert folder.repository == "/models"
    assert mlflow.tracking_uri == "http://mlflow.mlops.svc:5000"
    assert loaded.admin.token is not None
    assert loaded.admin.token.get_secret_value() == "streamproc-admin/token"
    assert "streamproc-admin/token" not in repr(loaded)
