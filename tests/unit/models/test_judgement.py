"""Probation and shadow judgements (pure)."""

from __future__ import annotations

from streamproc.config.sections import RollbackConfig, ShadowConfig
from streamproc.models.judgement import Probation, RecentTimes, ShadowRecord, p99


def test_p99_interpolates_and_is_zero_when_empty() -> None:
    assert p99([]) == 0.0
    assert abs(p99([1.0] * 99 + [101.0]) - 2.0) < 1e-9  # linear interpolation at 0.99 * 99


def test_errors_roll_back_only_after_min_batches_and_above_the_share() -> None:
    probation = Probation(RollbackConfig(min_batches=4, max_error_share=0.25), 0.0)
    assert [probation.observe(0.01, raised) for raised in (True, False, False)] == [None] * 3
    assert probation.observe(0.01, False) is None  # 1 of 4 = 0.25: not above
    assert probation.observe(0.01, True) == "errors"  # 2 of 5


def test_latency_is_judged_on_enough_batches_against_the_baseline() -> None:
    rules = RollbackConfig(min_batches=2, latency_min_batches=5, max_p99_ratio=3.0)
    slow = Probation(rules, baseline_p99_s=0.010)
    verdicts = [slow.observe(0.050, False) for _ in range(5)]
    assert verdicts == [None, None, None, None, "latency"]  # one slow batch alone decides nothing
    fine = Probation(rules, baseline_p99_s=0.010)
    assert all(fine.observe(0.025, False) is None for _ in range(20))
    unknown = Probation(rules, baseline_p99_s=0.0)  # no baseline: latency never judged
    assert all(unknown.observe(10.0, False) is None for _ in range(20))


def test_probation_passes_after_the_window() -> None:
    probation = Probation(RollbackConfig(window_batches=3, min_batches=1), 0.0)
    for _ in range(2):
        probation.observe(0.01, False)
    assert not probation.passed
    probation.observe(0.01, False)
    assert probation.passed


def test_recent_times_need_enough_batches_for_a_p99() -> None:
    recent = RecentTimes(3)
    recent.add(1.0)
    assert recent.p99(at_least=3) == 0.0
    for value in (2.0, 3.0, 4.0):  # the oldest goes
        recent.add(value)
    assert len(recent) == 3 and 3.9 < recent.p99(at_least=3) <= 4.0


def test_shadow_promotion_waits_for_batches_agreement_and_latency() -> None:
    rules = ShadowConfig(
        promote_after_batches=3, promote_min_agreement=0.9, promote_max_latency_ratio=2.0
    )
    record = ShadowRecord(rules)
    for _ in range(2):
        record.observe(10, 10, 0.01, 0.015, error=False)
    assert not record.ready()  # too few batches
    record.observe(10, 10, 0.01, 0.015, error=False)
    assert record.ready() and record.agreement == 1.0 and 1.4 < record.latency_ratio < 1.6
    slow = ShadowRecord(rules)
    for _ in range(3):
        slow.observe(10, 10, 0.01, 0.05, error=False)
    assert not slow.ready()  # latency ratio 5
    disagreeing = ShadowRecord(rules)
    for _ in range(3):
        disagreeing.observe(10, 8, 0.01, 0.01, error=False)
    assert not disagreeing.ready() and disagreeing.agreement == 0.8
    failing = ShadowRecord(rules)
    for error in (False, True, False, False):
        failing.observe(10, 0 if error else 10, 0.01, 0.01, error=error)
    assert not failing.ready()  # it raised once
    manual = ShadowRecord(ShadowConfig())
    for _ in range(50):
        manual.observe(10, 10, 0.01, 0.01, error=False)
    assert not manual.ready()  # no promote_after_batches: only the operator promotes
