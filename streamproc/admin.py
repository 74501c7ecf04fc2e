"""Topic administration with confluent-kafka's AdminClient."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic


def ensure_topics(
    bootstrap_servers: str, partitions: dict[str, int], timeout_s: float = 30
) -> None:
    """Create each topic with the given partition count unless it exists (replication 1 on a
    single-node cluster, else the broker default).

    Raises:
        KafkaException: creation failed for a reason other than "already exists".
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    existing = admin.list_topics(timeout=timeout_s).topics
    brokers = len(admin.list_topics(timeout=timeout_s).brokers)
    todo = [
        NewTopic(name, num_partitions=count, replication_factor=min(brokers, 3) or -1)
        for name, count in partitions.items()
        if name not in existing
    ]
    if not todo:
        return
    for future in admin.create_topics(todo, operation_timeout=timeout_s).values():
        try:
            future.result(timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
