#!/usr/bin/env bash
# Runs a Java main class of Apache Kafka with every jar of /opt/kafka/libs on the class path.
# KAFKA_HEAP_OPTS, KAFKA_JVM_PERFORMANCE_OPTS, KAFKA_OPTS and KAFKA_LOG4J_OPTS work as in the
# Apache distribution, with its defaults (G1 aiming at 20-ms pauses, not the JVM's 200).
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: kafka-run-class.sh CLASS [ARG]..." >&2; exit 2; }
heap="${KAFKA_HEAP_OPTS:--Xmx256m -Xms64m}"
performance="${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
-XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true}"
log4j="${KAFKA_LOG4J_OPTS:--Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties}"
# shellcheck disable=SC2086 # the *_OPTS variables hold several JVM options
exec java $heap $performance ${KAFKA_OPTS:-} $log4j -cp '/opt/kafka/libs/*' "$@"
