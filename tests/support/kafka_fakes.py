"""Fakes of the Kafka clients and the clock, for unit tests of streamproc's own logic.

They implement the protocols of ``kafka.protocols`` with in-memory state and record every call,
so seek-back, rewind, commit retries, revokes with in-flight batches and late results are
testable without a broker. They are not a broker: no replication, no fetch sessions, no
transactions on the broker side. Integration tests always run against a real Apache Kafka broker.

Example::

    consumer = FakeConsumer({TopicPartition("in", 0): [b"a", b"b"]})
    source = Source(config, lanes, tracker, guarantee, metrics, on_fatal, lambda _: consumer)
    consumer.schedule_assign([TopicPartition("in", 0)])
    source.poll_until(lambda: consumer.delivered >= 2)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from streamproc.kafka.protocols import (
    ConsumerClient,
    DeliveryCallback,
    ProducerClient,
    RebalanceCallback,
)
from streamproc.records import TopicPartition

GROUP_METADATA = "fake-group-metadata"
"""What :meth:`FakeConsumer.consumer_group_metadata` returns."""


class FakeClock:
    """A monotonic clock in seconds that moves only when told to."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@dataclass
class FakeMessage:
    """A consumed message (the ``confluent_kafka.Message`` accessors streamproc calls)."""

    _topic: str
    _partition: int
    _offset: int
    _value: bytes | None
    _key: bytes | None = None
    _headers: list[tuple[str, bytes]] | None = None
    _timestamp_ms: int = 0
    _error: KafkaError | None = None

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, self._timestamp_ms)  # TIMESTAMP_CREATE_TIME


@dataclass
class FakeShareMessage(FakeMessage):
    """A message acquired from a share group (it also says how often it was delivered)."""

    _delivery_count: int = 1

    def delivery_count(self) -> int:
        return self._delivery_count


def _ours(part: KafkaTopicPartition) -> TopicPartition:
    return TopicPartition(part.topic, part.partition)


@dataclass
class FakeConsumer:
    """An in-memory consumer over fixed partition logs.

    Args:
        logs: per partition, the values at offsets 0, 1, 2, ...
        markers: per partition, offsets that hold no message (transaction markers, aborted
            records under read_committed): never delivered, but the position moves past them.

    :meth:`position` reports none (-1001) for a partition read nothing since its assignment or
    its last seek, as librdkafka does (measured: an ``incremental_assign`` or a ``seek``
    resets it before returning); :attr:`stale_positions` makes it report an old position
    there instead (a client that kept one).

    Rebalances are scripted: :meth:`schedule_assign`, :meth:`schedule_revoke` and
    :meth:`schedule_lost` queue a callback that the next :meth:`consume` runs first, on the
    caller's thread, as librdkafka does. Commits go to :attr:`committed_offsets`;
    :attr:`commit_errors` makes the next commits raise, :attr:`committed_errors` the next
    reads of the committed offsets.
    """

    logs: Mapping[TopicPartition, Sequence[bytes | None]]
    markers: Mapping[TopicPartition, frozenset[int]] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    committed_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    commit_errors: deque[KafkaError] = field(default_factory=deque)
    committed_errors: deque[KafkaError] = field(default_factory=deque)
    positions: dict[TopicPartition, int] = field(default_factory=dict)
    stale_positions: dict[TopicPartition, int] = field(default_factory=dict)
    unread: set[TopicPartition] = field(default_factory=set)
    paused: set[TopicPartition] = field(default_factory=set)
    delivered: int = 0
    closed: bool = False
    _callbacks: dict[str, RebalanceCallback] = field(default_factory=dict)
    _events: deque[tuple[str, list[TopicPartition]]] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- scripting -------------------------------------------------------------------------
    def schedule_assign(self, tps: Iterable[TopicPartition]) -> None:
        self._events.append(("assign", list(tps)))

    def schedule_revoke(self, tps: Iterable[TopicPartition]) -> None:
        self._events.append(("revoke", list(tps)))

    def schedule_lost(self, tps: Iterable[TopicPartition]) -> None:
        self._events.append(("lost", list(tps)))

    def calls_named(self, name: str) -> list[Any]:
        """The arguments of every call of ``name``, in order."""
        return [args for called, args in self.calls if called == name]

    # -- the consumer protocol -------------------------------------------------------------
    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
    ) -> None:
        self.calls.append(("subscribe", list(topics)))
        for name, callback in (("assign", on_assign), ("revoke", on_revoke), ("lost", on_lost)):
            if callback is not None:
                self._callbacks[name] = callback

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        while self._events:
            name, tps = self._events.popleft()
            parts = [KafkaTopicPartition(tp.topic, tp.partition) for tp in tps]
            self._callbacks[name](self, parts)
        out: list[FakeMessage] = []
        with self._lock:
            for tp, position in sorted(self.positions.items()):
                if tp in self.paused:
                    continue
                log = self.logs.get(tp, ())
                markers = self.markers.get(tp, frozenset())
                while position < len(log) and len(out) < num_messages:
                    if position not in markers:
                        out.append(FakeMessage(tp.topic, tp.partition, position, log[position]))
                    position += 1
                while position in markers:  # librdkafka reads a trailing marker too
                    position += 1
                if position != self.positions[tp]:
                    self.unread.discard(tp)
                self.positions[tp] = position
        self.delivered += len(out)
        return out

    def pause(self, partitions: list[KafkaTopicPartition]) -> None:
        self.calls.append(("pause", [_ours(p) for p in partitions]))
        self.paused.update(_ours(p) for p in partitions)

    def resume(self, partitions: list[KafkaTopicPartition]) -> None:
        self.calls.append(("resume", [_ours(p) for p in partitions]))
        self.paused.difference_update(_ours(p) for p in partitions)

    def seek(self, partition: KafkaTopicPartition) -> None:
        tp = _ours(partition)
        self.calls.append(("seek", (tp, partition.offset)))
        with self._lock:
            offset = partition.offset
            if offset < 0:  # OFFSET_BEGINNING / OFFSET_END
                offset = 0 if offset == -2 else len(self.logs.get(tp, ()))
            self.positions[tp] = offset
            self.unread.add(tp)

    @overload
    def commit(
        self, *, offsets: list[KafkaTopicPartition], asynchronous: Literal[True] = ...
    ) -> None: ...
    @overload
    def commit(
        self, *, offsets: list[KafkaTopicPartition], asynchronous: Literal[False]
    ) -> list[KafkaTopicPartition]: ...
    def commit(
        self, *, offsets: list[KafkaTopicPartition], asynchronous: bool = True
    ) -> list[KafkaTopicPartition] | None:
        committed = {_ours(p): p.offset for p in offsets}
        self.calls.append(("commit", committed))
        if self.commit_errors:
            raise KafkaException(self.commit_errors.popleft())
        self.committed_offsets.update(committed)
        if asynchronous:
            return None
        return [KafkaTopicPartition(tp.topic, tp.partition, o) for tp, o in committed.items()]

    def position(self, partitions: list[KafkaTopicPartition]) -> list[KafkaTopicPartition]:
        with self._lock:
            return [
                KafkaTopicPartition(p.topic, p.partition, self._position(_ours(p)))
                for p in partitions
            ]

    def _position(self, tp: TopicPartition) -> int:
        if tp in self.unread:
            return self.stale_positions.get(tp, -1001)
        return self.positions.get(tp, -1001)

    def committed(
        self, partitions: list[KafkaTopicPartition], timeout: float = -1
    ) -> list[KafkaTopicPartition]:
        self.calls.append(("committed", [_ours(p) for p in partitions]))
        if self.committed_errors:
            raise KafkaException(self.committed_errors.popleft())
        return [
            KafkaTopicPartition(p.topic, p.partition, self.committed_offsets.get(_ours(p), -1001))
            for p in partitions
        ]

    def consumer_group_metadata(self) -> str:
        return GROUP_METADATA

    def incremental_assign(self, partitions: list[KafkaTopicPartition]) -> None:
        self.calls.append(("incremental_assign", [_ours(p) for p in partitions]))
        with self._lock:
            for part in partitions:
                tp = _ours(part)
                self.positions[tp] = self.committed_offsets.get(tp, 0)
                self.unread.add(tp)

    def incremental_unassign(self, partitions: list[KafkaTopicPartition]) -> None:
        self.calls.append(("incremental_unassign", [_ours(p) for p in partitions]))
        with self._lock:
            for part in partitions:
                self.positions.pop(_ours(part), None)
                self.paused.discard(_ours(part))
                self.unread.discard(_ours(part))

    def close(self) -> None:
        self.closed = True


@dataclass
class Produced:
    """One record a :class:`FakeProducer` took."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    on_delivery: DeliveryCallback | None

    def report(self, error: KafkaError | None = None) -> None:
        """Call its delivery callback as librdkafka would: with a :class:`DeliveryReport`."""
        if self.on_delivery is not None:
            self.on_delivery(error, DeliveryReport(self, error))


@dataclass(frozen=True)
class DeliveryReport:
    """The message a delivery report carries (confluent-kafka's ``Message`` methods): topic,
    key and value always; headers only on success (a failed report from the real client has
    none, measured against the broker)."""

    produced: Produced
    failure: KafkaError | None

    def topic(self) -> str:
        return self.produced.topic

    def key(self) -> bytes | None:
        return self.produced.key

    def value(self) -> bytes | None:
        return self.produced.value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return None if self.failure is not None else self.produced.headers

    def error(self) -> KafkaError | None:
        return self.failure


@dataclass
class FakeProducer:
    """An in-memory producer: records wait in :attr:`pending` until the test delivers them.

    :meth:`deliver` (or :meth:`flush`) reports them; ``errors`` on a transactional method name
    (``"commit_transaction"``, ``"send_offsets_to_transaction"``, ...) makes its next calls
    raise those errors in order. ``judge``, when set, is the broker's verdict on each record
    reported without an explicit error (None: accepted; e.g. refuse values over a size).
    Inside a transaction a failed delivery puts it in librdkafka's abortable state: later
    produces raise ``_STATE`` and the commit raises the delivery's error (``txn_requires_abort``)
    until the transaction aborts. Every call is recorded in :attr:`calls`; the offsets of
    every committed transaction are in :attr:`committed_offsets`.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    pending: list[Produced] = field(default_factory=list)
    delivered: list[Produced] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    errors: dict[str, deque[KafkaError]] = field(default_factory=dict)
    deliver_on_flush: bool = True
    judge: Callable[[Produced], KafkaError | None] | None = None
    txn_error: KafkaError | None = None  # the abortable state of the open transaction
    in_transaction: bool = False
    committed_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    _sent_offsets: dict[TopicPartition, int] = field(default_factory=dict)

    def fail_next(self, method: str, *errors: KafkaError) -> None:
        """Make the next calls of ``method`` raise ``KafkaException(error)``, in order."""
        self.errors.setdefault(method, deque()).extend(errors)

    def deliver(self, count: int | None = None, error: KafkaError | None = None) -> int:
        """Report the oldest ``count`` pending records (all: None) with ``error``; returns how
        many were reported."""
        take = len(self.pending) if count is None else min(count, len(self.pending))
        batch, self.pending = self.pending[:take], self.pending[take:]
        for record in batch:
            verdict = error
            if verdict is None and self.judge is not None:
                verdict = self.judge(record)
            if verdict is None:
                self.delivered.append(record)
            elif self.in_transaction and self.txn_error is None:
                self.txn_error = verdict
            record.report(verdict)
        return take

    def _call(self, name: str) -> None:
        self.calls.append(name)
        queued = self.errors.get(name)
        if queued:
            raise KafkaException(queued.popleft())

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        *,
        headers: Any = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        self._call("produce")
        if self.txn_error is not None:
            raise KafkaException(KafkaError(KafkaError._STATE))
        self.pending.append(Produced(topic, key, value, list(headers or []), on_delivery))

    def poll(self, timeout: float = -1) -> int:
        return 0

    def flush(self, timeout: float = -1) -> int:
        if self.deliver_on_flush:
            self.deliver()
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending)

    def init_transactions(self, timeout: float = -1) -> None:
        self._call("init_transactions")

    def begin_transaction(self) -> None:
        self._call("begin_transaction")
        self.in_transaction = True

    def send_offsets_to_transaction(
        self, positions: list[KafkaTopicPartition], group_metadata: Any, timeout: float = -1
    ) -> None:
        self._call("send_offsets_to_transaction")
        self._sent_offsets.update({_ours(p): p.offset for p in positions})

    def commit_transaction(self, timeout: float = -1) -> None:
        self._call("commit_transaction")
        if self.txn_error is not None:
            raise KafkaException(KafkaError(self.txn_error.code(), txn_requires_abort=True))
        self.in_transaction = False
        self.committed_offsets.update(self._sent_offsets)
        self._sent_offsets.clear()

    def abort_transaction(self, timeout: float = -1) -> None:
        self._call("abort_transaction")
        self.in_transaction = False
        self._sent_offsets.clear()
        self.txn_error = None


def kafka_error(
    code: int, *, retriable: bool = False, fatal: bool = False, txn_requires_abort: bool = False
) -> KafkaError:
    """A ``KafkaError`` with the given flags (as the client raises them)."""
    return KafkaError(code, retriable=retriable, fatal=fatal, txn_requires_abort=txn_requires_abort)


def factory(client: Any) -> Callable[[dict[str, Any]], Any]:
    """A client factory that returns ``client`` (and keeps the settings it was given)."""

    def build(settings: dict[str, Any]) -> Any:
        if hasattr(client, "settings"):
            client.settings = dict(settings)
        return client

    return build


if TYPE_CHECKING:  # the fakes satisfy the protocols the stages take
    _consumer: ConsumerClient = FakeConsumer({})
    _producer: ProducerClient = FakeProducer()


@dataclass
class FakeShareConsumer:
    """An in-memory share consumer (``confluent_kafka.ShareConsumer``, explicit
    acknowledgement): :meth:`poll` returns the next of :attr:`polls` (empty lists once they
    run out) and, as the real client does, raises while a record of the previous poll is not
    acknowledged. Acknowledgements are recorded in :attr:`acks` as ``(topic, partition,
    offset, type)`` and reported to the commit callback by the next :meth:`poll` and by
    :meth:`close`; :attr:`stats` (JSON strings) are handed to ``stats_cb`` by the next poll.
    """

    polls: deque[list[FakeShareMessage]] = field(default_factory=deque)
    stats: deque[str] = field(default_factory=deque)
    settings: dict[str, Any] = field(default_factory=dict)
    acks: list[tuple[str, int, int, int]] = field(default_factory=list)
    subscribed: list[str] = field(default_factory=list)
    closed: bool = False
    commits: int = 0
    async_commits: int = 0
    _unacked: set[tuple[str, int, int]] = field(default_factory=set)
    _unsent: list[tuple[str, int, int, int]] = field(default_factory=list)
    _on_commit: Callable[[dict[KafkaTopicPartition, set[int]], Any], None] | None = None

    def __call__(self, settings: dict[str, Any]) -> FakeShareConsumer:
        """Be the factory too: keep the settings, return self."""
        self.settings = settings
        return self

    def set_acknowledgement_commit_callback(
        self, callback: Callable[[dict[KafkaTopicPartition, set[int]], Any], None]
    ) -> None:
        self._on_commit = callback

    def subscribe(self, topics: list[str]) -> None:
        self.subscribed = list(topics)

    def poll(self, timeout: float = -1) -> list[FakeShareMessage]:
        if self._unacked:
            raise KafkaException(
                KafkaError(KafkaError._STATE, "not all records of the previous poll acknowledged")
            )
        self._send()
        stats_cb = self.settings.get("stats_cb")
        while self.stats and stats_cb is not None:
            stats_cb(self.stats.popleft())
        batch = self.polls.popleft() if self.polls else []
        self._unacked = {(m.topic(), m.partition(), m.offset()) for m in batch}
        return batch

    def acknowledge_offset(self, topic: str, partition: int, offset: int, ack_type: int) -> None:
        key = (topic, partition, offset)
        if key not in self._unacked:  # the client's IllegalStateException is a RuntimeError
            raise RuntimeError(f"{key} is not in flight")
        self._unacked.discard(key)
        self.acks.append((*key, int(ack_type)))
        self._unsent.append((*key, int(ack_type)))

    def commit_sync(self, timeout: float = 60) -> dict[KafkaTopicPartition, Any]:
        self.commits += 1
        self._send()
        return {}

    def commit_async(self) -> None:
        self.async_commits += 1
        self._send()

    def close(self) -> None:
        self._send()
        self.closed = True

    def _send(self) -> None:
        if not self._unsent or self._on_commit is None:
            self._unsent.clear()
            return
        offsets: dict[tuple[str, int], set[int]] = {}
        for topic, partition, offset, _ in self._unsent:
            offsets.setdefault((topic, partition), set()).add(offset)
        self._unsent.clear()
        self._on_commit({KafkaTopicPartition(t, p): o for (t, p), o in offsets.items()}, None)
