"""The assembly over the fake clients: what it builds for a config (nothing is
started; the pipeline's close releases what was built)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import structlog

from streamproc.assembly import METRICS_PORTS_TRIED, build_health
from streamproc.assembly.decoding import ProcessDecoding, ThreadDecoding
from streamproc.assembly.shared import admin_settings, late_results_reporter
from streamproc.config import Config, load_config
from streamproc.config.sections import MetricsConfig
from streamproc.dispatch.admission import DeviceAdmission
from streamproc.errors import ConfigError
from streamproc.metrics import Metrics
from streamproc.offsets.identity import claim_transactional_id
from streamproc.pipeline import Pipeline, State
from streamproc.records import Record, TopicPartition
from streamproc.share.source import ShareSource
from streamproc.workloads import Workload
from streamproc.workloads.trades import TradesWorkload
from tests.support.kafka_fakes import (
    FakeConsumer,
    FakeProducer,
    FakeShareConsumer,
    FakeShareMessage,
    factory,
)

TRADES = {"name": "t", "input_topic": "t", "output_topic": "to", "workload": "trades"}
IOT = {"name": "i", "input_topic": "i", "output_topic": "io", "workload": "iot"}


def _config(pipelines: list[dict[str, str]], **sections: Any) -> Config:
    overrides = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9"},
        "metrics": {"port": 0},
        "pipelines": pipelines,
        **sections,
    }
    return load_config(overrides=overrides)


def _pipeline(config: Config) -> Pipeline:
    return Pipeline(config, factory(FakeConsumer({})), factory(FakeProducer()))


def test_one_topic_stages_per_pipeline_and_one_device_worker_per_device() -> None:
    pipeline = _pipeline(_config([TRADES, IOT], worker={"devices": ["cpu", "cpu"]}))
    try:
        stages = pipeline.stages
        assert [t.topic for t in stages.topics] == ["t", "i"]  # config order
        assert [d.topic for d in stages.dispatchers] == ["t", "i"]
        assert all(len(t.workers) == 2 for t in stages.topics)
        assert pipeline.workers == [w for t in stages.topics for w in t.workers]
        assert [t.lane.default_priority.label for t in stages.topics] == ["high", "normal"]
        shared = stages.shared
        assert isinstance(shared.decoding, ThreadDecoding) and not shared.decoding.shared_staging
        assert shared.admission is not None  # two pipelines share the devices
        assert stages.http is None  # metrics.port 0
    finally:
        pipeline.close()
    assert pipeline.state is State.CLOSED


def _largest_batches(config: Config) -> dict[str, tuple[int, float | None]]:
    """Per pipeline: its staging slabs' rows and its ``batch_size_cap`` gauge at start."""
    pipeline = _pipeline(config)
    try:
        registry = pipeline.metrics.registry
        return {
            t.topic: (
                t.staging.rows,
                registry.get_sample_value(
                    "streamproc_batch_size_cap", {"topic": t.topic, "device": "cpu:0"}
                ),
            )
            for t in pipeline.stages.topics
        }
    finally:
        pipeline.close()


def test_a_pipeline_batches_up_to_its_workloads_size_unless_config_sets_one() -> None:
    cpu = {"device": "cpu"}
    # the built-ins' own: light records take batches of up to 64
    assert _largest_batches(_config([TRADES, IOT], worker=cpu)) == {
        "t": (64, 64.0),
        "i": (64, 64.0),
    }
    # batching.max_batch_size sets every pipeline's; pipelines[].max_batch_size one's own
    mine = {**IOT, "max_batch_size": 32}
    assert _largest_batches(
        _config([TRADES, mine], worker=cpu, batching={"max_batch_size": 8})
    ) == {"t": (8, 8.0), "i": (32, 32.0)}
    # a workload that names no size: 4
    assert Workload.max_batch_size == 4
    with pytest.raises(ConfigError, match=r"pipelines\.0\.max_batch_size"):
        _config([{**TRADES, "max_batch_size": 0}])


def test_decode_processes_share_the_staging_slabs() -> None:
    pipeline = _pipeline(_config([TRADES], worker={"device": "cpu", "decode_mode": "process"}))
    try:
        (topic,) = pipeline.stages.topics
        assert isinstance(pipeline.stages.shared.decoding, ProcessDecoding)
        assert topic.staging.shared_names  # slabs in named shared memory
        assert pipeline.stages.shared.admission is None  # one pipeline: nothing to order
    finally:
        pipeline.close()


def test_admission_only_where_several_pipelines_have_it_on() -> None:
    def admission(config: Config) -> DeviceAdmission | None:
        worker = config.worker
        return DeviceAdmission.if_needed(
            worker.priority_admission, len(config.pipelines), worker.priority_max_defer_ms / 1e3
        )

    both = admission(_config([TRADES, IOT]))
    assert both is not None and both.max_defer_s == 0.25  # priority_max_defer_ms: 250
    assert admission(_config([TRADES])) is None
    assert admission(_config([TRADES, IOT], worker={"priority_admission": False})) is None


def test_admin_settings_carry_the_brokers_and_the_security_settings_only() -> None:
    consumer = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "fetch.wait.max.ms": 5}
    config = _config([TRADES], kafka={"bootstrap_servers": "b:9092", "consumer": consumer})
    assert admin_settings(config) == {
        "bootstrap.servers": "b:9092",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
    }


def test_late_results_are_counted_as_they_happen() -> None:
    metrics = Metrics()
    report = late_results_reporter(metrics)
    report(TopicPartition("t", 0), 3, True)
    report(TopicPartition("t", 0), 2, False)
    assert metrics.registry.get_sample_value("streamproc_late_results_total") == 5


def test_late_results_of_a_share_member_say_they_were_released_not_revoked() -> None:
    report = late_results_reporter(Metrics(), share=True)
    with structlog.testing.capture_logs() as logs:
        report(TopicPartition("t", 0), 3, True)
    (logged,) = [e["event"] for e in logs if "late results" in e["event"]]
    assert "released to the share group" in logged and "no longer owned" not in logged


def _holding(port: int) -> socket.socket | None:
    """A listening socket on 127.0.0.1:``port``, or None when another process holds it (busy
    either way)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_processes_of_one_config_on_one_host_take_the_next_free_metrics_port() -> None:
    """Three `streamproc run` from one config on one host: two died at start-up with
    "OSError: [Errno 98] Address already in use" on the default metrics port (9108). A default
    port that is held is passed over for the next free one; one set by hand fails naming the key."""
    default = MetricsConfig().port
    held = _holding(default)
    live = ready = lambda: (True, "ok")
    try:
        config = _config([TRADES], metrics={"host": "127.0.0.1"})
        server = build_health(config, Metrics(), live, ready, {})
        assert server is not None
        try:
            assert default < server.port < default + METRICS_PORTS_TRIED
        finally:
            server.close()
        by_hand = _config([TRADES], metrics={"host": "127.0.0.1", "port": default})
        with pytest.raises(ConfigError, match=rf"metrics.port: 127.0.0.1:{default} in use"):
            build_health(by_hand, Metrics(), live, ready, {})
    finally:
        if held is not None:
            held.close()


def test_a_stage_that_fails_to_build_gives_back_what_was_built_before_it() -> None:
    # review of the house pass: the devices were selected after the producer was built; a
    # device not visible then left the transactional id's host slot held until a garbage
    # collection, and a retry in the same process got the next slot
    bad = _config(
        [TRADES],
        processing_guarantee="exactly_once",
        kafka={"bootstrap_servers": "127.0.0.1:9", "group_id": "g-assembly-release"},
        worker={"devices": ["cuda:63"]},  # not visible, GPU or not
    )
    for _ in range(2):
        with pytest.raises(ConfigError, match="cuda:63"):
            _pipeline(bad)
    identity = claim_transactional_id(bad)  # what the next start in this process would get
    try:
        assert identity.slot == 0, "a failed start kept its host slot"
    finally:
        identity.release()


def test_a_start_that_fails_after_the_source_is_built_gives_back_every_stage() -> None:
    # review of the house pass: the metrics port set by hand and held elsewhere failed the
    # start after the source, the staging slabs and the producer were built; none was closed
    # (the consumer stayed open, the transactional id's host slot stayed held)
    default = MetricsConfig().port
    held = _holding(default)
    consumer = FakeConsumer({})
    bad = _config(
        [TRADES],
        processing_guarantee="exactly_once",
        kafka={"bootstrap_servers": "127.0.0.1:9", "group_id": "g-assembly-late-failure"},
        metrics={"host": "127.0.0.1", "port": default},
    )
    try:
        with pytest.raises(ConfigError, match=r"metrics\.port"):
            Pipeline(bad, factory(consumer), factory(FakeProducer()))
    finally:
        if held is not None:
            held.close()
    assert consumer.closed, "the source's consumer was left open"
    identity = claim_transactional_id(bad)
    try:
        assert identity.slot == 0, "a failed start kept its host slot"
    finally:
        identity.release()


def ordered_trades() -> Workload:
    """Trades as a stateful workload would declare itself: results in per-key order."""
    workload = TradesWorkload()
    workload.ordered = True
    return workload


def test_a_workload_that_keeps_per_key_order_refuses_a_share_group_naming_the_key() -> None:
    spec = {**TRADES, "workload": "tests.unit.assembly.test_assembly:ordered_trades"}
    _pipeline(_config([spec])).close()  # a consumer group keeps the order: accepted
    with pytest.raises(ConfigError, match=r"kafka\.group_type: share is refused for pipeline 't'"):
        _pipeline(
            _config([spec], kafka={"bootstrap_servers": "127.0.0.1:9", "group_type": "share"})
        )


def test_an_idle_share_member_takes_no_more_records_and_runs_what_it_took_before_it_exits() -> None:
    # bench-share: a poll returned between a member's idle check and its drain was released at
    # the stop; the whole group exiting the same way left 13 of 960 records to no one
    consumer = FakeShareConsumer()
    consumer.polls.append([FakeShareMessage("t", 0, o, b"v") for o in range(2)])
    pipeline = Pipeline(
        _config([TRADES], kafka={"bootstrap_servers": "127.0.0.1:9", "group_type": "share"}),
        consumer,
        factory(FakeProducer()),
    )
    try:
        source = pipeline.source
        assert isinstance(source, ShareSource)
        turns = iter([False, True])
        source.poll_until(lambda: next(turns))  # the poll returned just before the idle check
        assert source.in_flight == 2
        assert not pipeline._share_member_quiet()  # asks the source to stop taking records
        turns = iter([False, True])
        source.poll_until(lambda: next(turns))  # the source takes the request between polls
        assert not source.fetching and not consumer.polls
        assert not pipeline._share_member_quiet()  # what it took must run first
        lane = pipeline.stages.topics[0].lane
        taken: list[Record] = []
        while len(taken) < 2:  # the batches of the two records, results acknowledged
            cut = lane.next_cut(threading.Event())
            assert cut is not None
            taken += cut.records
        pipeline.stages.shared.guarantee.acknowledged(taken)
        turns = iter([False, True])
        source.poll_until(lambda: next(turns))
        assert source.in_flight == 0 and pipeline._share_member_quiet()
    finally:
        pipeline.close()
