"""A pipeline's resident versions: the switch at a batch boundary, probation and rollback,
shadow promotion, at most two resident, the transaction boundary."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from streamproc.config.sections import ModelConfig
from streamproc.device.binding import ShadowOutcome
from streamproc.device.jobs import DeviceJob, DeviceResult
from streamproc.metrics import Metrics
from streamproc.models.loading import LoadedVersion, VersionRefused
from streamproc.models.versions import ModelVersions
from streamproc.records import Batch, Record, TopicPartition

TOPIC = "iot"


def version(name: str, devices: int = 1) -> LoadedVersion:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    return LoadedVersion(name, tuple(fn for _ in range(devices)))


def config(**overrides: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {"name": "iot", "repository": "/models", "poll_interval_s": 0, **overrides}
    )


def job(batch_id: int) -> DeviceJob:
    record = Record(TopicPartition(TOPIC, 0), batch_id, None, b"x", (), 0, 0.0)
    return DeviceJob(Batch(batch_id, (record,), 0.0), slab=None)  # type: ignore[arg-type]


def result(
    name: str,
    raised: bool = False,
    seconds: float = 0.01,
    shadow: ShadowOutcome | None = None,
    bound: str | None = None,
) -> DeviceResult:
    """A batch's result made by ``name``, bound to ``bound`` (default: ``name``)."""
    return DeviceResult(
        job(1).batch,
        (np.zeros(1),),
        {},
        None,
        seconds,
        version=name,
        bound_version=bound or name,
        raised=raised,
        shadow=shadow,
    )


def metric(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"topic": TOPIC, **labels}) or 0.0


def bound(versions: ModelVersions, batch_id: int = 1, device: int = 0) -> DeviceJob:
    made = job(batch_id)
    versions.bind(made, device)
    return made


def test_a_pending_version_serves_from_the_next_batch_and_its_predecessor_is_the_fallback() -> None:
    metrics = Metrics()
    versions = ModelVersions(TOPIC, version("1"), config(), metrics)
    before = bound(versions, 1)
    versions.offer(version("2"), "swap", "new")
    assert before.binding is not None and before.binding.version == "1"  # bound before: stays
    after = bound(versions, 2)
    assert after.binding is not None and after.binding.version == "2"
    assert after.binding.fallback is not None and after.binding.fallback.version == "1"
    assert versions.resident() == ("2", "1")
    assert metric(metrics, "streamproc_model_swaps_total", reason="new") == 1
    assert metric(metrics, "streamproc_model_serving", version="2") == 1
    assert metric(metrics, "streamproc_model_serving", version="1") == 0


def test_at_most_two_versions_resident() -> None:
    versions = ModelVersions(TOPIC, version("1"), config(), Metrics())
    versions.offer(version("2"), "swap", "new")
    with pytest.raises(VersionRefused) as pending:
        versions.offer(version("3"), "swap", "new")
    assert pending.value.reason == "busy"
    assert "at most two versions are resident; 2 waits for the next batch" in str(pending.value)
    bound(versions)  # switched: 2 serves, 1 in probation
    with pytest.raises(VersionRefused, match="in probation"):
        versions.check_room("3")


def test_errors_in_probation_roll_back_at_the_next_boundary() -> None:
    metrics = Metrics()
    rules = {"min_batches": 2, "max_error_share": 0.4, "window_batches": 10}
    versions = ModelVersions(TOPIC, version("1"), config(rollback=rules), metrics)
    versions.offer(version("2"), "swap", "operator")
    bound(versions, 1)
    assert versions.observe(result("2")) == "2"
    # 2 raised; 1 made the results
    assert versions.observe(result("1", raised=True, bound="2")) == "1"
    assert versions.serving == "2"  # the switch back waits for the next batch
    assert bound(versions, 2).binding.version == "1"  # type: ignore[union-attr]
    assert versions.serving == "1" and versions.resident() == ("1",)
    assert "2" in versions.refused
    assert metric(metrics, "streamproc_model_rollbacks_total", reason="errors") == 1
    assert metric(metrics, "streamproc_model_fallback_batches_total", version="1") == 1
    assert [e.kind for e in versions.events][-2:] == ["rolled_back", "switched"]


def test_probation_passed_lets_the_predecessor_go() -> None:
    rules = {"min_batches": 1, "window_batches": 3}
    versions = ModelVersions(TOPIC, version("1"), config(rollback=rules), Metrics())
    versions.offer(version("2"), "swap", "new")
    bound(versions)
    for _ in range(3):
        versions.observe(result("2"))
    assert versions.resident() == ("2",)
    binding = bound(versions, 2).binding
    assert binding is not None and binding.fallback is None
    versions.offer(version("3"), "swap", "new")  # room again


def test_the_operator_rolls_back_to_the_predecessor_or_promotes_the_candidate() -> None:
    versions = ModelVersions(TOPIC, version("1"), config(), Metrics())
    versions.offer(version("2"), "swap", "operator")
    bound(versions)
    assert versions.use("1") == "rolled_back"
    bound(versions, 2)
    assert versions.serving == "1" and "2" in versions.refused
    assert versions.use("1") == "serving"
    versions.offer(version("3"), "shadow", "new")
    assert versions.use("3") == "promoted"
    bound(versions, 3)
    assert versions.serving == "3"
    with pytest.raises(VersionRefused, match="3 is in probation"):
        versions.use("4")  # not resident, and no room to load it


def test_shadow_binds_a_sample_and_promotes_on_its_record() -> None:
    metrics = Metrics()
    cfg = config(shadow={"sample": 0.5, "promote_after_batches": 2})
    versions = ModelVersions(TOPIC, version("1"), cfg, metrics, rng=random.Random(7))
    versions.offer(version("2"), "shadow", "new")
    shadowed = [bound(versions, i).binding for i in range(1, 201)]
    share = sum(b is not None and b.shadow is not None for b in shadowed) / len(shadowed)
    assert 0.35 < share < 0.65
    assert all(b is not None and b.version == "1" for b in shadowed)
    outcome = ShadowOutcome("2", rows=10, agreed=10, serving_s=0.01, shadow_s=0.012)
    versions.observe(result("1", shadow=outcome))
    versions.observe(result("1", shadow=outcome))
    assert metric(metrics, "streamproc_shadow_agreement_ratio", version="2") == 1.0
    assert metric(metrics, "streamproc_shadow_batches_total", version="2") == 2
    bound(versions, 300)
    assert versions.serving == "2"
    assert metric(metrics, "streamproc_model_swaps_total", reason="promoted") == 1


def test_the_transaction_boundary_is_asked_for_where_the_version_changes() -> None:
    asked: list[str] = []
    versions = ModelVersions(
        TOPIC, version("1"), config(), Metrics(), boundary=lambda: asked.append("boundary")
    )
    versions.observe(result("1"))
    versions.observe(result("1"))
    assert asked == []
    versions.observe(result("2"))
    assert asked == ["boundary"]
    versions.observe(result("2"))
    assert asked == ["boundary"]


def test_a_refusal_is_remembered_counted_and_logged() -> None:
    metrics = Metrics()
    versions = ModelVersions(TOPIC, version("1"), config(), metrics)
    versions.refuse("5", VersionRefused("warmup", "raised on zeros"))
    assert "5" in versions.refused
    refused = "streamproc_model_refused_versions_total"
    assert metric(metrics, refused, reason="warmup", attempt="first") == 1
    assert versions.state()["events"][-1]["kind"] == "refused"
    versions.refuse("5", VersionRefused("warmup", "raised on zeros again"), attempt=2)
    assert metric(metrics, refused, reason="warmup", attempt="retry") == 1
    assert versions.state()["events"][-1]["detail"] == "warmup (try 2): raised on zeros again"


def test_a_slower_version_is_rolled_back_on_its_p99_against_its_predecessors() -> None:
    metrics = Metrics()
    rules = {"min_batches": 5, "latency_min_batches": 20, "window_batches": 100}
    versions = ModelVersions(TOPIC, version("1"), config(rollback=rules), metrics)
    for _ in range(20):  # the baseline: version 1's last 20 batches, 10 ms each
        versions.observe(result("1", seconds=0.010))
    versions.offer(version("2"), "swap", "new")
    bound(versions)
    for _ in range(19):
        versions.observe(result("2", seconds=0.040))  # 4x slower: judged from the 20th batch
    assert versions.state()["pending"] is None
    versions.observe(result("2", seconds=0.040))
    assert versions.state()["pending"] == "1"
    assert metric(metrics, "streamproc_model_rollbacks_total", reason="latency") == 1
    assert "P99 40000.0 us per row against 10000.0 us before" in versions.events[-1].detail


def test_larger_batches_after_a_switch_are_not_taken_for_a_slower_version() -> None:
    rules = {"min_batches": 5, "latency_min_batches": 20, "window_batches": 100}
    versions = ModelVersions(TOPIC, version("1"), config(rollback=rules), Metrics())
    for _ in range(20):  # a quiet spell: one-row batches, 10 ms
        versions.observe(result("1", seconds=0.010))
    versions.offer(version("2"), "swap", "new")
    bound(versions)
    records = tuple(Record(TopicPartition(TOPIC, 0), i, None, b"x", (), 0, 0.0) for i in range(8))
    burst = DeviceResult(
        Batch(2, records, 0.0), (np.zeros(8),), {}, None, 0.040, version="2", bound_version="2"
    )
    for _ in range(40):  # a catch-up burst: 8-row batches, 40 ms (5 ms per row)
        versions.observe(burst)
    assert versions.state()["pending"] is None and versions.serving == "2"


def served_well_then_succeeded_by_2(metrics: Metrics) -> ModelVersions:
    """Version 1 served batches, version 2 took over and passed its probation (1 let go)."""
    rules = {"window_batches": 2, "min_batches": 1, "latency_min_batches": 1}
    versions = ModelVersions(TOPIC, version("1"), config(rollback=rules), metrics)
    bound(versions, 1)
    versions.observe(result("1"))
    versions.offer(version("2"), "swap", "new")
    bound(versions, 2)
    for _ in range(2):
        versions.observe(result("2"))
    assert versions.resident() == ("2",)  # probation passed: 1 is no longer resident
    return versions


def test_a_version_judged_broken_after_its_probation_names_the_one_that_served_well() -> None:
    metrics = Metrics()
    versions = served_well_then_succeeded_by_2(metrics)
    assert versions.judged_broken("2") == "1"  # to reload from the source
    assert "2" in versions.refused  # polling never loads it again
    assert metric(metrics, "streamproc_model_rollbacks_total", reason="broken") == 1
    assert versions.state()["events"][-1]["kind"] == "rolled_back"
    assert versions.judged_broken("2") is None  # told again (a later held batch): once only
    assert metric(metrics, "streamproc_model_rollbacks_total", reason="broken") == 1


def test_a_held_batch_is_rebound_to_the_restored_version_at_once() -> None:
    metrics = Metrics()
    versions = served_well_then_succeeded_by_2(metrics)
    held = bound(versions, 3)
    versions.judged_broken("2")
    versions.offer(version("1"), "swap", "rollback")  # the model thread reloaded it
    versions.rebind(held, 0)
    assert held.binding is not None and held.binding.version == "1"
    assert held.binding.fallback is None  # it served well: no probation
    assert versions.state()["serving"] == "1" and versions.state()["probation"] is None


def test_a_broken_start_up_version_has_nothing_to_roll_back_to() -> None:
    metrics = Metrics()
    versions = ModelVersions(TOPIC, version("1"), config(), metrics)
    bound(versions, 1)
    versions.observe(result("1"))
    assert versions.judged_broken("1") is None
    assert versions.state()["serving"] == "1"
    assert metric(metrics, "streamproc_model_rollbacks_total", reason="broken") == 0
