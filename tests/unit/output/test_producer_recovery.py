"""A transactional producer that cannot go on (exactly-once), over the fakes: a call
that never returns, a fatal error from ``poll``, an abort that fails.

librdkafka 2.16 can wait forever in ``send_offsets_to_transaction`` for a group coordinator that
is gone (confluentinc/librdkafka#5456, #5511). tests/faults saw it with the broker that led an
input partition and coordinated the group killed for 20 s: the source thread stayed in that
call, and nothing progressed for 8 minutes after the broker was back. The pipeline must replace
the producer (the fresh one's ``init_transactions`` fences the wedged one), abort, rewind and go
on; without a way to replace it, stop with an error naming the call.

With two of three brokers down for 60 s, an abort during the transaction coordinator's failover
left the producer in a fatal state (``INVALID_TXN_STATE``, raised from ``poll`` on the sink's
thread) and the process exited 1. A fatal error that is not about who owns the
``transactional.id`` is the producer's own: a fresh one replaces it. A fenced producer (another
instance took the id over) still stops: a fresh one would fence the rightful owner.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import KafkaTopicPartition
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import ExactlyOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import WEDGED, Transactions
from streamproc.output.headers import source_headers
from streamproc.output.producer import ResultsProducer
from streamproc.output.sink import Sink
from streamproc.output.window import AckWindow
from streamproc.records import Record
from tests.support.kafka_fakes import FakeConsumer, FakeProducer, factory, kafka_error
from tests.unit.source_harness import TP, consume_again

BOUND_S = 30.0  # the test's own bound on a commit (old code: it never returned)


@dataclass
class WedgingProducer(FakeProducer):
    """``send_offsets_to_transaction`` blocks until :attr:`release` is set (never, unless the
    test ends)."""

    release: threading.Event = field(default_factory=threading.Event)

    def send_offsets_to_transaction(
        self, positions: list[KafkaTopicPartition], group_metadata: Any, timeout: float = -1
    ) -> None:
        self._call("send_offsets_to_transaction")
        self.release.wait()


@dataclass
class FailingPoll(FakeProducer):
    """``poll`` raises ``error`` (fatal) once; the next ``poll`` sets :attr:`handled`."""

    error: KafkaError | None = None
    handled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def poll(self, timeout: float = -1) -> int:
        if self.error is not None:
            error, self.error = self.error, None
            raise KafkaException(error)
        self.handled.set()
        return 0


class Pipeline:
    """An exactly-once sink over a producer that fails (wedges, unless another is given); a
    fresh fake replaces it."""

    def __init__(self, n: int, renew: bool = True, producer: FakeProducer | None = None) -> None:
        self.tracker = OffsetTracker()
        self.metrics = Metrics()
        self.wedging = producer if producer is not None else WedgingProducer()
        self.fresh = FakeProducer()
        self.fatal: list[BaseException] = []
        results = ResultsProducer(
            self.wedging, {}, self.metrics, self.fatal.append, factory(self.fresh)
        )
        transactions = Transactions(
            self.wedging,
            timeout_s=0.05,
            grace_s=0.05,
            renew=results.renew if renew else None,
        )
        self.guarantee = ExactlyOnce(self.tracker, self.metrics, transactions)
        self.sink = Sink(results, self.guarantee, self.metrics, self.fatal.append)
        self.consumer = FakeConsumer({})
        self.n = n

    def consume(self) -> list[Record]:
        return consume_again(self.tracker, self.n)

    def send(self, records: list[Record], settle: Callable[[], None] | None = None) -> None:
        values = [b"r%d" % r.offset for r in records]
        self.sink.send_results(
            "out",
            records,
            values,
            [list(source_headers(r)) for r in records],
            "in.dlq",
            settle=settle,
        )

    def commit(self) -> bool:
        """The source thread's commit, bounded by the test (old code never returned)."""
        outcome: list[bool | BaseException] = []

        def run() -> None:
            try:
                outcome.append(self.guarantee.committer.commit(self.consumer, synchronous=True))
            except BaseException as exc:  # handed to the test
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(BOUND_S)
        assert outcome, f"the commit did not return in {BOUND_S:.0f} s"
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})


def test_a_wedged_commit_replaces_the_producer_aborts_and_the_rewound_work_commits() -> None:
    h = Pipeline(4)
    try:
        h.send(h.consume())
        assert len(h.wedging.pending) == 4  # in the wedged producer's transaction
        assert h.commit() is False  # judged wedged: aborted, the caller rewinds
        assert h.fresh.calls == ["init_transactions"]  # fences the wedged one, aborts its txn
        assert h.sample("streamproc_transaction_aborts_total", {"reason": WEDGED}) == 1
        assert h.sample("streamproc_producer_renewals_total") == 1
        # the aborted work is retired: a late result of it is not produced anywhere
        h.send(h.consume())  # the rewind: the same inputs, a fresh generation
        assert [p.value for p in h.fresh.pending] == [b"r0", b"r1", b"r2", b"r3"]
        assert len(h.wedging.pending) == 4  # nothing more went to the wedged producer
        assert h.commit() is True
        assert h.fresh.calls[-2:] == ["send_offsets_to_transaction", "commit_transaction"]
        assert h.tracker.watermarks([TP]) == {TP: 4}
        assert not h.fatal
    finally:
        h.wedging.release.set()


def test_a_replaced_producer_forgets_the_lanes_unacknowledged_inputs() -> None:
    """The wedged producer is never polled again: its records never get a report. Before the
    sink told the lane's acknowledgement window, their bytes stayed counted for ever, and a few
    renewals' worth stopped the lane (its results waiting for acknowledgements that never
    come)."""
    h = Pipeline(4)
    metrics = Metrics()
    window = AckWindow(
        100, metrics.unacknowledged_bytes.labels("in"), metrics.unacknowledged_wait.labels("in")
    )
    h.sink.watch_window(window)
    try:
        records = h.consume()
        h.send(records, window.hold(sum(r.size_bytes for r in records)))
        assert window.held_bytes == sum(r.size_bytes for r in records) > 0
        assert h.commit() is False  # wedged: replaced, aborted
        assert window.held_bytes == 0
        records = h.consume()  # the rewind's results are counted afresh
        h.send(records, window.hold(sum(r.size_bytes for r in records)))
        h.fresh.deliver()
        assert window.held_bytes == 0
    finally:
        h.wedging.release.set()


def test_a_wedged_commit_without_a_replacement_stops_naming_the_call() -> None:
    h = Pipeline(2, renew=False)
    try:
        h.send(h.consume())
        with pytest.raises(FatalPipelineError, match="send_offsets_to_transaction"):
            h.commit()
    finally:
        h.wedging.release.set()


def test_a_fatal_error_from_poll_replaces_the_producer_and_the_pipeline_goes_on() -> None:
    failing = FailingPoll(error=kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True))
    h = Pipeline(3, producer=failing)
    h.send(h.consume())
    h.sink.start()
    try:
        assert failing.handled.wait(BOUND_S)  # the sink's thread polled past the error
        assert h.guarantee.failed() and not h.fatal  # noted, not a reason to stop
        assert h.commit() is False  # replaced, aborted: the caller rewinds
        assert h.fresh.calls == ["init_transactions"]
        reason = {"reason": "INVALID_TXN_STATE"}
        assert h.sample("streamproc_transaction_aborts_total", reason) == 1
        assert h.sample("streamproc_producer_renewals_total") == 1
        h.send(h.consume())
        assert h.commit() is True
        assert [p.value for p in h.fresh.pending + h.fresh.delivered] == [b"r0", b"r1", b"r2"]
        assert h.tracker.watermarks([TP]) == {TP: 3}
    finally:
        h.sink.close(1.0)
    assert not h.fatal


def test_an_abort_that_fails_fatally_replaces_the_producer() -> None:
    failing = FakeProducer()
    failing.fail_next(
        "commit_transaction", kafka_error(KafkaError._TIMED_OUT, txn_requires_abort=True)
    )
    failing.fail_next("abort_transaction", kafka_error(KafkaError.INVALID_TXN_STATE, fatal=True))
    h = Pipeline(2, producer=failing)
    h.send(h.consume())
    assert h.commit() is False
    assert failing.calls[-2:] == ["commit_transaction", "abort_transaction"]
    assert h.fresh.calls == ["init_transactions"]
    h.send(h.consume())
    assert h.commit() is True and h.tracker.watermarks([TP]) == {TP: 2}


def test_a_fenced_producer_still_stops_and_is_not_replaced() -> None:
    fenced = FakeProducer()
    fenced.fail_next("commit_transaction", kafka_error(KafkaError.PRODUCER_FENCED, fatal=True))
    h = Pipeline(2, producer=fenced)
    h.send(h.consume())
    with pytest.raises(FatalPipelineError, match="fenced"):
        h.commit()
    assert h.fresh.calls == []  # a fresh producer would fence the rightful owner


@dataclass
class RaisingPoll(FakeProducer):
    """``poll`` re-raises what a delivery callback raised, as confluent-kafka does."""

    def poll(self, timeout: float = -1) -> int:
        raise RuntimeError("a delivery callback failed")


def test_a_delivery_callback_that_raises_stops_the_pipeline_instead_of_the_reports() -> None:
    """Only the ``sink`` thread serves delivery reports once results wait for them (the
    acknowledgement window). A callback error used to end that thread silently: every lane
    then waited for acknowledgements for ever, ready and never idle."""
    fatal: list[BaseException] = []
    results = ResultsProducer(RaisingPoll(), {}, Metrics(), fatal.append, factory(FakeProducer()))
    results.start(lambda err: False)
    results._thread.join(BOUND_S)
    assert not results._thread.is_alive()
    assert [str(exc) for exc in fatal] == ["a delivery callback failed"]
