#!/usr/bin/env bash
# kafka-storage.sh of the Apache Kafka distribution.
exec /opt/kafka/bin/kafka-run-class.sh kafka.tools.StorageTool "$@"
