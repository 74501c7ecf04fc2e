#!/usr/bin/env bash
# kafka-console-consumer.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh org.apache.kafka.tools.consumer.ConsoleConsumer "$@"
