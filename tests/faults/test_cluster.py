"""The local three-node cluster and the nemesis themselves (`make test-faults`)."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.kafka_local import CLUSTER_SETTINGS, LocalCluster
from streamproc.tools.nemesis import Nemesis, coordinator_partition

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]


def _deliver(bootstrap: str, topic: str, timeout_s: float) -> str | None:
    """Produce one acks=all record; None when acknowledged, else the error."""
    errors: list[str] = []
    done: list[bool] = []
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "message.timeout.ms": int(timeout_s * 1000),
            "log_level": 0,
        }
    )
    producer.produce(
        topic,
        b"x",
        on_delivery=lambda err, _m: (errors.append(str(err)) if err else None, done.append(True)),
    )
    producer.flush(timeout_s + 5)
    return errors[0] if errors else (None if done else "no delivery report")


def test_three_nodes_replicate_every_topic_three_times(
    cluster: LocalCluster, nemesis: Nemesis
) -> None:
    assert len(cluster.nodes) == 3
    assert all(host.startswith("127.0.0.1:") for host in cluster.bootstrap_servers.split(","))
    topic = f"rf.{uuid.uuid4().hex[:8]}"
    ensure_topics(cluster.bootstrap_servers, {topic: 3})
    deadline_s = time.monotonic() + 60
    while nemesis.isr(topic) != {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3]}:
        assert time.monotonic() < deadline_s, nemesis.isr(topic)
        time.sleep(0.2)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    resource = ConfigResource(ResourceType.TOPIC, topic)
    config = admin.describe_configs([resource])[resource].result(30)
    assert config["min.insync.replicas"].value == "2"
    assert _deliver(cluster.bootstrap_servers, topic, 30) is None
    # the offsets topic is replicated the same way
    consumer = Consumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": topic})
    try:
        consumer.subscribe([topic])
        deadline_s = time.monotonic() + 60
        while "__consumer_offsets" not in consumer.list_topics(timeout=10).topics:
            consumer.poll(0.5)
            assert time.monotonic() < deadline_s
    finally:
        consumer.close()
    assert all(len(isr) == 3 for isr in nemesis.isr("__consumer_offsets").values())


def test_two_nodes_down_refuse_writes_until_one_returns(
    cluster: LocalCluster, nemesis: Nemesis
) -> None:
    topic = f"two.{uuid.uuid4().hex[:8]}"
    ensure_topics(cluster.bootstrap_servers, {topic: 1})
    leader = nemesis.leader_of(topic, 0)
    other = next(i for i in (1, 2, 3) if i != leader)
    survivor = cluster.node(next(i for i in (1, 2, 3) if i not in (leader, other)))
    with nemesis.fault("kill", leader, other):
        assert not cluster.node(leader).running and not cluster.node(other).running
        error = _deliver(survivor.bootstrap_servers, topic, 15)
        assert error is not None  # NOT_ENOUGH_REPLICAS / no leader: a write is refused
    assert cluster.node(leader).running and cluster.node(other).running
    assert _deliver(cluster.bootstrap_servers, topic, 60) is None


def test_controller_and_coordinators_are_found(cluster: LocalCluster, nemesis: Nemesis) -> None:
    controller = nemesis.controller()
    assert controller in (1, 2, 3)
    with nemesis.fault("kill", controller):
        deadline_s = time.monotonic() + 60
        while True:  # a new leader of the quorum is elected among the other two
            with contextlib.suppress(Exception):
                if nemesis.controller() != controller:
                    break
            assert time.monotonic() < deadline_s, "no new controller within 60 s"
            time.sleep(0.2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    partitions = int(CLUSTER_SETTINGS["offsets.topic.num.partitions"])
    # the broker's answer and Kafka's hash of the group id name the same partition leader
    assert nemesis.group_coordinator(group) == nemesis.leader_of(
        "__consumer_offsets", coordinator_partition(group, partitions)
    )


def test_pause_stalls_and_cut_drops_only_that_node(cluster: LocalCluster, nemesis: Nemesis) -> None:
    victim = cluster.node(2)
    with nemesis.fault("pause", 2):
        admin = AdminClient({"bootstrap.servers": victim.bootstrap_servers, "log_level": 0})
        with pytest.raises(KafkaException):
            admin.list_topics(timeout=3)
    assert victim.running
    with nemesis.fault("cut", 2):
        admin = AdminClient({"bootstrap.servers": victim.bootstrap_servers, "log_level": 0})
        with pytest.raises(KafkaException):
            admin.list_topics(timeout=3)
        other = AdminClient({"bootstrap.servers": cluster.node(1).bootstrap_servers})
        brokers = other.list_topics(timeout=10).brokers
        assert sorted(brokers) == [1, 2, 3]  # node 2 is still in the cluster
    AdminClient({"bootstrap.servers": victim.bootstrap_servers}).list_topics(timeout=30)
