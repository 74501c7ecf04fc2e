#!/usr/bin/env bash
# Topic-init job of docker-compose.yml (runs in the apache/kafka image): creates every topic of
# the stack up front, idempotently, so the consumer, the replayers and the DLQ never race on
# auto-creation. Inputs: BOOTSTRAP_SERVERS, PARTITIONS, TOPICS (space separated).
set -euo pipefail
: "${BOOTSTRAP_SERVERS:?}" "${TOPICS:?}"
partitions="${PARTITIONS:-4}"
for topic in $TOPICS; do
  /opt/kafka/bin/kafka-topics.sh --bootstrap-server "$BOOTSTRAP_SERVERS" --create --if-not-exists \
    --topic "$topic" --partitions "$partitions" --replication-factor 1
done
/opt/kafka/bin/kafka-topics.sh --bootstrap-server "$BOOTSTRAP_SERVERS" --list
