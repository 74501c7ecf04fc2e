"""Topic administration with confluent-kafka's AdminClient; Kafka errors become BrokerError."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from functools import partial

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    ClusterMetadata,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from streamproc.config.sections import Scalar
from streamproc.errors import BrokerError
from streamproc.kafka.clients import build_admin
from streamproc.kafka.protocols import AdminClientLike, AdminFactory
from streamproc.kafka.transient import is_transient, retry_transient
from streamproc.logs import get_logger

log = get_logger(__name__)


def _admin(
    bootstrap_or_config: str | Mapping[str, Scalar], factory: AdminFactory
) -> tuple[AdminClientLike, str]:
    config: dict[str, Scalar] = (
        {"bootstrap.servers": bootstrap_or_config}
        if isinstance(bootstrap_or_config, str)
        else dict(bootstrap_or_config)
    )
    return factory(config), str(config.get("bootstrap.servers"))


def cluster_metadata(
    bootstrap_or_config: str | Mapping[str, Scalar],
    timeout_s: float = 30,
    admin_factory: AdminFactory = build_admin,
) -> ClusterMetadata:
    """Topic and broker metadata.

    Raises:
        BrokerError: the cluster did not answer within ``timeout_s`` seconds.
    """
    admin, where = _admin(bootstrap_or_config, admin_factory)
    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerError(
            f"cannot reach Kafka at {where} within {timeout_s:.0f} s: {exc.args[0].str()}"
        ) from None


def ensure_topics(
    bootstrap_or_config: str | Mapping[str, Scalar],
    partitions: dict[str, int],
    timeout_s: float = 30,
    topic_config: dict[str, str] | None = None,
    admin_factory: AdminFactory = build_admin,
) -> list[str]:
    """Create each topic with the given partition count unless it exists. Replication factor:
    the number of brokers, at most 3. Returns the topics created.

    Args:
        bootstrap_or_config: ``host:port`` or AdminClient settings (with security settings).
        partitions: topic -> partition count (-1: the broker default).
        topic_config: topic-level settings for the topics created (e.g. the bench's
            ``message.timestamp.type=LogAppendTime``); existing topics are left as they are.

    Raises:
        BrokerError: the cluster is unreachable, or creation failed for a reason other than
            "already exists" (e.g. not authorised), or failed transiently for ``timeout_s``.
    """
    metadata = cluster_metadata(bootstrap_or_config, timeout_s)
    admin, where = _admin(bootstrap_or_config, admin_factory)
    replication = min(len(metadata.brokers), 3) or -1
    todo = [
        NewTopic(
            name,
            num_partitions=count,
            replication_factor=replication,
            config=dict(topic_config or {}),
        )
        for name, count in partitions.items()
        if name not in metadata.topics
    ]
    if not todo:
        return []

    def create(topic: NewTopic) -> bool:
        """Create ``topic``: True when created, False when it already exists."""
        future = admin.create_topics([topic], operation_timeout=timeout_s)[topic.topic]
        try:
            future.result(timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return False
            raise
        return True

    created = []
    for topic in todo:
        try:
            # a transient error (the controller moving, a request timing out on a loaded
            # cluster) is retried; "already exists" then means an earlier attempt succeeded
            if retry_transient(partial(create, topic), timeout_s, f"create {topic.topic}"):
                created.append(topic.topic)
        except KafkaException as exc:
            raise BrokerError(
                f"cannot create topic {topic.topic!r} on {where}: {exc.args[0].str()}"
            ) from None
    return created


def partition_count(metadata: ClusterMetadata, topic: str) -> int | None:
    """Partitions of ``topic`` in ``metadata``, or None when the topic does not exist."""
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        return None
    return len(found.partitions)


def max_message_bytes(
    bootstrap_or_config: str | Mapping[str, Scalar],
    topics: list[str],
    timeout_s: float = 30,
    admin_factory: AdminFactory = build_admin,
) -> dict[str, int]:
    """Each existing topic's ``max.message.bytes`` (the largest record batch it accepts).

    One request for all ``topics``. A request that is not answered (it went to a broker that
    is down: the process starts while one of a replicated cluster's brokers is) or fails
    transiently is sent again by a fresh admin client, each attempt waiting at most a third of
    ``timeout_s``, until ``timeout_s`` seconds have passed; then every limit is left out, with
    a warning. Topics that do not exist, or whose config cannot be read (e.g. not authorised to
    describe configs), are left out too: callers then rely on the broker's answer per record.
    """
    read = partial(_max_bytes, bootstrap_or_config, topics, timeout_s / 3, admin_factory)
    try:
        return retry_transient(read, timeout_s, "max.message.bytes of the output topics")
    except KafkaException as exc:
        log.warning("topic limits unknown", topics=topics, error=exc.args[0].str())
        return {}


def _max_bytes(
    bootstrap_or_config: str | Mapping[str, Scalar],
    topics: list[str],
    timeout_s: float,
    admin_factory: AdminFactory,
) -> dict[str, int]:
    """One attempt of :func:`max_message_bytes`.

    Raises:
        KafkaException: a transient error, or ``_TIMED_OUT`` when a topic's answer did not
            come within ``timeout_s`` seconds.
    """
    admin, where = _admin(bootstrap_or_config, admin_factory)
    resources = [ConfigResource(ResourceType.TOPIC, topic) for topic in topics]
    limits: dict[str, int] = {}
    for resource, future in admin.describe_configs(resources, request_timeout=timeout_s).items():
        try:
            entry = future.result(timeout_s).get("max.message.bytes")
        except concurrent.futures.TimeoutError:
            reason = f"no answer from {where} within {timeout_s:.1f} s"
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, reason)) from None
        except KafkaException as exc:
            if is_transient(exc):
                raise
            continue  # the topic's own answer (absent, not authorised): left out
        if entry is not None and entry.value is not None:
            limits[resource.name] = int(entry.value)
    return limits
