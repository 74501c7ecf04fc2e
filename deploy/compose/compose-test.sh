#!/usr/bin/env bash
# End-to-end test of docker-compose.yml on a real Docker engine (`make compose-test`):
#
#  0. engine + compose plugin (deploy/engine.sh: installed/started when missing, as root) and,
#     with COMPOSE_TEST_IMAGES=local (default: no registry here), the base, Kafka, Prometheus,
#     registry, Zipkin and collector images (deploy/images/build.sh); Grafana runs only where its image can be had.
#  1. builds the streamproc image once (`docker compose build streamproc`) and checks it: no test
#     or dev tool installed, no compiler, non-root; `promtool check rules` + `promtool test rules`.
#  2. brings the stack up (with a Schema Registry), replays the three workloads and trades in
#     Avro (a schema-managed pipeline) and checks from the broker: 0 missing, 0 duplicates,
#     committed == end offsets (partitions that received nothing count as done), and that the
#     Avro results read with confluent-kafka's stock deserialiser;
#     the consumer is healthy, non-root, read-only root filesystem, no capabilities; Prometheus
#     scrapes it and has loaded the alert rules; Zipkin (behind the OpenTelemetry Collector)
#     holds a whole trace of a batch (its process span and stage spans).
#  3. `docker kill`s the consumer mid-replay, restarts it: 0 missing (duplicates allowed).
#  4. `docker compose stop` mid-replay: exit 0 inside the stop grace period (graceful drain); after
#     a restart, 0 missing again.
#  5. tears down and checks that no container, network, volume or dangling image of the run is
#     left (also on failure; KEEP=1 leaves the stack up).
#
# Knobs: VIDEO_MESSAGES, IOT_MESSAGES, TRADES_MESSAGES, TRADES_AVRO_MESSAGES (phase 2), KILL_MESSAGES, STOP_MESSAGES
# (trades replayed in phases 3 and 4), TIMEOUT_S (per wait), COMPOSE_PROJECT_NAME,
# COMPOSE_TEST_IMAGES=local|registry, STREAMPROC_IMAGE, STREAMPROC_BASE_IMAGE, KAFKA_IMAGE,
# PROMETHEUS_IMAGE, SCHEMA_REGISTRY_IMAGE, ZIPKIN_IMAGE, OTEL_COLLECTOR_IMAGE, GRAFANA_IMAGE.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LOG_PREFIX='[compose-test]'
# shellcheck source=deploy/lib.sh
source deploy/lib.sh
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-streamproc-compose-test}"
export VIDEO_MESSAGES="${VIDEO_MESSAGES:-60}"
export IOT_MESSAGES="${IOT_MESSAGES:-120}"
export TRADES_MESSAGES="${TRADES_MESSAGES:-400}"
export TRADES_AVRO_MESSAGES="${TRADES_AVRO_MESSAGES:-300}"
KILL_MESSAGES="${KILL_MESSAGES:-3000}"
STOP_MESSAGES="${STOP_MESSAGES:-1500}"
TIMEOUT_S="${TIMEOUT_S:-300}"
if [[ "${COMPOSE_TEST_IMAGES:-local}" == local ]]; then
  export STREAMPROC_BASE_IMAGE="${STREAMPROC_BASE_IMAGE:-streamproc/python:3.11-bookworm}"
  export KAFKA_IMAGE="${KAFKA_IMAGE:-streamproc/kafka:4.4.0}"
  export PROMETHEUS_IMAGE="${PROMETHEUS_IMAGE:-streamproc/prometheus:2.42}"
  export SCHEMA_REGISTRY_IMAGE="${SCHEMA_REGISTRY_IMAGE:-streamproc/apicurio-registry:2.6.13}"
  export ZIPKIN_IMAGE="${ZIPKIN_IMAGE:-streamproc/zipkin:3.6.1}"
  export OTEL_COLLECTOR_IMAGE="${OTEL_COLLECTOR_IMAGE:-streamproc/otelcol:0.148.0}"
fi
export STREAMPROC_IMAGE="${STREAMPROC_IMAGE:-streamproc:cpu}"
GRAFANA_IMAGE="${GRAFANA_IMAGE:-grafana/grafana:12.1.1}"
# Random free host ports: nothing else on this host can collide with the test stack.
export KAFKA_HOST_PORT="" METRICS_HOST_PORT="" PROMETHEUS_HOST_PORT="" GRAFANA_HOST_PORT=""
export SCHEMA_REGISTRY_HOST_PORT="" ZIPKIN_HOST_PORT=""
# requests is not here: mlflow-skinny (the MLflow model registry client, requirements.lock) needs it.
FORBIDDEN_PACKAGES="pytest pytest-timeout ruff mypy testcontainers docker scikit-image scipy pandas
  matplotlib pip iniconfig pluggy wheel"
ALERTS=(StreamprocConsumerLagGrowing StreamprocDeadLettering StreamprocCommitFailures
  StreamprocPartitionsStalled StreamprocPartitionsPausedTooLong StreamprocEndToEndLatencyHigh
  StreamprocNotReady StreamprocModelRolledBack StreamprocModelBroken StreamprocLatencyOverTarget)

compose() { docker compose -f docker-compose.yml "$@"; }
# The checks in deploy/compose/check_stack.py, run by the consumer container's own Python.
check() { compose exec -T streamproc python - "$@" <deploy/compose/check_stack.py; }
dangling() { docker images --filter dangling=true --quiet --no-trunc | sort; }

# --- 0. engine and images -----------------------------------------------------------------------
started=$SECONDS
deploy/engine.sh
if [[ "${COMPOSE_TEST_IMAGES:-local}" == local ]]; then
  deploy/images/build.sh base kafka prometheus registry tracing
fi
services=(kafka schema-registry topic-init streamproc replay-video replay-iot replay-trades
  replay-trades-avro prometheus zipkin otel-collector)
if docker image inspect "$GRAFANA_IMAGE" >/dev/null 2>&1 ||
  timeout 60 docker pull --quiet "$GRAFANA_IMAGE" >/dev/null 2>&1; then
  services+=(grafana)
  export GRAFANA_IMAGE
else
  log "SKIP grafana only: $GRAFANA_IMAGE cannot be had here (no registry); the dashboard's schema and unit checks run in make test"
fi
dangling_before="$(dangling)"
run_containers=()

status=1
cleanup() {
  local leftovers
  if [[ $status -ne 0 ]]; then
    log "logs of the failed run:"
    compose logs --no-color --tail 150 >&2
  fi
  if [[ "${KEEP:-0}" == 1 ]]; then
    log "KEEP=1: leaving the stack up (docker compose -p $COMPOSE_PROJECT_NAME down -v)"
    return
  fi
  ((${#run_containers[@]} == 0)) || docker rm -f "${run_containers[@]}" >/dev/null 2>&1 || true
  compose down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1
  local label="label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"
  leftovers="$(docker ps -a -q --filter "$label") $(docker network ls -q --filter "$label")"
  leftovers+=" $(docker volume ls -q --filter "$label")"
  leftovers+=" $(comm -13 <(printf '%s\n' "$dangling_before") <(dangling) | tr '\n' ' ')"
  if [[ -n "${leftovers// /}" ]]; then
    log "FAIL: the run left containers/networks/volumes/dangling images behind: $leftovers"
    EXIT_STATUS=1
    return
  fi
  log "teardown: no container, network, volume or dangling image of the run is left"
  if [[ $status -eq 0 ]]; then
    log "PASS in $((SECONDS - started)) s"
  fi
}
at_exit cleanup

# Retries COMMAND (its stdout discarded) every second until it succeeds or TIMEOUT_S passes.
wait_for() {
  WAIT_INTERVAL_S=1 wait_until "$1" "$TIMEOUT_S" "${@:2}"
  log "ok: $1"
}

kafka_cli() {
  local tool="$1"
  shift
  compose exec -T kafka "/opt/kafka/bin/$tool" --bootstrap-server kafka:9092 "$@"
}

# Sum of the end offsets of TOPIC.
end_offsets() {
  kafka_cli kafka-get-offsets.sh --topic "$1" --time -1 | awk -F: '{ sum += $NF } END { print sum + 0 }'
}

consumer_id() { compose ps --all --quiet streamproc; }
ready() {
  compose exec -T streamproc python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9108/readyz', timeout=3)" 2>/dev/null
}
healthy() { [[ "$(docker inspect --format '{{.State.Health.Status}}' "$(consumer_id)")" == healthy ]]; }

replayer_done() {
  local id="$1" state
  state="$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$id")"
  case "$state" in
    "exited 0") return 0 ;;
    exited*) die "replayer $id exited with code ${state#exited }" ;;
    *) return 1 ;;
  esac
}
compose_replayer_done() { replayer_done "$(compose ps --all --quiet "$1")"; }
output_grew() { (($(end_offsets trades.scores) >= $1)); }
running() { [[ "$(docker inspect --format '{{.State.Running}}' "$1")" == true ]]; }

# Starts a one-off trades replayer in the background; prints its container name.
replay_trades() {
  local name="$COMPOSE_PROJECT_NAME-replay-$1" limit="$2"
  run_containers+=("$name")
  compose run --detach --no-deps --name "$name" replay-trades \
    produce trades --topic trades --limit "$limit" --rate 200 >/dev/null
  printf '%s' "$name"
}

# --- 1. the image, built once, and the rules ----------------------------------------------------
log "building $STREAMPROC_IMAGE once (docker compose build streamproc; base ${STREAMPROC_BASE_IMAGE:-python:3.11}) ..."
build_started=$SECONDS
# The image this build replaces was made before the run: never counted as a leftover of it.
previous="$(docker image inspect --format '{{.Id}}' "$STREAMPROC_IMAGE" 2>/dev/null || true)"
# deploy/images/build.sh: hands pip the host's index and CA certificates, removes the image the
# build replaces (no dangling image), prints the build log on failure.
STREAMPROC_BASE_IMAGE="${STREAMPROC_BASE_IMAGE:-python:3.11.13-slim-bookworm}" \
  deploy/images/build.sh streamproc
dangling_before="$(printf '%s\n%s\n' "$dangling_before" "$previous" | sort)"
size_mb=$(($(docker image inspect --format '{{.Size}}' "$STREAMPROC_IMAGE") / 1000000))
log "ok: built $STREAMPROC_IMAGE in $((SECONDS - build_started)) s: $size_mb MB"

installed="$(docker run --rm --entrypoint python "$STREAMPROC_IMAGE" -c \
  'import importlib.metadata as m; print(*sorted({d.metadata["Name"].lower().replace("_", "-") for d in m.distributions()}))')"
found=()
for pkg in $FORBIDDEN_PACKAGES; do
  [[ " $installed " == *" $pkg "* ]] && found+=("$pkg")
done
((${#found[@]} == 0)) || die "$STREAMPROC_IMAGE ships test/dev packages: ${found[*]}"
[[ "${STREAMPROC_VARIANT:-cpu}" != cpu || " $installed " != *" triton "* ]] || die "the CPU image ships triton"
log "ok: $(wc -w <<<"$installed") packages in $STREAMPROC_IMAGE, none of: $(tr -s ' \n' ' ' <<<"$FORBIDDEN_PACKAGES")"
tools="$(docker run --rm --entrypoint sh "$STREAMPROC_IMAGE" -c 'id -u; command -v gcc cc make pip apt-get || true')"
[[ "$tools" == 10001 ]] || die "$STREAMPROC_IMAGE: expected uid 10001 and no gcc/cc/make/pip/apt-get, got: $tools"
log "ok: runs as uid 10001, no compiler, no pip, no apt-get"

rules=(docker run --rm -w /rules -v "$PWD/deploy/compose/prometheus:/rules:ro" --entrypoint promtool
  "${PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}")
"${rules[@]}" check rules alerts.yml >/dev/null || die "promtool check rules alerts.yml"
"${rules[@]}" test rules alerts.test.yml >/dev/null || die "promtool test rules alerts.test.yml"
log "ok: promtool check rules + test rules (lag and stalled-partition alerts)"

# --- 2. the stack, a clean replay ---------------------------------------------------------------
log "starting ${services[*]} (project $COMPOSE_PROJECT_NAME) ..."
compose up --detach --no-build "${services[@]}" >/dev/null 2>&1 || {
  compose up --detach --no-build "${services[@]}"
  die "docker compose up"
}
wait_for "streamproc ready (/readyz)" ready
for replayer in replay-video replay-iot replay-trades replay-trades-avro; do
  wait_for "$replayer finished" compose_replayer_done "$replayer"
done
expected=$((VIDEO_MESSAGES + IOT_MESSAGES + TRADES_MESSAGES + TRADES_AVRO_MESSAGES))
check verify --expect-inputs "$expected" --timeout-s "$TIMEOUT_S" ||
  die "replay: missing or duplicate results, or commits behind"
log "ok: $expected messages: 0 missing, 0 duplicates, committed == end offsets"
sample="$(kafka_cli kafka-console-consumer.sh --topic trades.scores --from-beginning \
  --max-messages 1 --timeout-ms 20000 2>/dev/null)"
grep -q '"score"' <<<"$sample" || die "trades.scores: unexpected record: $sample"
log "ok: sample result $sample"
check avro-results trades.avro.scores http://schema-registry:8080/apis/ccompat/v7 ||
  die "trades.avro.scores: not Avro the stock deserialiser reads"
log "ok: trades.avro.scores: framed Avro, read by confluent-kafka's stock AvroDeserializer"

wait_for "the consumer's healthcheck is healthy" healthy
cid="$(consumer_id)"
read -r user ro caps secopt <<<"$(docker inspect --format \
  '{{.Config.User}} {{.HostConfig.ReadonlyRootfs}} {{join .HostConfig.CapDrop ","}} {{join .HostConfig.SecurityOpt ","}}' "$cid")"
inside="$(compose exec -T streamproc sh -c \
  'id -u; grep CapEff /proc/self/status | cut -f2; touch /opt/x 2>/dev/null && echo writable || echo read-only')"
[[ "$user" == 10001:10001 && "$ro" == true && "$caps" == ALL && "$secopt" == *no-new-privileges* ]] ||
  die "consumer container: user=$user read_only=$ro cap_drop=$caps security_opt=$secopt"
[[ "$(tr '\n' ' ' <<<"$inside")" == "10001 0000000000000000 read-only " ]] ||
  die "inside the consumer: $(tr '\n' ' ' <<<"$inside")"
log "ok: consumer healthy, uid 10001, read-only root filesystem, no capabilities, no-new-privileges"

check prometheus http://prometheus:9090 "${ALERTS[@]}" --timeout-s "$TIMEOUT_S" ||
  die "Prometheus does not scrape streamproc or lacks the alert rules"
log "ok: Prometheus scrapes streamproc and has loaded the ${#ALERTS[@]} alert rules"
check traces http://zipkin:9411 --timeout-s "$TIMEOUT_S" ||
  die "Zipkin holds no whole trace of streamproc (a batch span and its stage spans)"
log "ok: Zipkin (behind the OpenTelemetry Collector) holds streamproc's traces: a batch span and its stage spans"
if [[ " ${services[*]} " == *" grafana "* ]]; then
  grafana_has_dashboard() {
    compose exec -T grafana wget -qO- 'http://localhost:3000/api/search?query=streamproc' 2>/dev/null |
      grep -q '"uid":"streamproc"'
  }
  wait_for "Grafana provisioned the streamproc dashboard" grafana_has_dashboard
fi

# --- 3. docker kill mid-replay ------------------------------------------------------------------
restarts="$(docker inspect --format '{{.RestartCount}}' "$cid")"
target=$(($(end_offsets trades.scores) + 300))
replayer="$(replay_trades kill "$KILL_MESSAGES")"
wait_for "results flowing (trades.scores >= $target)" output_grew "$target"
running "$replayer" || die "the replay ended before the kill: raise KILL_MESSAGES"
docker kill "$cid" >/dev/null
log "docker kill: consumer killed mid-replay at $(end_offsets trades.scores) trades results"
restarted() { running "$cid" && (($(docker inspect --format '{{.RestartCount}}' "$cid") > restarts)); }
if poll 20 restarted; then
  log "ok: the restart policy restarted the consumer"
else
  docker start "$cid" >/dev/null
  log "ok: consumer restarted (docker start)"
fi
wait_for "the kill-phase replayer finished" replayer_done "$replayer"
docker rm "$replayer" >/dev/null
expected=$((expected + KILL_MESSAGES))
check verify --allow-duplicates --expect-inputs "$expected" --timeout-s "$TIMEOUT_S" ||
  die "after docker kill + restart: results missing or commits behind"
log "ok: after docker kill + restart: $expected messages, 0 missing, committed == end offsets"

# --- 4. docker compose stop mid-replay: graceful drain ------------------------------------------
target=$(($(end_offsets trades.scores) + 200))
replayer="$(replay_trades stop "$STOP_MESSAGES")"
wait_for "results flowing (trades.scores >= $target)" output_grew "$target"
grace="$(docker inspect --format '{{.Config.StopTimeout}}' "$cid")"
stop_started=$SECONDS
compose stop streamproc >/dev/null 2>&1
stop_s=$((SECONDS - stop_started))
code="$(docker inspect --format '{{.State.ExitCode}}' "$cid")"
((code == 0 && stop_s < grace)) || die "docker stop: exit code $code after ${stop_s}s (grace ${grace}s)"
log "ok: docker stop mid-replay: graceful drain, exit 0 after ${stop_s}s (grace period ${grace}s)"
wait_for "the stop-phase replayer finished" replayer_done "$replayer"
docker rm "$replayer" >/dev/null
compose start streamproc >/dev/null 2>&1
wait_for "streamproc ready again" ready
expected=$((expected + STOP_MESSAGES))
check verify --allow-duplicates --expect-inputs "$expected" --timeout-s "$TIMEOUT_S" ||
  die "after docker stop + start: results missing or commits behind"
log "ok: after docker stop + start: $expected messages, 0 missing, committed == end offsets"

status=0
