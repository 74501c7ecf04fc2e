"""Metrics, probes and logs during a real run against the broker."""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamproc import logs
from streamproc.config import load_config
from streamproc.errors import ConfigError
from streamproc.kafka.admin import ensure_topics
from streamproc.pipeline import Pipeline
from streamproc.stages import STAGES
from streamproc.tools.kafka_local import free_port
from streamproc.tools.replay import produce
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.core

SECRET = "hunter2-do-not-log"


def get(url: str) -> tuple[int, str]:
    """Status and body (an HTTP error status is an answer too). The timeout is generous: on a
    loaded machine the endpoint's thread shares two busy cores with the whole pipeline."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def status(url: str) -> int:
    """The status of ``url``, 0 while the endpoint does not answer yet (it listens from the
    pipeline's construction but serves only once the run has started: the start-up's topic
    checks against the broker come first and take seconds on a loaded machine)."""
    try:
        return get(url)[0]
    except OSError:  # URLError, a timeout
        return 0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(values: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return sum(
        v
        for (n, lbl), v in values.items()
        if n == name and all((k, val) in lbl for k, val in labels.items())
    )


def test_metrics_probes_and_lag_move_during_a_real_run(bootstrap_servers: str) -> None:
    suffix = uuid.uuid4().hex[:6]
    inp, out = f"trades.{suffix}", f"scores.{suffix}"
    ensure_topics(bootstrap_servers, {inp: 3, out: 3, f"{inp}.dlq": 1})
    count = produce("trades", inp, bootstrap_servers, 3, limit=400, progress=False)
    port = free_port()
    stream = io.StringIO()
    logs.configure("debug", "json", stream=stream)
    try:
        config = load_config(
            overrides={
                "kafka": {
                    "bootstrap_servers": bootstrap_servers,
                    "group_id": f"g-{suffix}",
                    "consumer": {
                        "sasl.username": "svc",
                        "sasl.password": SECRET,
                        "ssl.key.password": SECRET,
                    },
                },
                "pipelines": [
                    {"name": "t", "input_topic": inp, "output_topic": out, "workload": "trades"}
                ],
                "metrics": {"port": port, "host": "127.0.0.1", "lag_interval_s": 0.3},
            }
        )
        pipeline = Pipeline(config)
        base = f"http://127.0.0.1:{port}"
        assert pipeline.readiness() == (False, "created")
        summary: list = []
        runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
        runner.start()
        try:
            wait_for(lambda: status(f"{base}/readyz") == 200, 120, "readiness")
            assert get(f"{base}/healthz")[0] == 200

            def drained() -> bool:
                values = samples(get(f"{base}/metrics")[1])
                lag = [v for (n, _), v in values.items() if n == "streamproc_consumer_lag_messages"]
                return (
                    total(values, "streamproc_messages_produced_total", topic=out) == count
                    and len(lag) == 3
                    and all(v == 0 for v in lag)
                )

            wait_for(drained, 120, "all results produced and lag back to 0")
            values = samples(get(f"{base}/metrics")[1])
            assert total(values, "streamproc_messages_consumed_total", topic=inp) == count
            assert total(values, "streamproc_messages_dead_lettered_total") == 0
            assert total(values, "streamproc_end_to_end_seconds_count", topic=inp) == count
            assert total(values, "streamproc_batch_size_messages_sum", topic=inp) == count
            assert total(values, "streamproc_inference_seconds_count", topic=inp) > 0
            assert total(values, "streamproc_pinned_pool_capacity_buffers", topic=inp) > 0

            def stage_count(values: dict, stage: str) -> float:  # type: ignore[type-arg]
                return total(values, "streamproc_stage_seconds_count", topic=inp, stage=stage)

            # the commit stage ends at the next periodic commit (kafka.commit_interval_ms)
            wait_for(
                lambda: stage_count(samples(get(f"{base}/metrics")[1]), "commit") == count,
                60,
                "every record's commit stage",
            )
            values = samples(get(f"{base}/metrics")[1])
            assert {stage: stage_count(values, stage) for stage in STAGES} == dict.fromkeys(
                STAGES, count
            )
            # back to back: a record's stages up to produce add up to its end-to-end latency
            stages_s = sum(
                total(values, "streamproc_stage_seconds_sum", topic=inp, stage=stage)
                for stage in STAGES
                if stage != "commit"
            )
            end_to_end_s = total(values, "streamproc_end_to_end_seconds_sum", topic=inp)
            assert stages_s == pytest.approx(end_to_end_s, rel=0.01)
            assert get(f"{base}/nope")[0] == 404
            metrics_text = get(f"{base}/metrics")[1]
        finally:
            pipeline.request_stop()
            runner.join(60)
        assert summary and summary[0].exit_code == 0
        wait_for(lambda: pipeline.liveness()[0] is False, 10, "liveness to drop after close")
        assert SECRET not in metrics_text
    finally:
        logs.configure("info", "auto")
    log_text = stream.getvalue()
    lines = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    assert any(line.get("event") == "partitions assigned" for line in lines)
    assert any(line.get("event") == "consumer config" for line in lines)  # config was logged
    assert SECRET not in log_text


def test_config_errors_never_echo_secret_values() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides={
                "pipelines": [
                    {"name": "p", "input_topic": "i", "output_topic": "o", "workload": "iot"}
                ],
                "kafka": {"consumer": {"sasl.password": [SECRET]}},
            }
        )
    assert "kafka.consumer.sasl.password" in str(err.value)
    assert SECRET not in str(err.value)
