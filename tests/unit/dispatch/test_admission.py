"""Device admission across lanes (issue 22, item 7): a less urgent lane's batch is not launched
on a shared device while a more urgent lane's batch waits for it (bounded), and on a CPU it runs
with fewer intra-op threads while the more urgent lane is active."""

from __future__ import annotations

import threading

import pytest
import torch

from streamproc.device.gate import Admitted
from streamproc.device.intra_op import IntraOpThreads
from streamproc.dispatch.admission import AdmissionPolicy, DeviceAdmission
from streamproc.records import Priority
from tests.support.kafka_fakes import FakeClock
from tests.support.waiting import wait_until

HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW


# -- the rule --------------------------------------------------------------------------------
def test_a_more_urgent_pending_batch_blocks_less_urgent_launches_on_its_device_only() -> None:
    policy = AdmissionPolicy(active_s=1.0)
    policy.announce("cpu", NORMAL, 0.0)
    assert policy.blocked("cpu", LOW)
    assert not policy.blocked("cpu", NORMAL)  # the same class never waits for itself
    assert not policy.blocked("cpu", HIGH)  # a more urgent class never waits for a less urgent
    assert not policy.blocked("cuda:0", LOW)  # another device is not shared
    policy.announce("cpu", HIGH, 0.0)
    assert policy.blocked("cpu", NORMAL) and policy.blocked("cpu", LOW)
    policy.finish("cpu", HIGH, 0.1)
    assert not policy.blocked("cpu", NORMAL) and policy.blocked("cpu", LOW)
    policy.finish("cpu", NORMAL, 0.2)
    assert not policy.blocked("cpu", LOW)
    assert policy.pending("cpu") == {}
    with pytest.raises(ValueError, match="finish without announce"):
        policy.finish("cpu", HIGH, 0.3)


def test_less_urgent_calls_yield_threads_while_a_more_urgent_class_was_active_recently() -> None:
    policy = AdmissionPolicy(active_s=1.0)
    assert not policy.yields("cpu", LOW, 0.0)  # nothing more urgent ever ran
    policy.announce("cpu", HIGH, 10.0)
    assert policy.yields("cpu", LOW, 10.0) and policy.yields("cpu", NORMAL, 10.0)
    assert not policy.yields("cpu", HIGH, 10.0)
    assert policy.yields("cpu", LOW, 50.0)  # still pending: active however long it takes
    policy.finish("cpu", HIGH, 50.0)
    assert policy.yields("cpu", LOW, 51.0)  # within active_s of its last batch
    assert not policy.yields("cpu", LOW, 51.5)  # the high-priority lane went quiet
    assert not policy.yields("cuda:0", LOW, 50.0)


def test_admit_waits_until_the_more_urgent_batch_left_the_device() -> None:
    admission = DeviceAdmission(max_defer_s=60.0, clock=FakeClock())
    admission.announce("cpu", HIGH)
    got: list[Admitted] = []
    low = threading.Thread(target=lambda: got.append(admission.admit("cpu", LOW)))
    low.start()
    try:
        wait_until(lambda: admission.waiting("cpu") == 1, "the low-priority launch to wait")
        assert not got  # not admitted while the high-priority batch is pending
        assert admission.admit("cpu", HIGH).deferred_s == 0.0  # high never waits for low
        admission.finish("cpu", HIGH)
        low.join(60)
        assert not low.is_alive() and len(got) == 1
        assert got[0].deferred_s > 0 and got[0].yield_threads  # HIGH pended just now
        assert admission.waiting("cpu") == 0
    finally:
        if low.is_alive():
            admission.finish("cpu", HIGH)
            low.join(60)


def test_admit_waits_at_most_max_defer_so_a_continuous_high_stream_never_starves_low() -> None:
    admission = DeviceAdmission(max_defer_s=0.05)
    admission.announce("cpu", HIGH)  # never finished
    admitted = admission.admit("cpu", LOW)
    assert 0.05 <= admitted.deferred_s < 30.0
    assert admission.pending("cpu") == {HIGH: 1}


# -- the intra-op threads of one thread ------------------------------------------------------
def test_intra_op_threads_are_capped_on_the_calling_thread_only() -> None:
    default = torch.get_num_threads()
    seen: dict[str, int] = {}

    def low_thread() -> None:
        threads = IntraOpThreads()
        seen["yielding"] = threads.use(True)
        seen["torch while yielding"] = torch.get_num_threads()
        ready.set()
        assert other_done.wait(60)
        seen["back"] = threads.use(False)
        seen["torch back"] = torch.get_num_threads()

    def other_thread() -> None:
        seen["other"] = torch.get_num_threads()

    ready, other_done = threading.Event(), threading.Event()
    low = threading.Thread(target=low_thread)
    low.start()
    assert ready.wait(60)
    other = threading.Thread(target=other_thread)
    other.start()
    other.join(60)
    other_done.set()
    low.join(60)
    half = max(1, default // 2)
    assert seen == {
        "yielding": half,
        "torch while yielding": half,
        "other": default,  # a thread started meanwhile keeps the process's count
        "back": default,
        "torch back": default,
    }
    assert torch.get_num_threads() == default
