from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from streamproc.config import load_config
from streamproc.errors import ConfigError

PIPELINE = {"name": "f", "input_topic": "in", "output_topic": "out", "workload": "video"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_file_and_defaults(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            """
kafka: {bootstrap_servers: "127.0.0.1:9092", group_id: g}
pipelines:
  - {name: frames, input_topic: video.frames, output_topic: video.labels, workload: video}
processing_guarantee: at_least_once
""",
        )
    )
    assert cfg.kafka.group_id == "g"
    assert cfg.pipelines[0].dead_letter_topic == "video.frames.dlq"
    assert cfg.batching.max_wait_ms == 20.0
    with pytest.raises(ValidationError):  # frozen
        cfg.kafka.group_id = "x"  # type: ignore[misc]


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMPROC_BATCHING__MAX_WAIT_MS", "5")
    monkeypatch.setenv("STREAMPROC_KAFKA__GROUP_ID", "from-env")
    cfg = load_config(
        write(
            tmp_path,
            "kafka: {group_id: g}\nbatching: {max_batch_size: 8}\n"
            "pipelines: [{name: f, input_topic: i, output_topic: o, "
            "workload: video}]\n",
        )
    )
    assert cfg.batching.max_wait_ms == 5.0
    assert cfg.batching.max_batch_size == 8
    assert cfg.kafka.group_id == "from-env"


def test_unknown_key_names_key_and_allowed_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [PIPELINE], "batching": {"max_wait": 5}})
    assert "batching.max_wait" in str(err.value)
    assert "max_wait_ms" in str(err.value)


def test_bad_enum_names_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [PIPELINE], "processing_guarantee": "twice"})
    assert "processing_guarantee" in str(err.value)
    assert "at_least_once" in str(err.value) and "'twice'" in str(err.value)


@pytest.mark.parametrize(
    ("batching", "message"),
    [
        ({"max_wait_ms": math.inf}, r"batching\.max_wait_ms: .*finite"),
        ({"max_wait_ms": 1e300}, r"batching\.max_wait_ms: .*less than or equal to 3600000"),
        ({"priority_max_wait_ms": {"high": math.nan}}, r"priority_max_wait_ms\.high: .*finite"),
        ({"priority_max_wait_ms": {"low": -1}}, r"priority_max_wait_ms\.low: .*greater than"),
    ],
)
def test_max_waits_must_be_finite_and_bounded(batching: dict[str, Any], message: str) -> None:
    # an infinite wait reached Condition.wait (OverflowError) and NaN made it return at once
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"pipelines": [PIPELINE], "batching": batching})


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e-9, 0, -1, 2.9, 86_401, 1e300])
def test_assignment_timeout_must_be_finite_and_within_its_range(value: float) -> None:
    # inf: a run whose group is behind never exited; 1e-9: a group measurement begun before
    # the quiet window made a finished run exit 1
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [PIPELINE], "kafka": {"assignment_timeout_s": value}})
    message = str(err.value)
    assert "kafka.assignment_timeout_s" in message
    assert "from 3 to 86400" in message, message


@pytest.mark.parametrize("value", [3, 120.5, 86_400])
def test_assignment_timeout_within_its_range_is_taken(value: float) -> None:
    config = load_config(
        overrides={"pipelines": [PIPELINE], "kafka": {"assignment_timeout_s": value}}
    )
    assert config.kafka.assignment_timeout_s == value


def test_unknown_workload_and_bad_watermarks_fail_at_start() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.0\.workload.*allowed"):
        load_config(overrides={"pipelines": [{**PIPELINE, "workload": "audio"}]})
    with pytest.raises(ConfigError, match="low_watermark"):
        load_config(
            overrides={
                "pipelines": [PIPELINE],
                "buffers": {"high_watermark": 0.3, "low_watermark": 0.5},
            }
        )


def test_a_ring_capacity_in_bytes_below_a_kilobyte_fails_at_start_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"buffers\.ring_capacity_bytes"):
        load_config(overrides={"pipelines": [PIPELINE], "buffers": {"ring_capacity_bytes": 0}})
    config = load_config(overrides={"pipelines": [PIPELINE]}, bootstrap="b:1")
    # rings of light messages deeper than a fetch, rings of large ones bounded by their bytes
    assert config.buffers.ring_capacity == 16_384
    assert config.buffers.ring_capacity_bytes == 8 * 1024 * 1024


def test_max_unacknowledged_bytes_below_a_kilobyte_fails_at_start_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"buffers\.max_unacknowledged_bytes"):
        load_config(
            overrides={"pipelines": [PIPELINE], "buffers": {"max_unacknowledged_bytes": -1}}
        )
    config = load_config(overrides={"pipelines": [PIPELINE]}, bootstrap="b:1")
    assert config.buffers.max_unacknowledged_bytes == 8 * 1024 * 1024


def test_missing_pipelines_and_unset_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMPROC_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="pipelines") as missing:
        load_config(overrides={})
    assert "--config FILE or set STREAMPROC_CONFIG" in str(missing.value)  # says how
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    cfg = load_config(overrides={"pipelines": [PIPELINE]})
    with pytest.raises(ConfigError, match=r"kafka\.bootstrap_servers"):
        _ = cfg.bootstrap_servers
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "h:1")
    assert cfg.bootstrap_servers == "h:1"
    assert (
        load_config(overrides={"pipelines": [PIPELINE]}, bootstrap="b:2").bootstrap_servers == "b:2"
    )


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "kafka: [unclosed"))
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "absent.yaml")


def test_feedback_loop_and_unavailable_guarantee_name_their_keys() -> None:
    with pytest.raises(ConfigError, match="feedback loop"):
        load_config(overrides={"pipelines": [{**PIPELINE, "output_topic": "in"}]})
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [PIPELINE], "processing_guarantee": "twice"})
    assert str(err.value).splitlines()[1].strip().startswith("processing_guarantee:")


def test_misspelled_environment_section_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMPROC_BATCHNG__MAX_WAIT_MS", "5")
    with pytest.raises(ConfigError, match=r"STREAMPROC_BATCHNG__MAX_WAIT_MS.*batching"):
        load_config(overrides={"pipelines": [PIPELINE]})


def test_the_removed_lock_folder_setting_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """STREAMPROC_LOCK_DIR (the old slot lock folder; slots are abstract sockets now) is no
    longer read: a unit file that still sets it fails loudly instead of being silently ignored."""
    monkeypatch.setenv("STREAMPROC_LOCK_DIR", "/run/streamproc")
    with pytest.raises(ConfigError, match=r"STREAMPROC_LOCK_DIR: unknown config section"):
        load_config(overrides={"pipelines": [PIPELINE]})


def test_one_bad_pipeline_entry_gives_one_error_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [{**PIPELINE, "workload": "vidoe"}]})
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and "pipelines.0.workload" in lines[0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("auto", "auto"),
        (["cpu", "cpu"], ("cpu", "cpu")),
        ("cuda:0, cuda:1", ("cuda:0", "cuda:1")),  # the environment's comma-separated form
        (["cuda", "cpu"], ("cuda:0", "cpu")),
    ],
)
def test_worker_devices(value: object, expected: object) -> None:
    config = load_config(overrides={"pipelines": [PIPELINE], "worker": {"devices": value}})
    assert config.worker.devices == expected
    assert (
        config.worker.device == "auto"
    )  # kept; devices wins when set (streamproc.dispatch.selection)


def test_worker_devices_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMPROC_WORKER__DEVICES", '["cpu", "cpu"]')
    assert load_config(overrides={"pipelines": [PIPELINE]}).worker.devices == ("cpu", "cpu")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "allowed: auto, or a non-empty list"),
        (["gpu0"], "unknown device 'gpu0'; allowed: auto"),
        (["cuda:0", "cuda:0"], "listed more than once"),
        (3, "allowed: auto"),
    ],
)
def test_bad_worker_devices_name_the_key_and_allowed_values(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"pipelines": [PIPELINE], "worker": {"devices": value}})
    assert "worker.devices:" in str(err.value) and message in str(err.value)


def test_precision_keys_name_the_allowed_values() -> None:
    cfg = load_config(
        overrides={
            "pipelines": [
                PIPELINE,
                {**PIPELINE, "name": "g", "input_topic": "in2", "precision": "bf16"},
            ],
            "worker": {"precision": "int8"},
        }
    )
    assert cfg.worker.precision == "int8"
    assert [p.precision for p in cfg.pipelines] == [None, "bf16"]
    with pytest.raises(ConfigError) as caught:
        load_config(overrides={"pipelines": [{**PIPELINE, "precision": "half"}]})
    assert "pipelines.0.precision: Input should be 'fp32', 'bf16', 'fp16' or 'int8'" in str(
        caught.value
    )


def test_decode_worker_bounds_default_to_a_fixed_count_and_are_checked() -> None:
    def worker(**keys: int) -> Any:
        return load_config(overrides={"pipelines": [PIPELINE], "worker": keys}).worker

    fixed = worker(decode_workers=3)
    assert fixed.decode_workers_bounds == (3, 3) and fixed.decode_workers_start == 3
    only_max = worker(decode_workers_max=6)
    assert only_max.decode_workers_bounds == (1, 6) and only_max.decode_workers_start == 2
    moved = worker(decode_workers_min=4, decode_workers_max=8)  # default start 2 moves up
    assert moved.decode_workers_start == 4
    with pytest.raises(ConfigError, match=r"decode_workers_min \(5\) must be at most"):
        worker(decode_workers_min=5, decode_workers_max=3)
    with pytest.raises(ConfigError, match=r"worker.decode_workers \(8, the count at start\)"):
        worker(decode_workers=8, decode_workers_max=4)


@pytest.mark.parametrize(
    ("kafka", "message"),
    [
        ({"group_protocol": "eager"}, r"kafka\.group_protocol: .*'classic' or 'consumer'"),
        (
            {"group_protocol": "consumer", "session_timeout_ms": 10_000},
            r"kafka\.session_timeout_ms: not supported with kafka\.group_protocol=consumer",
        ),
        (
            {"group_protocol": "consumer", "consumer": {"heartbeat.interval.ms": 500}},
            r"kafka\.consumer: \['heartbeat\.interval\.ms'\] not supported",
        ),
        ({"consumer": {"group.instance.id": "a"}}, r"set kafka\.group_instance_id instead"),
        ({"consumer": {"group.protocol": "consumer"}}, r"set kafka\.group_protocol instead"),
        ({"group_instance_id": ""}, r"kafka\.group_instance_id"),
    ],
)
def test_group_keys_the_protocol_refuses_fail_at_start_naming_the_key(
    kafka: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"pipelines": [PIPELINE], "kafka": kafka})


def test_the_group_protocol_and_static_membership_reach_the_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamproc.intake.source import consumer_settings
    from streamproc.metrics import Metrics
    from streamproc.offsets.guarantees import AtLeastOnce
    from streamproc.offsets.tracker import OffsetTracker

    guarantee = AtLeastOnce(OffsetTracker(), Metrics())
    classic = consumer_settings(
        load_config(overrides={"pipelines": [PIPELINE]}, bootstrap="b:1"), guarantee
    )
    assert classic["partition.assignment.strategy"] == "cooperative-sticky"
    assert classic["session.timeout.ms"] == 45_000
    assert "group.protocol" not in classic and "group.instance.id" not in classic
    # the chart sets the instance id from the pod name through the environment
    monkeypatch.setenv("STREAMPROC_KAFKA__GROUP_INSTANCE_ID", "streamproc-1")
    config = load_config(
        overrides={"pipelines": [PIPELINE], "kafka": {"group_protocol": "consumer"}},
        bootstrap="b:1",
    )
    new = consumer_settings(config, guarantee)
    assert new["group.protocol"] == "consumer" and new["group.instance.id"] == "streamproc-1"
    assert not {"partition.assignment.strategy", "session.timeout.ms"} & new.keys()


def test_the_consumer_prefetches_per_partition_what_its_ring_takes_before_it_pauses() -> None:
    # librdkafka drops a paused partition's prefetch and fetches it again after the resume: its
    # default prefetch (100,000 a partition) made a trades backlog fetch every record 5-60 times
    from streamproc.intake.source import consumer_settings
    from streamproc.metrics import Metrics
    from streamproc.offsets.guarantees import AtLeastOnce
    from streamproc.offsets.tracker import OffsetTracker

    guarantee = AtLeastOnce(OffsetTracker(), Metrics())
    rings = {"ring_capacity": 1000, "high_watermark": 0.5, "low_watermark": 0.1}
    config = load_config(overrides={"pipelines": [PIPELINE], "buffers": rings}, bootstrap="b:1")
    settings = consumer_settings(config, guarantee)
    assert settings["queued.min.messages"] == 500
    assert settings["fetch.queue.backoff.ms"] < 1000  # librdkafka's 1 s would starve the rings
    tiny = load_config(
        overrides={"pipelines": [PIPELINE], "buffers": {"ring_capacity": 2, "low_watermark": 0.1}},
        bootstrap="b:1",
    )
    assert consumer_settings(tiny, guarantee)["queued.min.messages"] == 2  # round(0.75 x 2)
    # the user's kafka.consumer still decides
    mine = {"queued.min.messages": 7, "fetch.queue.backoff.ms": 100}
    config = load_config(
        overrides={"pipelines": [PIPELINE], "kafka": {"consumer": mine}}, bootstrap="b:1"
    )
    assert mine.items() <= consumer_settings(config, guarantee).items()


def test_model_section_takes_its_locations_and_the_admin_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMPROC_MODEL_REPOSITORY", "/models")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("STREAMPROC_ADMIN_TOKEN", "t0k3n-0123456789abc")
    monkeypatch.setenv("STREAMPROC_ADMIN_URL", "http://127.0.0.1:9108")  # the CLI's, not config
    folder = {**PIPELINE, "name": "a", "model": {"name": "iot"}}
    mlflow = {
        **PIPELINE,
        "name": "b",
        "input_topic": "j",
        "model": {"source": "mlflow", "name": "x"},
    }
    cfg = load_config(overrides={"pipelines": [folder, mlflow]})
    assert cfg.pipelines[0].model is not None and cfg.pipelines[0].model.repository == "/models"
    assert cfg.pipelines[0].model.version == "latest" and cfg.pipelines[0].model.mode == "swap"
    assert cfg.pipelines[1].model is not None
    assert cfg.pipelines[1].model.tracking_uri == "http://127.0.0.1:5000"
    assert (
        cfg.admin.token is not None and cfg.admin.token.get_secret_value() == "t0k3n-0123456789abc"
    )
    assert "t0k3n-0123456789abc" not in repr(cfg)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"name": "iot"}, r"model\.repository.*STREAMPROC_MODEL_REPOSITORY"),
        ({"name": "iot", "source": "mlflow"}, r"model\.tracking_uri.*MLFLOW_TRACKING_URI"),
        (
            {"name": "iot", "repository": "/m", "source": "s3"},
            r"model\.source.*'folder' or 'mlflow'",
        ),
        ({"name": "iot", "repository": "/m", "mode": "canary"}, r"model\.mode.*'swap' or 'shadow'"),
        (
            {
                "name": "iot",
                "repository": "/m",
                "rollback": {"min_batches": 9, "window_batches": 5},
            },
            r"rollback\.min_batches \(9\) must be at most rollback\.window_batches \(5\)",
        ),
        ({"name": "iot", "repository": "/m", "shadow": {"sample": 0}}, r"model\.shadow\.sample"),
    ],
)
def test_a_bad_model_section_fails_at_start_naming_the_key(
    model: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STREAMPROC_MODEL_REPOSITORY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"pipelines": [{**PIPELINE, "model": model}]})


@pytest.mark.parametrize("max_age_ms", [0, -5])
def test_max_age_ms_must_be_positive_and_names_the_key(max_age_ms: int) -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.0\.max_age_ms: .*greater than 0"):
        load_config(overrides={"pipelines": [{**PIPELINE, "max_age_ms": max_age_ms}]})


def test_on_expired_names_its_allowed_values_and_defaults_to_a_result() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.0\.on_expired.*'result'.*'dead_letter'"):
        load_config(overrides={"pipelines": [{**PIPELINE, "on_expired": "drop"}]})
    config = load_config(overrides={"pipelines": [{**PIPELINE, "max_age_ms": 250}]})
    assert config.pipelines[0].max_age_ms == 250 and config.pipelines[0].on_expired == "result"


def test_expire_when_names_its_allowed_values_and_defaults_to_predicted() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.0\.expire_when.*'passed'.*'predicted'"):
        load_config(overrides={"pipelines": [{**PIPELINE, "expire_when": "early"}]})
    config = load_config(overrides={"pipelines": [PIPELINE]})
    assert config.pipelines[0].expire_when == "predicted"


@pytest.mark.parametrize(
    "value", [0, -5, -0.5, "fast", float("nan"), float("inf"), True, 3_600_001]
)
def test_latency_target_ms_must_be_a_positive_number_and_names_the_key(value: object) -> None:
    with pytest.raises(
        ConfigError, match=r"pipelines\.0\.latency_target_ms: .*milliseconds above 0, up to 3600000"
    ):
        load_config(overrides={"pipelines": [{**PIPELINE, "latency_target_ms": value}]})


def test_latency_target_ms_defaults_from_the_priority() -> None:
    from streamproc.config.sections import DEFAULT_LATENCY_TARGET_MS
    from streamproc.records import Priority

    assert DEFAULT_LATENCY_TARGET_MS == {"high": 30.0, "normal": 100.0, "low": 2000.0}
    config = load_config(overrides={"pipelines": [PIPELINE]})
    spec = config.pipelines[0]
    assert spec.latency_target_ms is None
    assert spec.latency_target_s(Priority.HIGH) == 0.030
    assert spec.latency_target_s(Priority.LOW) == 2.0
    config = load_config(overrides={"pipelines": [{**PIPELINE, "latency_target_ms": "7.5"}]})
    assert config.pipelines[0].latency_target_s(Priority.LOW) == 0.0075
