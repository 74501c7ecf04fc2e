"""The ``streamproc`` command line (``streamproc.cli``): help, argument parsing, config errors
with the key, the allowed values and exit code 2, and what ``run``, ``produce`` and ``bench``
hand on. Nothing here starts a broker or a pipeline: ``run`` gets a fake ``Pipeline``, and
``produce`` and ``bench`` fake entry points.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from streamproc import cli
from streamproc.config import Config
from streamproc.errors import StreamprocError
from streamproc.offsets.outcomes import Produced, RunCounts
from streamproc.pipeline import RunSummary
from streamproc.tools.bench.runner import Paced

PIPELINE = {"name": "p", "input_topic": "in", "output_topic": "out", "workload": "trades"}


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.app, list(args))


@pytest.fixture(autouse=True)
def _no_outside_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker address and config file come only from what a test passes."""
    for name in list(os.environ):
        if name.upper().startswith("STREAMPROC_") or name == "KAFKA_BOOTSTRAP_SERVERS":
            monkeypatch.delenv(name)


@pytest.fixture
def config_file(tmp_path: Path) -> Callable[..., str]:
    """Writes a config file (one trades pipeline plus ``sections``); returns its path."""

    def write(**sections: Any) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"pipelines": [PIPELINE], **sections}))
        return str(path)

    return write


@dataclass
class Launch:
    """What ``run`` did: the pipelines it built, the signal handlers and logging it set up,
    and the immediate exits it asked for. ``summary`` is what a pipeline's run returns."""

    summary: RunSummary = field(default_factory=lambda: RunSummary(exit_code=0, elapsed_s=1.0))
    failure: StreamprocError | None = None
    pipelines: list[FakePipeline] = field(default_factory=list)
    handlers: dict[int, Any] = field(default_factory=dict)
    logging: list[tuple[str, str]] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)

    def exit_at_once(self, code: int) -> None:
        """``os._exit``: never returns (here: raises :class:`ExitedAtOnce`)."""
        self.exits.append(code)
        raise ExitedAtOnce(code)


class ExitedAtOnce(Exception):
    """What the fake ``os._exit`` raises."""


class FakePipeline:
    """Stands in for ``streamproc.pipeline.Pipeline``: records its config and run, counts
    what a run of two messages would have counted."""

    def __init__(self, config: Config, launch: Launch) -> None:
        self.config = config
        self.launch = launch
        self.idle_s: list[float | None] = []
        self.stops = 0
        launch.pipelines.append(self)

    def run(self, exit_when_idle_s: float | None = None) -> RunSummary:
        self.idle_s.append(exit_when_idle_s)
        if self.launch.failure is not None:
            raise self.launch.failure
        outcome = RunCounts(2, 0, Produced(results=1, dead_lettered=1))
        return dataclasses.replace(self.launch.summary, outcomes={"in": outcome})

    def request_stop(self) -> None:
        self.stops += 1


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Launch:
    launch = Launch()
    monkeypatch.setattr("streamproc.pipeline.Pipeline", lambda cfg: FakePipeline(cfg, launch))
    monkeypatch.setattr(
        signal, "signal", lambda signum, handler: launch.handlers.update({signum: handler})
    )
    monkeypatch.setattr(faulthandler, "register", lambda *args, **kwargs: None)
    monkeypatch.setattr(os, "_exit", launch.exit_at_once)
    monkeypatch.setattr(
        "streamproc.logs.configure", lambda level, fmt: launch.logging.append((level, fmt))
    )
    return launch


# -- help --------------------------------------------------------------------------------------
def test_help_lists_every_subcommand() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("kafka", "produce", "run", "demo", "bench"):
        assert command in result.stdout


def test_no_arguments_shows_the_help_instead_of_doing_anything() -> None:
    assert "Usage:" in invoke().output
    kafka = invoke("kafka").output
    assert "start" in kafka and "stop" in kafka


def test_run_help_names_its_options() -> None:
    result = invoke("run", "--help")
    assert result.exit_code == 0
    for option in ("--config", "--bootstrap", "--exit-when-idle-s", "STREAMPROC_CONFIG"):
        assert option in result.stdout


# -- run ---------------------------------------------------------------------------------------
def test_run_parses_its_options_and_hands_them_to_the_pipeline(
    launch: Launch, config_file: Callable[..., str]
) -> None:
    path = config_file(kafka={"bootstrap_servers": "file:9092"}, logging={"level": "debug"})
    result = invoke("run", "--config", path, "--bootstrap", "flag:9092", "--exit-when-idle-s", "7")
    assert result.exit_code == 0, result.output
    (pipeline,) = launch.pipelines
    assert pipeline.config.bootstrap_servers == "flag:9092"  # the flag wins over the file
    assert pipeline.idle_s == [7.0]
    assert launch.logging == [("debug", "auto")]
    assert "p: 2 consumed from in, 1 results to out, 1 dead-lettered to in.dlq" in result.stdout


def test_run_takes_the_config_file_from_the_environment(
    launch: Launch, config_file: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMPROC_CONFIG", config_file(kafka={"bootstrap_servers": "env:9092"}))
    assert invoke("run").exit_code == 0
    assert launch.pipelines[0].config.bootstrap_servers == "env:9092"


def test_run_with_a_bad_value_names_the_key_and_the_allowed_values_and_exits_2(
    launch: Launch, config_file: Callable[..., str]
) -> None:
    result = invoke(
        "run", "--config", config_file(processing_guarantee="twice"), "--bootstrap", "b:1"
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("error: invalid configuration")
    assert "processing_guarantee" in result.stderr
    assert "'at_least_once' or 'exactly_once'" in result.stderr
    assert launch.pipelines == []  # nothing started


def test_run_with_an_unknown_key_lists_the_allowed_keys(
    launch: Launch, config_file: Callable[..., str]
) -> None:
    result = invoke("run", "--config", config_file(batching={"max_batch": 4}), "--bootstrap", "b:1")
    assert result.exit_code == 2
    assert "batching.max_batch: unknown key; allowed: ['adaptive_batch_size'" in result.stderr
    assert launch.pipelines == []


def test_run_without_a_broker_address_says_where_to_give_one(
    launch: Launch, config_file: Callable[..., str]
) -> None:
    result = invoke("run", "--config", config_file())
    assert result.exit_code == 2
    assert "kafka.bootstrap_servers: not set; pass --bootstrap" in result.stderr
    assert launch.pipelines == []


def test_run_refuses_a_negative_idle_time_before_reading_any_config(launch: Launch) -> None:
    result = invoke("run", "--exit-when-idle-s", "-1")
    assert result.exit_code == 2 and "--exit-when-idle-s" in result.stderr
    assert launch.pipelines == []


@pytest.mark.parametrize(
    ("summary", "failure", "code", "stderr"),
    [
        (RunSummary(1, 1.0, error="model broken"), None, 1, "error: model broken\n"),
        (RunSummary(0, 1.0), StreamprocError("no answer"), 2, "error: no answer\n"),
    ],
    ids=["the-run-failed", "the-run-raised"],
)
def test_run_exits_with_the_pipeline_exit_code_or_2_and_prints_the_error(
    launch: Launch,
    config_file: Callable[..., str],
    summary: RunSummary,
    failure: StreamprocError | None,
    code: int,
    stderr: str,
) -> None:
    launch.summary, launch.failure = summary, failure
    result = invoke("run", "--config", config_file(), "--bootstrap", "b:1")
    assert result.exit_code == code and result.stderr == stderr


def test_the_first_signal_stops_the_pipeline_and_the_second_exits_at_once(
    launch: Launch, config_file: Callable[..., str]
) -> None:
    assert invoke("run", "--config", config_file(), "--bootstrap", "b:1").exit_code == 0
    assert set(launch.handlers) == {signal.SIGTERM, signal.SIGINT}
    (pipeline,) = launch.pipelines
    launch.handlers[signal.SIGTERM](signal.SIGTERM, None)
    assert pipeline.stops == 1 and launch.exits == []
    with pytest.raises(ExitedAtOnce):
        launch.handlers[signal.SIGINT](signal.SIGINT, None)
    assert launch.exits == [130] and pipeline.stops == 1


# -- produce, demo, bench ----------------------------------------------------------------------
def test_produce_refuses_an_unknown_workload_naming_the_built_in_ones() -> None:
    result = invoke("produce", "nope", "--topic", "t", "--bootstrap", "b:1")
    assert result.exit_code == 2
    assert result.stderr == "error: workload: unknown 'nope'; allowed: ['video', 'iot', 'trades']\n"


def test_produce_needs_a_broker_address() -> None:
    result = invoke("produce", "iot", "--topic", "t")
    assert result.exit_code == 2
    assert "no broker: pass --bootstrap or set KAFKA_BOOTSTRAP_SERVERS" in result.stderr


def test_produce_hands_its_arguments_to_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def produce(
        *args: Any,
        transaction_size: int | None = None,
        value_format: str = "json",
        registry_url: str | None = None,
    ) -> int:
        calls.append((*args, transaction_size, value_format, registry_url))
        return 12

    monkeypatch.setattr("streamproc.tools.replay.produce", produce)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    monkeypatch.delenv("SCHEMA_REGISTRY_URL", raising=False)
    result = invoke("produce", "iot", "--topic", "t", "--partitions", "2", "--limit", "12")
    assert result.exit_code == 0, result.output
    assert calls == [("iot", "t", "env:9092", 2, 12, None, None, "json", None)]
    assert result.stdout == "produced 12 iot messages to t\n"
    result = invoke("produce", "iot", "--topic", "t", "--limit", "12", "--transaction-size", "5")
    assert result.exit_code == 0, result.output
    assert calls[-1] == ("iot", "t", "env:9092", 4, 12, None, 5, "json", None)
    monkeypatch.setenv("SCHEMA_REGISTRY_URL", "http://r:8081/apis/ccompat/v7")
    result = invoke("produce", "trades", "--topic", "t", "--limit", "3", "--format", "avro")
    assert result.exit_code == 0, result.output
    assert calls[-1] == (
        "trades",
        "t",
        "env:9092",
        4,
        3,
        None,
        None,
        "avro",
        "http://r:8081/apis/ccompat/v7",
    )


def test_produce_in_avro_refuses_a_workload_without_an_avro_schema_and_a_missing_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SCHEMA_REGISTRY_URL", raising=False)
    result = invoke("produce", "video", "--topic", "t", "--bootstrap", "b:1", "--format",
                    "jsonschema", "--registry", "http://r:1")  # fmt: skip
    assert result.exit_code == 2
    assert "--format jsonschema: workload 'video' has no JSON Schema" in result.stderr
    result = invoke("produce", "iot", "--topic", "t", "--bootstrap", "b:1", "--format", "avro")
    assert result.exit_code == 2 and "--format avro needs the registry" in result.stderr
    result = invoke("produce", "iot", "--topic", "t", "--bootstrap", "b:1", "--format", "xml")
    assert (
        result.exit_code == 2
        and "'xml' is not one of ['json', 'avro', 'protobuf', 'jsonschema']" in result.stderr
    )


def test_produce_refuses_zero_partitions() -> None:
    result = invoke("produce", "iot", "--topic", "t", "--partitions", "0", "--bootstrap", "b:1")
    assert result.exit_code == 2 and "--partitions" in result.stderr


def test_demo_refuses_an_unknown_format_naming_the_allowed_ones() -> None:
    result = invoke("demo", "--format", "xml")
    assert result.exit_code == 2
    assert "--format: 'xml'; allowed: json, avro, protobuf, jsonschema" in result.stderr


def test_demo_refuses_an_unknown_workload_naming_the_built_in_ones() -> None:
    result = invoke("demo", "--workload", "iot", "--workload", "nope")
    assert result.exit_code == 2
    assert "--workload: unknown ['nope']; allowed: ['video', 'iot', 'trades']" in result.stderr


def test_bench_splits_the_workload_list_and_exits_with_the_runner_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []

    def bench(*args: Any) -> int:
        calls.append(args)
        return 3

    monkeypatch.setattr("streamproc.tools.bench.runner.main", bench)
    result = invoke("bench", "--workloads", " iot, ,trades", "--repetitions", "2", "--quick")
    assert result.exit_code == 3
    assert calls == [(None, ("iot", "trades"), 2, True, Paced())]
    calls.clear()
    result = invoke(
        "bench", "--workloads", "trades", "--loads", "80", "--rate", "50000",
        "--paced-repetitions", "4",
    )  # fmt: skip
    assert result.exit_code == 3
    assert calls == [(None, ("trades",), 5, False, Paced((0.8,), 50_000.0, 4))]


def test_bench_refuses_a_load_out_of_range_naming_the_option() -> None:
    result = invoke("bench", "--workloads", "trades", "--loads", "80,0", "--rate", "1000")
    assert result.exit_code == 2
    assert "--loads: percentages in (0, 200]" in result.stderr


def test_an_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 130
