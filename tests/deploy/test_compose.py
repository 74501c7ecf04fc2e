"""docker-compose.yml and deploy/compose: schema, referenced files, wiring, dashboards, alerts.

Docker is not needed: `make compose-test` runs the stack for real where Docker exists.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamproc.config import load_config
from tests.deploy.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "compose" / "docker-compose.gpu.yml"
AUX = ROOT / "deploy" / "compose"
METRICS = {
    "streamproc_messages_consumed_total",
    "streamproc_messages_produced_total",
    "streamproc_messages_dead_lettered_total",
    "streamproc_batch_size_messages",
    "streamproc_queue_wait_seconds",
    "streamproc_inference_seconds",
    "streamproc_stage_seconds",
    "streamproc_end_to_end_seconds",
    "streamproc_ring_fill_ratio",
    "streamproc_paused_partitions",
    "streamproc_consumer_lag_messages",
    "streamproc_consumer_lag_seconds",
    "streamproc_commits_total",
    "streamproc_commit_failures_total",
    "streamproc_pinned_pool_in_use_buffers",
    "streamproc_pinned_pool_capacity_buffers",
    "streamproc_gpu_utilization_ratio",
    "streamproc_gpu_memory_used_bytes",
    "streamproc_device_stalled",
    "streamproc_model_rollbacks_total",
    "streamproc_model_held",
    "streamproc_latency_p99_seconds",
    "streamproc_latency_target_seconds",
    "streamproc_latency_over_target_seconds_total",
    "streamproc_unacknowledged_bytes",
    "streamproc_unacknowledged_wait_seconds_total",
    "streamproc_expired_total",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def validate(tools: dict[str, str], *files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            tools["TOOLS_PYTHON"],
            str(ROOT / "deploy" / "validate_compose.py"),
            "--schema",
            tools["COMPOSE_SCHEMA"],
            *map(str, files),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_compose_files_match_the_compose_specification(tools: dict[str, str]) -> None:
    result = validate(tools, COMPOSE, GPU_OVERRIDE)
    assert result.returncode == 0, result.stderr
    assert "valid against compose-spec" in result.stdout


def test_validator_catches_unknown_keys_and_missing_files(
    tools: dict[str, str], tmp_path: Path
) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(
        "services:\n  app:\n    image: busybox:1.36\n    restartt: always\n"
        "    volumes: ['./missing.yaml:/etc/x.yaml:ro']\n    env_file: [absent.env]\n"
    )
    result = validate(tools, bad)
    assert result.returncode == 1
    assert "'restartt' was unexpected" in result.stderr
    assert "./missing.yaml does not exist" in result.stderr
    assert "absent.env does not exist" in result.stderr


def default(value: str) -> str:
    """The value compose uses when no variable is set: ``${VAR:-x}`` -> ``x``."""
    return re.sub(r"\$\{[A-Z_]+:?-([^}]*)\}", r"\1", value)


def test_images_are_pinned_and_selected_by_variables(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        image = default(service.get("image", ""))
        assert image, name
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", (name, image)
        if image != default(services["streamproc"]["image"]):  # third-party: a version tag
            assert re.search(r"\d", tag), (name, image)
    variables = {
        "kafka": "KAFKA_IMAGE",
        "topic-init": "KAFKA_IMAGE",
        "prometheus": "PROMETHEUS_IMAGE",
        "grafana": "GRAFANA_IMAGE",
        "streamproc": "STREAMPROC_IMAGE",
        "zipkin": "ZIPKIN_IMAGE",
        "otel-collector": "OTEL_COLLECTOR_IMAGE",
    }
    for name, variable in variables.items():
        assert services[name]["image"].startswith(f"${{{variable}:-"), name
    # defaults: the official images for sites with a registry; local builds are never
    # re-tagged under these names (make images builds streamproc/*, selected by the variables)
    assert default(services["kafka"]["image"]) == "apache/kafka:4.4.0"
    assert default(services["prometheus"]["image"]).startswith("prom/prometheus:v")
    assert default(services["grafana"]["image"]).startswith("grafana/grafana:")
    assert default(services["zipkin"]["image"]) == "openzipkin/zipkin:3.6.1"
    assert default(services["otel-collector"]["image"]) == (
        "otel/opentelemetry-collector-contrib:0.148.0"
    )
    args = services["streamproc"]["build"]["args"]
    assert default(args["BASE_IMAGE"]).startswith("python:3.11")
    assert args["BASE_IMAGE"].startswith("${STREAMPROC_BASE_IMAGE:-")


def test_each_image_is_built_by_one_service_only(compose: dict[str, Any]) -> None:
    """Defect 4: four services with `build:` built the same image four times per run."""
    builders: dict[str, list[str]] = {}
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["dockerfile"] == "Dockerfile", name
            builders.setdefault(service["image"], []).append(name)
    assert builders == {compose["services"]["streamproc"]["image"]: ["streamproc"]}
    for name, service in compose["services"].items():
        if service["image"] in builders and name != "streamproc":
            assert service.get("pull_policy") == "never", f"{name} would try to pull the image"


def test_kafka_runs_kraft_single_node(compose: dict[str, Any]) -> None:
    env = compose["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    assert "kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "kafka-broker-api-versions.sh" in " ".join(
        compose["services"]["kafka"]["healthcheck"]["test"]
    )


def test_streamproc_and_replayers_wiring(compose: dict[str, Any]) -> None:
    services = compose["services"]
    config = yaml.safe_load((AUX / "streamproc.yaml").read_text())
    app = services["streamproc"]
    assert app["command"][:1] == ["run"]
    assert "./deploy/compose/streamproc.yaml:/etc/streamproc/config.yaml:ro" in app["volumes"]
    assert app["read_only"] is True and app["user"] == "10001:10001" and app["cap_drop"] == ["ALL"]
    assert int(app["stop_grace_period"].rstrip("s")) > config["shutdown_timeout_s"]
    assert app["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"
    topics = set(services["topic-init"]["environment"]["TOPICS"].split())
    inputs = set()
    for pipeline in config["pipelines"]:
        inputs.add(pipeline["input_topic"])
        dlq = pipeline.get("dlq_topic") or f"{pipeline['input_topic']}.dlq"
        assert {pipeline["input_topic"], pipeline["output_topic"], dlq} <= topics
    replayed = set()
    for name, service in services.items():
        if name.startswith("replay-"):
            command = service["command"]
            assert command[0] == "produce" and command[1] in ("video", "iot", "trades")
            assert service["image"] == app["image"] and "build" not in service
            assert service["healthcheck"] == {"disable": True}
            replayed.add(command[command.index("--topic") + 1])
    assert replayed == inputs


def test_compose_config_is_valid_for_the_package() -> None:
    config = load_config(AUX / "streamproc.yaml")
    assert config.metrics.port == 9108
    assert config.bootstrap_servers == "kafka:9092"


def test_prometheus_scrapes_streamproc() -> None:
    prometheus = yaml.safe_load((AUX / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["streamproc"]["static_configs"][0]["targets"] == ["streamproc:9108"]
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    alerts = yaml.safe_load((AUX / "prometheus" / "alerts.yml").read_text())
    rules = [rule for group in alerts["groups"] for rule in group["rules"]]
    assert {r["alert"] for r in rules} >= {
        "StreamprocConsumerLagGrowing",
        "StreamprocDeadLettering",
        "StreamprocCommitFailures",
        "StreamprocPartitionsStalled",
        "StreamprocNotReady",
        "StreamprocModelRolledBack",
        "StreamprocModelBroken",
        "StreamprocLatencyOverTarget",
        "StreamprocAcknowledgementsLagging",
    }
    for rule in rules:
        assert set(re.findall(r"streamproc_[a-z0-9_]+", rule["expr"])) <= {
            f"{m}{suffix}" for m in METRICS for suffix in ("", "_bucket")
        }, rule["alert"]


def test_grafana_provisioning_and_dashboard() -> None:
    datasources = yaml.safe_load(
        (AUX / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((AUX / "grafana/provisioning/dashboards/streamproc.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    dashboard = json.loads((AUX / "grafana/dashboards/streamproc.json").read_text())
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    exprs = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in panels.items()}
    wanted = {
        "Throughput": "streamproc_messages_consumed_total",
        "End-to-end latency P50 / P99": "streamproc_end_to_end_seconds_bucket",
        "Latency P99 by stage": "streamproc_stage_seconds_bucket",
        "Batch size": "streamproc_batch_size_messages",
        "Consumer lag": "streamproc_consumer_lag_messages",
        "Paused partitions": "streamproc_paused_partitions",
        "Dead-letter rate": "streamproc_messages_dead_lettered_total",
        "GPU utilisation": "streamproc_gpu_utilization_ratio",
        "GPU memory used": "streamproc_gpu_memory_used_bytes",
        "Latency P99 against target": "streamproc_latency_target_seconds",
        "Expired records": "streamproc_expired_total",
        "Inputs awaiting acknowledgement": "streamproc_unacknowledged_bytes",
    }
    for prefix, metric in wanted.items():
        title = next((t for t in panels if t.startswith(prefix)), None)
        assert title, f"no panel {prefix!r}"
        assert metric in exprs[title], title
    latency = exprs[next(t for t in panels if t.startswith("End-to-end"))]
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    used = set(re.findall(r"streamproc_[a-z0-9_]+", " ".join(exprs.values())))
    known = {f"{m}{s}" for m in METRICS for s in ("", "_bucket", "_sum", "_count")}
    assert used <= known, used - known
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_test_tears_the_stack_down_on_every_exit() -> None:
    text = (AUX / "compose-test.sh").read_text()
    assert "set -euo pipefail" in text and "at_exit cleanup" in text and "down --volumes" in text


def test_alert_rules_have_promtool_unit_tests_for_lag_and_stalled_partitions() -> None:
    tests = yaml.safe_load((AUX / "prometheus" / "alerts.test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert {
        "StreamprocConsumerLagGrowing",
        "StreamprocPartitionsStalled",
        "StreamprocModelBroken",
        "StreamprocLatencyOverTarget",
        "StreamprocAcknowledgementsLagging",
    } <= fired


def test_partitions_that_never_received_a_record_count_as_committed() -> None:
    """Defect 1: with 12 input partitions and 7 of them empty, the old lag check waited 300 s.
    compose-test now judges commits with streamproc.tools.verify (deploy/compose/check_stack.py)."""
    from streamproc.tools.verify import Verdict

    def verdict(committed: dict[int, int]) -> Verdict:
        return Verdict("t", 5, 5, 0, [], 0, committed, {0: 3, 1: 0, 2: 2, 3: 0})

    assert verdict({0: 3, 2: 2}).committed_equals_end
    assert not verdict({0: 3, 2: 1}).committed_equals_end
    assert not verdict({0: 3}).committed_equals_end
    assert "check_stack.py" in (AUX / "compose-test.sh").read_text()


def test_ci_runs_the_test_command_then_the_compose_test() -> None:
    """.ci/run: the README's test command, the long test tiers, the compose test, the chart's
    CI subset on a real cluster, the seeded fault schedule on three brokers, then the GPU
    check's dry run, in that order, each a timed step."""
    lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if "make " in line and not line.lstrip().startswith(("#", "echo"))
    ]
    assert lines == [
        "step make venv kafka-jars tracing-backend tools",
        "background images make images",
        "step make test",
        "step make test-models",
        "step make test-registry",
        "step make test-failures",
        "step make test-workloads",
        "step make compose-test",
        "step K8S_CHECKS=ci make k8s-test",
        "step make test-faults-ci",
        "step make gpu-bundle",
        "step make gpu-dry-run",
    ]


def test_ci_awaits_each_background_build_before_the_step_that_uses_it() -> None:
    """.ci/run builds the images and Kubernetes in the background beside the test tiers; the
    compose test must wait for the images and the chart's step for the Kubernetes build, and
    nothing may wait for a job that was never started."""
    steps = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip().startswith(("step ", "background ", "await "))
    ]
    started = {line.split()[1]: i for i, line in enumerate(steps) if line.startswith("background ")}
    awaited = {line.split()[1]: i for i, line in enumerate(steps) if line.startswith("await ")}
    assert started.keys() == awaited.keys() == {"images", "kubernetes-build"}
    assert started["images"] < steps.index("step make test") < awaited["images"]
    assert awaited["images"] == steps.index("step make compose-test") - 1
    assert awaited["kubernetes-build"] == steps.index("step K8S_CHECKS=ci make k8s-test") - 1
    assert started["kubernetes-build"] < steps.index("step make test")
