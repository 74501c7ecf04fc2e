"""What streamproc uses of the Kafka clients: the seams where a test puts a fake.

The stages never build a ``confluent_kafka`` client themselves from a hard-wired class: they
take a factory (default: the real client, through :func:`~streamproc.kafka.clients.build_client`)
whose product satisfies one of these protocols. ``tests/support/kafka_fakes.py`` (outside the
package) holds fakes of them for unit tests of our own logic (seek-back, rewind, commit
retry, revoke with in-flight batches, late results); integration tests always use a real broker.

Only the methods listed here may be called on a client; that list is the contract.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, overload

from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import ClusterMetadata

from streamproc.records import TopicPartition


def ktp(tp: TopicPartition, offset: int | None = None) -> KafkaTopicPartition:
    """Our partition as a ``confluent_kafka.TopicPartition`` (with ``offset`` when given)."""
    if offset is None:
        return KafkaTopicPartition(tp.topic, tp.partition)
    return KafkaTopicPartition(tp.topic, tp.partition, offset)


RebalanceCallback = Callable[[Any, list[KafkaTopicPartition]], None]
"""``(consumer, partitions)``: librdkafka's assign/revoke/lost callback signature."""
DeliveryCallback = Callable[[KafkaError | None, Any], None]
"""``(error or None, message)``: a produced record's delivery report."""


class MessageLike(Protocol):
    """One consumed message (``confluent_kafka.Message``)."""

    def error(self) -> KafkaError | None: ...
    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> list[tuple[str, bytes]] | None: ...
    def timestamp(self) -> tuple[int, int]: ...


class ConsumerClient(Protocol):
    """The consumer the source thread owns (``confluent_kafka.Consumer``)."""

    def subscribe(
        self,
        topics: list[str],
        on_assign: RebalanceCallback = ...,
        on_revoke: RebalanceCallback = ...,
        on_lost: RebalanceCallback = ...,
    ) -> None: ...
    def consume(self, num_messages: int = 1, timeout: float = -1) -> Sequence[Any]: ...
    def pause(self, partitions: list[KafkaTopicPartition]) -> None: ...
    def resume(self, partitions: list[KafkaTopicPartition]) -> None: ...
    def seek(self, partition: KafkaTopicPartition) -> None: ...
    @overload
    def commit(
        self, *, offsets: list[KafkaTopicPartition], asynchronous: Literal[True] = ...
    ) -> None: ...
    @overload
    def commit(
        self, *, offsets: list[KafkaTopicPartition], asynchronous: Literal[False]
    ) -> list[KafkaTopicPartition]: ...
    def committed(
        self, partitions: list[KafkaTopicPartition], timeout: float = -1
    ) -> list[KafkaTopicPartition]: ...
    def position(self, partitions: list[KafkaTopicPartition]) -> list[KafkaTopicPartition]: ...
    def consumer_group_metadata(self) -> Any: ...
    def incremental_assign(self, partitions: list[KafkaTopicPartition]) -> None: ...
    def incremental_unassign(self, partitions: list[KafkaTopicPartition]) -> None: ...
    def close(self) -> None: ...


class ProducerClient(Protocol):
    """The results producer the sink owns (``confluent_kafka.Producer``); the transactional
    calls are used only in exactly-once mode."""

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        *,
        # Any: the client takes a list of (str, str | bytes | None) pairs or a dict; a list is
        # invariant, so our list[tuple[str, bytes]] would not match its declared type
        headers: Any = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None: ...
    def poll(self, timeout: float = -1) -> int: ...
    def flush(self, timeout: float = -1) -> int: ...
    def __len__(self) -> int: ...
    def init_transactions(self, timeout: float = -1) -> None: ...
    def begin_transaction(self) -> None: ...
    def send_offsets_to_transaction(
        self, positions: list[KafkaTopicPartition], group_metadata: Any, timeout: float = -1
    ) -> None: ...
    def commit_transaction(self, timeout: float = -1) -> None: ...
    def abort_transaction(self, timeout: float = -1) -> None: ...


class AdminClientLike(Protocol):
    """The admin client (``confluent_kafka.admin.AdminClient``): start-up topic checks."""

    def list_topics(self, *args: Any, **kwargs: Any) -> ClusterMetadata: ...
    def create_topics(
        self, new_topics: list[Any], **kwargs: Any
    ) -> dict[str, concurrent.futures.Future[Any]]: ...
    def describe_configs(
        self, resources: list[Any], **kwargs: Any
    ) -> dict[Any, concurrent.futures.Future[Any]]: ...


ConsumerFactory = Callable[[dict[str, Any]], ConsumerClient]
"""Builds the consumer from its librdkafka settings."""
ProducerFactory = Callable[[dict[str, Any]], ProducerClient]
"""Builds a producer from its librdkafka settings."""
AdminFactory = Callable[[dict[str, Any]], AdminClientLike]
"""Builds an admin client from its librdkafka settings."""
