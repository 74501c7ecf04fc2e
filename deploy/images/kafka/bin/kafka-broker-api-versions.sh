#!/usr/bin/env bash
# kafka-broker-api-versions.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
