#!/usr/bin/env bash
# kafka-console-producer.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh org.apache.kafka.tools.ConsoleProducer "$@"
