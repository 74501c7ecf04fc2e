# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
# The heavy dependency set (torch is multi-GB) lives in a shared virtual environment keyed by a
# hash of requirements.lock + requirements-dev.lock and the Python version, built once per machine
# and reused by every clone; each clone gets a thin .venv that layers the project (editable) over it.

PYTHON ?= python3.11
CACHE ?= $(or $(STREAMPROC_CACHE_DIR),$(HOME)/.cache/streamproc)
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
DEPS_HASH := $(shell cat requirements.lock requirements-dev.lock | sha256sum | cut -c1-12)-py$(PYVER)
DEPS := $(CACHE)/deps-$(DEPS_HASH)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-$(DEPS_HASH)
PYTEST_ARGS ?=

.PHONY: all venv deps kafka-jars tracing-backend demo bench soak test test-slow lint format clean

all: test

deps: $(DEPS)/.complete

# No file prerequisite: the folder name already carries the hash of both locks.
$(DEPS)/.complete:
	@echo "building the shared dependency environment $(DEPS) (first time only) ..."
	rm -rf "$(DEPS).partial"
	$(PYTHON) -m venv "$(DEPS).partial"
	"$(DEPS).partial/bin/python" -m pip install --quiet --upgrade pip
	"$(DEPS).partial/bin/python" -m pip install --quiet --requirement requirements-dev.lock
	rm -rf "$(DEPS)"
	mv "$(DEPS).partial" "$(DEPS)"
	# a venv's scripts name its own path: re-point them after the move
	grep -rlI "$(DEPS).partial" "$(DEPS)/bin" | xargs -r sed -i "s#$(DEPS).partial#$(DEPS)#g"
	touch "$@"

venv: $(STAMP)

$(STAMP): $(DEPS)/.complete pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv --without-pip $(VENV)
	echo "import site; site.addsitedir('$$(ls -d $(DEPS)/lib/python*/site-packages)')" \
	  > "$$(ls -d $(VENV)/lib/python*/site-packages)/streamproc-deps.pth"
	PYTHONWARNINGS=ignore "$(DEPS)/bin/python" -m pip --python $(PY) install --quiet --no-deps \
	  --no-build-isolation --editable . 2>&1 | grep -v -e '^ *$$' -e Warning -e '!!' -e '\*\*\*' \
	  -e 'Please be careful' -e 'name as your package' -e 'with strategy' || true
	$(PY) -c "import streamproc"
	touch $@

kafka-jars: venv
	$(PY) -c "from streamproc.tools.kafka_local import ensure_kafka_jars; print(ensure_kafka_jars())"

# The local trace backend (streamproc tracing start): Zipkin's jar (Maven Central) and the
# OpenTelemetry Collector (built with Go once, about 100 s); cached under $(CACHE).
tracing-backend: venv
	$(PY) -c "from streamproc.tools.tracing_local import ensure_collector, ensure_zipkin_jar; \
	print(ensure_zipkin_jar()); print(ensure_collector())"

demo: venv kafka-jars
	$(VENV)/bin/streamproc demo

# ruff, then mypy --strict over streamproc and benchmarks (settings and per-module exceptions:
# [tool.mypy] in pyproject.toml).
lint: venv
	$(DEPS)/bin/ruff check streamproc tests benchmarks examples scripts
	$(DEPS)/bin/ruff format --check streamproc tests benchmarks examples scripts
	$(DEPS)/bin/mypy

format: venv
	$(DEPS)/bin/ruff check --fix streamproc tests benchmarks examples scripts
	$(DEPS)/bin/ruff format streamproc tests benchmarks examples scripts

# The tiers (tests/support/tiers.py; docs/testing.md): every test belongs to exactly one, named
# by a marker on its module (or its folder's default); the collection fails on a test without
# one. Each tier is one target below; .ci/run runs every tier CI runs, each step timed.
# run_tier(marker expression, name): pytest of that tier writing .streamproc/junit/<name>.xml,
# then its 10 slowest tests and the time per folder (scripts/test_durations.py), pass or fail.
# pytest's exit 5 (the tier selected no test) fails the target: an empty tier is a bug.
JUNIT_DIR := .streamproc/junit
define run_tier
	@mkdir -p $(JUNIT_DIR)
	status=0; $(PY) -m pytest -m "$(1)" --junitxml=$(JUNIT_DIR)/$(2).xml $(PYTEST_ARGS) \
	  || status=$$?; \
	$(PY) scripts/test_durations.py $(JUNIT_DIR)/$(2).xml --slowest 10 || true; exit $$status
endef

.PHONY: test-models test-registry test-failures test-workloads
# The fast loop: lint, then the core tier (unit tests, deployment checks, the core guarantees on
# a real broker); the gpu tier too where torch sees CUDA (elsewhere it is not collected).
test: venv kafka-jars tracing-backend lint tools
	$(call run_tier,core or gpu,core)

# Model versions on a real broker: folder and MLflow sources, live swaps, refusals, rollbacks,
# shadow scoring, the admin endpoint, models that fail.
test-models: venv kafka-jars
	$(call run_tier,models,models)

# Schema-managed topics on a real Schema Registry (Apicurio), a 20-s registry outage included.
test-registry: venv kafka-jars
	$(call run_tier,registry,registry)

# Delivery guarantees under failure: crashes, lost assignments, idle exits, scenarios.
test-failures: venv kafka-jars
	$(call run_tier,failures,failures)

# Every built-in workload together in one process; precision agreement with fp32.
test-workloads: venv kafka-jars
	$(call run_tier,workloads,workloads)

# Deployment tooling (helm, kubeconform, hadolint, schemas) under $(CACHE)/tools; see deploy/tools.sh.
.PHONY: tools lint-deploy shellcheck compose-test images engine
tools:
	PYTHON=$(PYTHON) STREAMPROC_CACHE_DIR=$(CACHE) deploy/tools.sh >/dev/null

lint-deploy: tools
	PYTHON=$(PYTHON) STREAMPROC_CACHE_DIR=$(CACHE) deploy/lint.sh

# shellcheck (pinned) on every shell script of the repository; the one list: deploy/shellcheck.sh.
shellcheck: tools
	PYTHON=$(PYTHON) STREAMPROC_CACHE_DIR=$(CACHE) deploy/shellcheck.sh

# A Docker engine with the compose v2 plugin: installed and started when missing (root on Debian),
# otherwise named (deploy/engine.sh).
engine:
	deploy/engine.sh

# Every image of the compose stack built locally, no registry needed (deploy/images/build.sh):
# streamproc/python:3.11-bookworm, streamproc/kafka:4.4.0, streamproc/prometheus:2.42, streamproc:cpu.
images: venv kafka-jars engine
	PYTHON=$(PYTHON) deploy/images/build.sh

# The whole stack end to end on a real engine (deploy/compose/compose-test.sh): sets up the engine
# and the images first.
compose-test: venv kafka-jars engine
	PYTHON=$(PYTHON) deploy/compose/compose-test.sh

# The Helm chart on a real single-node Kubernetes cluster built from source (root, Docker for the
# images, set up when missing): install, replay, crash, roll, scale, probes, exactly-once, KEDA
# (deploy/k8s/k8s-test.sh). K8S_CHECKS=ci: the subset .ci/run runs.
.PHONY: k8s-test
k8s-test: venv kafka-jars tools engine
	PY=$(PY) PYTHON=$(PYTHON) STREAMPROC_CACHE_DIR=$(CACHE) deploy/k8s/k8s-test.sh

bench: venv kafka-jars
	$(VENV)/bin/streamproc bench

# Precision per built-in workload: agreement with fp32 on the held-out data, model-only speed
# (benchmarks/precision.py; docs/models.md "Precision"). No Kafka; 63 s measured on 2 cores.
.PHONY: precision decode-workers
precision: venv
	$(PY) benchmarks/precision.py

# Self-sizing decode workers against fixed counts on the video frames (a local broker unless
# KAFKA_BOOTSTRAP_SERVERS is set; benchmarks/decode_workers.py; docs/benchmarks.md). 977 s measured.
decode-workers: venv kafka-jars
	$(PY) benchmarks/decode_workers.py

# Priority isolation: trades (high) P99 alone and while a 1,480-frame video (low) backlog drains in
# the same consumer, 5 runs (benchmarks/priority_isolation.py; docs/benchmarks.md). ~12 min per
# checkout; compare with another checkout by PRIORITY_ARGS="--checkout before=DIR --checkout after=.".
PRIORITY_ARGS ?=
.PHONY: priority-isolation
priority-isolation: venv kafka-jars
	$(PY) -m benchmarks.priority_isolation $(PRIORITY_ARGS)

# Rebalance gaps: the longest stretch without results per partition during scale 1 -> 3, a rolling
# restart and scale 3 -> 1, classic vs consumer group protocol, with and without static membership
# (benchmarks/rebalance_gaps.py; docs/operations.md "Rebalances and scaling"). ~14 min per run.
GAPS_ARGS ?= --runs 2
# Overload: trades and iot offered at 2x their capacity for 60 s with a deadline, then at 50 %;
# every input accounted for from the broker, goodput, the served records' P99, the recovery
# (benchmarks/overload.py; docs/benchmarks.md "Overload"). ~3 min per workload and run.
OVERLOAD_ARGS ?= --runs 5
.PHONY: bench-overload
bench-overload: venv kafka-jars
	$(PY) -m benchmarks.overload $(OVERLOAD_ARGS)

.PHONY: rebalance-gaps
rebalance-gaps: venv kafka-jars
	$(PY) benchmarks/rebalance_gaps.py $(GAPS_ARGS)

# Decode CPU per message of the value formats: JSON, Avro, Protobuf, JSON Schema, and the stock deserialisers
# (benchmarks/formats.py; docs/benchmarks.md "Value formats"). No Kafka, no registry; ~1 min.
.PHONY: bench-formats
bench-formats: venv
	$(PY) benchmarks/formats.py

# Past the partition count: 6 processes on a 2-partition video topic (a slow model) as a consumer
# group and as a share group, alternating (benchmarks/share_groups.py; docs/operations.md
# "Share groups"). ~2 min per mode and repetition.
SHARE_ARGS ?= --reps 5
.PHONY: bench-share
bench-share: venv kafka-jars
	$(PY) -m benchmarks.share_groups $(SHARE_ARGS)

# What tracing costs per message: off, a checkout without tracing (TRACING_ARGS=--without DIR),
# 1 % of batches traced, every batch, every record with a context of its own; trades and iot,
# alternating (benchmarks/tracing_cost.py; docs/benchmarks.md "Tracing"). ~40 min with --without.
TRACING_ARGS ?=
.PHONY: bench-tracing
bench-tracing: venv kafka-jars tracing-backend
	$(PY) -m benchmarks.tracing_cost $(TRACING_ARGS)

# docs/images/trace.png: one traced round trip opened in Zipkin's UI by headless Chromium
# (Debian's chromium package, installed here when missing: root). ~1 min.
.PHONY: trace-screenshot
trace-screenshot: venv kafka-jars tracing-backend
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(PY) scripts/trace_screenshot.py

.PHONY: bench-models
bench-models: venv kafka-jars
	$(PY) benchmarks/model_swap.py

# A 5-minute paced soak: consumer RSS must stay within +-5 % (benchmarks/soak.py).
soak: venv kafka-jars
	$(PY) benchmarks/soak.py

# The GPU check (benchmarks/gpu_check.sh; docs/operations.md "The GPU check"): on a lent GPU
# machine (its own Python 3.12 and CUDA torch, no registry), over the machine's torch and the
# wheels of `make gpu-bundle`; here GPU_CHECK_ARGS="--device cpu" runs it on two logical CPU
# devices over the bundle's cp311 wheels (make gpu-dry-run: with no registry, carried files only).
GPU_CHECK_ARGS ?=
GPU_BUNDLE := .gpu-bundle
.PHONY: gpu-check gpu-bundle gpu-dry-run
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

# .gpu-bundle/ (ignored): what the check imports besides the machine's torch, numpy, pillow and
# torchvision (benchmarks/gpu_bundle.py), pinned from requirements.lock, as wheels for the GPU
# machine's Python 3.12 (cp312/, carried there) and this machine's 3.11 (cp311/, the dry run);
# and the frames file (no PyAV there). Needs the registries; rebuilt whole each time.
GPU_BUNDLE_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 \
  manylinux_2_5_x86_64 manylinux1_x86_64,--platform $(p))
gpu-bundle: deps
	rm -rf $(GPU_BUNDLE).partial
	mkdir -p $(GPU_BUNDLE).partial
	PYTHONPATH=. $(DEPS)/bin/python -m benchmarks.gpu_bundle requirements \
	  > $(GPU_BUNDLE).partial/requirements.txt
	for v in 3.12 3.11; do \
	  $(DEPS)/bin/python -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
	    --python-version $$v $(GPU_BUNDLE_PLATFORMS) --dest $(GPU_BUNDLE).partial/cp$$(echo $$v | tr -d .) \
	    --requirement $(GPU_BUNDLE).partial/requirements.txt || exit 1; \
	done
	PYTHONPATH=. $(DEPS)/bin/python -m benchmarks.gpu_bundle frames $(GPU_BUNDLE).partial/frames.bin
	rm -rf $(GPU_BUNDLE)
	mv $(GPU_BUNDLE).partial $(GPU_BUNDLE)
	du -sh $(GPU_BUNDLE)/cp312 $(GPU_BUNDLE)/cp311 $(GPU_BUNDLE)/frames.bin

# The CPU dry run of the GPU machine's command (benchmarks/gpu_dry_run.sh): the tracked tree and
# the bundle copied to a scratch folder, no registry, a Python that sees only the machine's
# packages (torch & co. linked from the shared environment), `bash benchmarks/gpu_check.sh
# --device cpu --smoke` there; fails when tree + bundle pass the 64 MiB the device tool carries.
gpu-dry-run: deps
	DEPS=$(DEPS) bash benchmarks/gpu_dry_run.sh

# Long failure scenarios (not in CI).
test-slow: venv kafka-jars
	$(call run_tier,slow,slow)

# The guarantee tests on the real broker (tests/integration, every test but the several-device
# ones, which cannot fuse) twice: every lane fused (worker.fused_lane: always), then every lane
# staged (never); the environment variable overrides each test's own config, its subprocesses'
# too. `make test` runs them once, with the default (auto: fused on a CPU).
.PHONY: test-lanes
LANES_TESTS ?= tests/integration --ignore=tests/integration/test_devices.py
test-lanes: venv kafka-jars
	STREAMPROC_WORKER__FUSED_LANE=always $(PY) -m pytest -m "not slow and not faults" \
	  $(LANES_TESTS) -p no:cacheprovider $(PYTEST_ARGS)
	STREAMPROC_WORKER__FUSED_LANE=never $(PY) -m pytest -m "not slow and not faults" \
	  $(LANES_TESTS) -p no:cacheprovider $(PYTEST_ARGS)

# The gpu tier (tests/gpu, marker gpu): the CUDA backend for real (a model through the device
# worker on cuda:0 against the CPU, pinned buffers). Collected only where torch sees a CUDA
# device (there `make test` runs it too); elsewhere nothing runs and this target fails
# (pytest: "no tests ran"), so it never counts as passed on a CPU.
.PHONY: test-gpu
test-gpu: venv
	$(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# A three-node local cluster (replication factor 3, min.insync.replicas 2) under faults: leaders,
# the controller and coordinators killed, a broker stalled, two down, a client cut off, a seeded
# random schedule (tests/faults; root for iptables; docs/guarantees.md "Faults"). Replay a
# schedule with FAULTS_SEED=<seed>; FAULTS_SCHEDULE_S sets its length.
# test-faults-ci: the short seeded subset .ci/run runs (the random schedule under both
# guarantees, FAULTS_CI_SCHEDULE_S seconds each, seed FAULTS_CI_SEED; 383 s measured).
.PHONY: test-faults test-faults-ci
FAULTS_CI_SEED ?= 20261202
FAULTS_CI_SCHEDULE_S ?= 120
test-faults: venv kafka-jars
	deploy/packages.sh iptables:iptables
	$(PY) -m pytest -m faults tests/faults -s -p no:cacheprovider $(PYTEST_ARGS)

test-faults-ci: venv kafka-jars
	deploy/packages.sh iptables:iptables
	FAULTS_SEED=$(FAULTS_CI_SEED) FAULTS_SCHEDULE_S=$(FAULTS_CI_SCHEDULE_S) \
	  $(PY) -m pytest -m faults tests/faults/test_faults.py -k random_schedule -s \
	  -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .streamproc
