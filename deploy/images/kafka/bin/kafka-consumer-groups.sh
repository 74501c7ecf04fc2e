#!/usr/bin/env bash
# kafka-consumer-groups.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh org.apache.kafka.tools.consumer.group.ConsumerGroupCommand "$@"
