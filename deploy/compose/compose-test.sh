#!/usr/bin/env bash
# End-to-end test of docker-compose.yml (needs Docker with the compose plugin; `make compose-test`):
# builds the image, brings the stack up, replays real data of the three workloads, then checks from
# the broker that every input has a result (or a dead-letter record), that the consumer group has
# committed everything, that Prometheus scrapes streamproc and that Grafana has the dashboard.
# The stack is torn down at the end, also on failure (KEEP=1 leaves it running).
#
# Knobs: VIDEO_MESSAGES, IOT_MESSAGES, TRADES_MESSAGES (replayed counts), TIMEOUT_S (per wait),
#        COMPOSE_PROJECT_NAME, STREAMPROC_IMAGE, STREAMPROC_VARIANT.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-streamproc-compose-test}"
export VIDEO_MESSAGES="${VIDEO_MESSAGES:-60}"
export IOT_MESSAGES="${IOT_MESSAGES:-120}"
export TRADES_MESSAGES="${TRADES_MESSAGES:-400}"
TIMEOUT_S="${TIMEOUT_S:-300}"
GROUP_ID=streamproc
# input topic -> output topic, dead-letter topic (as in deploy/compose/streamproc.yaml)
PIPELINES=(
  "video.frames video.labels video.frames.dlq"
  "iot.windows iot.scores iot.windows.dlq"
  "trades trades.scores trades.dlq"
)
REPLAYERS=(replay-video replay-iot replay-trades)

compose() { docker compose -f docker-compose.yml "$@"; }
log() { printf '[compose-test] %s\n' "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

command -v docker >/dev/null || fail "docker is not installed"
docker compose version >/dev/null 2>&1 || fail "the docker compose plugin is not installed"

status=1
cleanup() {
  if [[ $status -ne 0 ]]; then
    log "logs of the failed run:"
    compose logs --no-color --tail 200 >&2 || true
  fi
  if [[ "${KEEP:-0}" == 1 ]]; then
    log "KEEP=1: leaving the stack up (docker compose -p $COMPOSE_PROJECT_NAME down -v)"
  else
    compose down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

# Runs a Kafka CLI tool inside the broker container.
kafka_cli() {
  local tool="$1"
  shift
  compose exec -T kafka "/opt/kafka/bin/$tool" --bootstrap-server kafka:9092 "$@"
}

# Sum of the end offsets of TOPIC (= records written: the producers are not transactional).
end_offsets() {
  kafka_cli kafka-get-offsets.sh --topic "$1" --time -1 |
    awk -F: '{ sum += $NF } END { print sum + 0 }'
}

# Total lag of the consumer group (committed offsets behind end offsets), or -1 when unknown.
group_lag() {
  kafka_cli kafka-consumer-groups.sh --describe --group "$GROUP_ID" 2>/dev/null |
    awk 'BEGIN { lag = 0; seen = 0 }
         $1 == "GROUP" { for (i = 1; i <= NF; i++) if ($i == "LAG") col = i; next }
         col && NF >= col { seen = 1; if ($col == "-") lag = -1e18; else lag += $col }
         END { print (seen && lag >= 0) ? lag : -1 }'
}

# Retries COMMAND (its stdout discarded) until it succeeds or TIMEOUT_S passes.
wait_for() {
  local what="$1" deadline=$((SECONDS + TIMEOUT_S))
  shift
  until "$@" >/dev/null; do
    ((SECONDS < deadline)) || fail "timed out after ${TIMEOUT_S}s waiting for $what"
    sleep 2
  done
  log "ok: $what"
}

ready() {
  compose exec -T streamproc python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9108/readyz', timeout=3)" \
    2>/dev/null
}

replayer_done() {
  local id state
  id="$(compose ps --all --quiet "$1")"
  [[ -n "$id" ]] || return 1
  state="$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$id")"
  case "$state" in
    "exited 0") return 0 ;;
    exited*) fail "$1 exited with code ${state#exited }" ;;
    *) return 1 ;;
  esac
}

outputs_complete() {
  local spec input output dlq n_in n_out n_dlq
  for spec in "${PIPELINES[@]}"; do
    read -r input output dlq <<<"$spec"
    n_in="$(end_offsets "$input")"
    n_out="$(end_offsets "$output")"
    n_dlq="$(end_offsets "$dlq")"
    log "  $input: $n_in in, $n_out results, $n_dlq dead-lettered"
    ((n_in > 0 && n_out + n_dlq >= n_in)) || return 1
  done
}

committed() {
  local lag
  lag="$(group_lag)"
  log "  consumer group lag: $lag"
  [[ "$lag" == 0 ]]
}

prometheus_scrapes() {
  compose exec -T prometheus wget -qO- \
    'http://localhost:9090/api/v1/query?query=sum(streamproc_messages_consumed_total)' 2>/dev/null |
    grep -q '"result":\[{'
}

grafana_has_dashboard() {
  compose exec -T grafana wget -qO- 'http://localhost:3000/api/search?query=streamproc' 2>/dev/null |
    grep -q '"uid":"streamproc"'
}

log "building the image and starting the stack (project $COMPOSE_PROJECT_NAME) ..."
compose build
compose up --detach
wait_for "streamproc ready (/readyz)" ready
for replayer in "${REPLAYERS[@]}"; do
  wait_for "$replayer finished" replayer_done "$replayer"
done
wait_for "every input has a result or a dead-letter record" outputs_complete

for spec in "${PIPELINES[@]}"; do
  read -r input output dlq <<<"$spec"
  n_in="$(end_offsets "$input")"
  n_out="$(end_offsets "$output")"
  n_dlq="$(end_offsets "$dlq")"
  # at-least-once: duplicates are possible only after a crash, and nothing crashed here
  ((n_out + n_dlq == n_in)) || fail "$input: $n_in inputs but $n_out results + $n_dlq dead letters"
  ((n_out > 0)) || fail "$output: no results"
done
expected=$((VIDEO_MESSAGES + IOT_MESSAGES + TRADES_MESSAGES))
total_in=0
for spec in "${PIPELINES[@]}"; do
  read -r input _ <<<"$spec"
  total_in=$((total_in + $(end_offsets "$input")))
done
((total_in == expected)) || fail "replayed $total_in messages, expected $expected"

sample="$(kafka_cli kafka-console-consumer.sh --topic trades.scores --from-beginning \
  --max-messages 1 --timeout-ms 20000 2>/dev/null)"
grep -q '"score"' <<<"$sample" || fail "trades.scores: unexpected record: $sample"
log "ok: sample result $sample"

wait_for "the consumer group committed every offset" committed
wait_for "Prometheus scrapes streamproc metrics" prometheus_scrapes
wait_for "Grafana provisioned the streamproc dashboard" grafana_has_dashboard

status=0
log "PASS: $total_in messages replayed, all results on the output topics, offsets committed"
