#!/usr/bin/env bash
# kafka-get-offsets.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh org.apache.kafka.tools.GetOffsetShell "$@"
