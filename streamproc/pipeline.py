"""Wiring and lifecycle: builds the stages from the config and runs them. No stage logic here.

Threads of one process (docs/architecture.md lists what each owns and the lock order)::

    source (consumer, rebalances, commits) -> lane rings -> dispatch-<topic> (cut, decode inline
      or on the decode pool, place on a device) -> device-<d> -> completion-<d> (CUDA events;
      on CPU the device thread completes its batches), per device
      -> results-<topic> (back in cut order; encode, produce)
      -> sink (producer poll, delivery reports) -> offset tracker -> source (commits)

A *pipeline* is one ``pipelines[]`` entry of the config (DESIGN.md's word); the class
:class:`Pipeline` is the process hosting all of them (the name of DESIGN.md's library API). The
runtime of one pipeline is a :class:`~intake.lane.Lane` with its dispatcher, device workers
and result handler.
"""

from __future__ import annotations

import enum
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from confluent_kafka import Consumer, Producer

from streamproc.config import Config, PipelineConfig, Scalar
from streamproc.decode import (
    DecodeProcesses,
    Decoder,
    DecodeRoutePolicy,
    DecodeSizer,
    DecodeSizingPolicy,
    DecodeThreads,
    LaneSpec,
    ProcessDecoder,
    ThreadDecoder,
)
from streamproc.device import (
    DeviceResult,
    DeviceWorker,
    PoolLeak,
    Release,
    Resequencer,
    StagingPool,
)
from streamproc.device.admission import DeviceAdmission
from streamproc.device.dispatch import Dispatcher
from streamproc.device.placement import DeviceLoad
from streamproc.device.precision import build_model
from streamproc.device.recovery import Outcome
from streamproc.device.selection import DeviceSpec, select_devices
from streamproc.device.staging import report_leaks
from streamproc.errors import FatalPipelineError
from streamproc.health import HealthServer
from streamproc.idle import IdleExit, Verdict
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import PartitionBuffers
from streamproc.intake.source import Source
from streamproc.kafka.admin import (
    cluster_metadata,
    ensure_topics,
    max_message_bytes,
    partition_count,
)
from streamproc.kafka.clients import build_admin
from streamproc.kafka.lag import LagMonitor
from streamproc.kafka.protocols import AdminFactory, ConsumerFactory, ProducerFactory
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce, ExactlyOnce, Guarantee
from streamproc.offsets.tracker import OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.output.producer import build_producer, producer_settings
from streamproc.output.results import ResultHandler
from streamproc.output.sink import Sink
from streamproc.records import Priority, TopicPartition
from streamproc.workloads import ModelFn, Workload, load_workload

log = get_logger(__name__)


LAG_WAKE_INTERVAL_S = 1.0
"""While ``--exit-when-idle-s`` waits for the lag monitor to measure partitions that delivered
nothing, it wakes the monitor at most this often (each refresh is two admin requests)."""


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass
class RunSummary:
    """What one run did. ``batch_sizes`` maps batch size -> number of batches, per topic;
    ``device_batches`` maps device label -> batches placed on it, per topic."""

    exit_code: int
    elapsed_s: float
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    error: str | None = None
    device_batches: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _LaneStages:
    """The stages built for one lane (one ``pipelines[]`` entry): one device worker per
    device, and the placement state and resequencer they share."""

    lane: Lane
    decoder: Decoder
    pool: StagingPool
    workers: tuple[DeviceWorker, ...]
    load: DeviceLoad
    resequencer: Resequencer


class Pipeline:
    """The consumer process: one lane per ``pipelines[]`` entry, sharing one consumer, device
    and sink.

    Usage::

        pipeline = Pipeline(load_config("config.yaml"))
        summary = pipeline.run(exit_when_idle_s=5)   # or until request_stop()

    Args:
        config: the validated config.
        consumer_factory: builds the consumer (default: ``confluent_kafka.Consumer``).
        producer_factory: builds the producers (default: ``confluent_kafka.Producer``).
        admin_factory: builds the admin clients (start-up topic checks).

    Raises:
        ConfigError: librdkafka refused a setting under ``kafka.consumer``/``kafka.producer``.
    """

    def __init__(
        self,
        config: Config,
        consumer_factory: ConsumerFactory = Consumer,
        producer_factory: ProducerFactory = Producer,
        admin_factory: AdminFactory = build_admin,
    ) -> None:
        self.config = config
        self._admin_factory = admin_factory
        self.state = State.CREATED
        self.metrics = Metrics()
        self.tracker = OffsetTracker(on_late=self._late_results)
        self.devices: tuple[DeviceSpec, ...] = select_devices(
            config.worker.device, config.worker.devices
        )
        self.device = self.devices[0].device  # the first device (kept for single-device users)
        # torch's intra-op thread count is process-wide: set for this pipeline's life and
        # restored at close (an embedding application, or a benchmark's next contender,
        # gets its own setting back).
        self._torch_threads_before = torch.get_num_threads()
        if config.worker.torch_threads:
            torch.set_num_threads(config.worker.torch_threads)
        self._stop = threading.Event()
        self._fatal: BaseException | None = None
        # Decode workers, shared by every lane, sized between the configured bounds.
        low, high = config.worker.decode_workers_bounds
        start = config.worker.decode_workers_start
        self._decode_threads: DecodeThreads | None = None
        self._decode_processes: DecodeProcesses | None = None
        decode_pool: DecodeThreads | DecodeProcesses
        if config.worker.decode_mode == "process":
            decode_pool = self._decode_processes = DecodeProcesses(start)
        else:
            decode_pool = self._decode_threads = DecodeThreads(start)
        self.decode_sizer = DecodeSizer(
            decode_pool, DecodeSizingPolicy(low, high, start), self.metrics
        )
        self.pools: list[StagingPool] = []
        settings = producer_settings(
            {"bootstrap.servers": config.bootstrap_servers, **config.kafka.producer},
            config.transactional_id if config.exactly_once else None,
        )
        producer = build_producer(settings, producer_factory)
        # The processing guarantee, chosen once: the source and the sink never branch on it.
        self.guarantee: Guarantee = (
            ExactlyOnce(
                self.tracker,
                self.metrics,
                Transactions(producer, renew=lambda: self.sink.renew_producer()),
                max_aborts=config.kafka.max_transaction_aborts,
            )
            if config.exactly_once
            else AtLeastOnce(self.tracker, self.metrics)
        )
        self.sink = Sink(
            producer,
            settings,
            self.guarantee,
            self.metrics,
            self._on_fatal,
            producer_factory=producer_factory,
        )
        self.lanes: dict[str, Lane] = {}
        self.workers: list[DeviceWorker] = []
        # One admission order per device across lanes (only where lanes share devices).
        worker = config.worker
        self.admission = (
            DeviceAdmission(worker.priority_max_defer_ms / 1000.0)
            if worker.priority_admission and len(config.pipelines) > 1
            else None
        )
        self.leaks: tuple[PoolLeak, ...] = ()  # what the leak check at close found missing
        self._stages = [self._build_lane(spec) for spec in config.pipelines]
        self.source = Source(
            config,
            self.lanes,
            self.tracker,
            self.guarantee,
            self.metrics,
            self._on_fatal,
            consumer_factory,
        )
        self.dispatchers = [
            Dispatcher(
                stage.lane,
                stage.decoder,
                stage.pool,
                stage.workers,
                stage.load,
                self.source.apply,
                self.metrics,
                self._on_fatal,
            )
            for stage in self._stages
        ]
        self.lag = LagMonitor(
            {"bootstrap.servers": config.bootstrap_servers, **self._security_settings()},
            config.kafka.group_id,
            self.source.positions,
            self.metrics,
            config.metrics.lag_interval_s,
            on_tick=self._tick,
            stall_timeout_s=config.metrics.stall_timeout_s,
        )
        self.http = (
            HealthServer(
                config.metrics.host,
                config.metrics.port,
                self.metrics.registry,
                self.liveness,
                self.readiness,
            )
            if config.metrics.port
            else None
        )

    def _build_lane(self, spec: PipelineConfig) -> _LaneStages:
        """The lane of one ``pipelines[]`` entry, its decoder, staging pool (shared by its
        devices), one device worker per device, their placement state and the resequencer
        with the result handler (its dispatcher is built once the source exists: it hands
        resume decisions to the source)."""
        cfg = self.config
        workload = load_workload(spec.workload, spec.options)
        pool = StagingPool(
            cfg.worker.staging_buffers * len(self.devices),
            cfg.batching.max_batch_size,
            workload.item_shape,
            workload.item_dtype,
            pin=any(d.device.type == "cuda" for d in self.devices),
            shared=self._decode_processes is not None,
        )
        self.pools.append(pool)
        topic = spec.input_topic
        decoder: Decoder
        if self._decode_processes is not None:
            self._decode_processes.register(
                topic,
                LaneSpec(
                    spec.workload,
                    dict(spec.options),
                    pool.shared_names,
                    pool.shape,
                    pool.dtype.str,
                ),
            )
            decoder = ProcessDecoder(
                self._decode_processes,
                topic,
                cfg.worker.max_message_bytes,
                on_sample=self.decode_sizer.observe,
            )
        else:
            assert self._decode_threads is not None
            inline = cfg.worker.decode_inline
            gauge = self.metrics.decode_inline.labels(topic)
            decoder = ThreadDecoder(
                workload,
                self._decode_threads,
                cfg.worker.max_message_bytes,
                lane=topic,
                on_sample=self.decode_sizer.observe,
                route=(
                    DecodeRoutePolicy()
                    if inline == "auto"
                    else ("inline" if inline == "always" else "pool")
                ),
                on_route=lambda route: gauge.set(route == "inline"),
            )
        self.metrics.pool_capacity.labels(topic).set(pool.capacity)
        self.metrics.pool_allocations.labels(topic).set(pool.allocations)
        batching, buf = cfg.batching, cfg.buffers
        lane = self.lanes[topic] = Lane(
            topic,
            PartitionBuffers(buf.ring_capacity, buf.high_watermark, buf.low_watermark),
            Batcher(
                batching.max_batch_size,
                batching.max_batch_bytes,
                batching.max_wait_s,
                adaptive=batching.adaptive_batch_size,
            ),
            self.tracker,
            Priority.parse(spec.priority or workload.default_priority),
        )
        load = DeviceLoad(
            topic,
            [d.label for d in self.devices],
            cfg.worker.max_in_flight_batches,
            cfg.worker.device_stall_timeout_s,
            self.metrics,
        )
        handler = ResultHandler(spec, workload, self.sink, self.metrics, observe=lane.observe)
        resequencer = Resequencer(
            topic, handler, load.released, self._on_fatal, metrics=self.metrics
        )

        def completed(result: DeviceResult, release: Release) -> None:
            load.completed(result.batch.batch_id, result.inference_s)
            resequencer.put(result, release)

        workers = tuple(
            DeviceWorker(
                self._build_model(spec, workload, dev.device),
                dev.device,
                pool,
                cfg.worker.max_in_flight_batches,
                cfg.worker.cuda_streams,
                completed,
                self._on_fatal,
                label=dev.label,
                gate=(
                    None
                    if self.admission is None
                    else self.admission.gate(dev.device, topic, dev.label, self.metrics)
                ),
                on_model_failure=cfg.worker.on_model_failure,
                oom_recovery_s=cfg.worker.oom_recovery_s,
                on_cap=self._cap_reporter(lane, dev.label),
                on_outcome=self._outcome_counter(topic, dev.label),
            )
            for dev in self.devices
        )
        self.workers.extend(workers)
        return _LaneStages(lane, decoder, pool, workers, load, resequencer)

    def _cap_reporter(self, lane: Lane, device: str) -> Callable[[int], None]:
        """A device worker's ``on_cap``: the lane cuts at most the cap; the gauge shows it."""
        gauge = self.metrics.batch_size_cap.labels(lane.topic, device)
        gauge.set(self.config.batching.max_batch_size)

        def report(cap: int) -> None:
            gauge.set(cap)
            lane.cap_batch(device, cap)

        return report

    def _outcome_counter(self, topic: str, device: str) -> Callable[[Outcome], None]:
        """A device worker's ``on_outcome``: counts the re-runs of batches whose model call
        raised."""
        m = self.metrics
        retries = m.model_retry_calls.labels(topic, device)
        isolated = m.model_isolated_rows.labels(topic, device)
        broken = m.model_broken_batches.labels(topic, device)
        out_of_memory = m.device_out_of_memory.labels(topic, device)

        def count(outcome: Outcome) -> None:
            retries.inc(outcome.calls - 1)
            isolated.inc(outcome.isolated)
            broken.inc(outcome.broken)
            out_of_memory.inc(outcome.out_of_memory)

        return count

    def _build_model(
        self, spec: PipelineConfig, workload: Workload, device: torch.device
    ) -> ModelFn:
        """The lane's batch function on ``device`` at its precision (``pipelines[].precision``,
        else ``worker.precision``); refused precisions fail here, at start-up."""
        index = self.config.pipelines.index(spec)
        precision = spec.precision or self.config.worker.precision
        key = "worker.precision" if spec.precision is None else f"pipelines.{index}.precision"
        model = build_model(workload, device, precision, key)
        log.info(
            "model built",
            topic=spec.input_topic,
            workload=workload.name,
            device=str(device),
            precision=precision,
        )
        return model

    def _close_decoders(self) -> None:
        self.decode_sizer.close()
        if self._decode_threads is not None:
            self._decode_threads.shutdown(wait=True, cancel_futures=True)
        if self._decode_processes is not None:
            self._decode_processes.close()
        for pool in self.pools:
            pool.close()

    # -- lifecycle -------------------------------------------------------------------------
    def _on_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            log.error("fatal error; stopping", error=repr(exc))
        self._stop.set()

    def _late_results(self, tp: TopicPartition, count: int, first: bool) -> None:
        """Results for a partition no longer owned (revoked while in flight): produced
        (duplicates under at-least-once), never committed; counted as they happen."""
        self.metrics.late_results.inc(count)
        if first:
            log.warning(
                "late results for a partition no longer owned; produced, not committed "
                "(further ones are counted in streamproc_late_results_total)",
                topic=tp.topic,
                partition=tp.partition,
                results=count,
            )

    def request_stop(self) -> None:
        """Ask :meth:`run` to drain and return (thread- and signal-safe)."""
        self._stop.set()

    def start(self) -> None:
        """Start every thread (sink, workers, dispatchers, then the source)."""
        if self.state is not State.CREATED:
            raise RuntimeError(f"cannot start a pipeline in state {self.state.value}")
        self._prepare_topics()
        if self.http is not None:
            self.http.start()
        if self._decode_processes is not None:
            self._decode_processes.start()
        self.decode_sizer.start()
        self.lag.start()
        self.sink.start()
        for worker in self.workers:
            worker.start()
        for stage in self._stages:
            stage.resequencer.start()
            lane = stage.lane
            if lane.calibrate(stage.workers[0].time_batch):
                log.info("batch size calibrated", topic=lane.topic, target=lane.target)
            if len(stage.workers) > 1:  # one timing per device: the first placements use it
                size = lane.target
                for index, worker in enumerate(stage.workers):
                    stage.load.observe(index, size, worker.time_batch(size))
        for dispatcher in self.dispatchers:
            dispatcher.start()
        self.source.start()
        # Everything alive now (torch, the models, the clients) lives as long as the process:
        # move it out of the cyclic collector's reach, so a full collection scans only what the
        # stream allocates. Measured: one gen-2 collection paused every thread for 96 ms (the
        # P99 of trades at 2,000 msg/s); see docs/benchmarks.md.
        gc.collect()
        gc.freeze()
        self.state = State.RUNNING
        log.info(
            "pipeline running",
            devices=[d.label for d in self.devices],
            topics=[p.input_topic for p in self.config.pipelines],
        )

    def _prepare_topics(self) -> None:
        """Fail fast when the cluster is unreachable; create missing output and DLQ topics;
        learn the output and dead-letter topics' record size limits."""
        admin_config = {
            "bootstrap.servers": self.config.bootstrap_servers,
            **self._security_settings(),
        }
        timeout_s = self.config.kafka.startup_timeout_s
        factory = self._admin_factory
        metadata = cluster_metadata(admin_config, timeout_s, factory)
        if self.config.kafka.create_topics:
            wanted: dict[str, int] = {}
            for spec in self.config.pipelines:
                wanted[spec.output_topic] = partition_count(metadata, spec.input_topic) or -1
                wanted[spec.dead_letter_topic] = 1
            created = ensure_topics(admin_config, wanted, timeout_s, admin_factory=factory)
            if created:
                log.info("created topics", topics=created)
        # the sink measures results and dead-letter records against these before producing
        limited = {
            topic
            for spec in self.config.pipelines
            for topic in (spec.output_topic, spec.dead_letter_topic)
        }
        self.sink.set_topic_limits(
            max_message_bytes(admin_config, sorted(limited), timeout_s, factory)
        )

    def _security_settings(self) -> dict[str, Scalar]:
        return {
            k: v
            for k, v in self.config.kafka.consumer.items()
            if k.startswith(("security.", "sasl.", "ssl.", "client."))
        }

    def _check_pools(self) -> tuple[PoolLeak, ...]:
        """The leak check (close, step 4) over every lane's staging pool and output buffers."""
        leaks: list[PoolLeak] = []
        for stage in self._stages:
            checks = [stage.pool.leak(), *(worker.output_leak() for worker in stage.workers)]
            leaks.extend(report_leaks(stage.lane.topic, checks, self.metrics))
        return tuple(leaks)

    def _tick(self) -> None:
        """Every ``metrics.lag_interval_s`` on the lag thread: GPU gauges, device stalls."""
        self.metrics.sample_gpu()
        for stage in self._stages:
            stage.load.check_stalls()

    def liveness(self) -> tuple[bool, str]:
        """``/healthz``: the poll loop polled recently (a revoke may hold it for a while)."""
        limit_s = max(self.config.metrics.liveness_timeout_s, 2 * self.config.revoke_timeout_s)
        since_s = time.monotonic() - self.source.last_poll_s
        if self.state is State.CLOSED:
            return False, "closed"
        if since_s > limit_s:
            return False, f"poll loop silent for {since_s:.1f} s (limit {limit_s:.0f} s)"
        return True, f"polled {since_s:.2f} s ago"

    def readiness(self) -> tuple[bool, str]:
        """``/readyz``: running and owning at least one partition."""
        if self.state is not State.RUNNING:
            return False, self.state.value
        assigned = self.source.assignment.assigned
        if not assigned:
            return False, "no partitions assigned"
        return True, f"{len(assigned)} partitions assigned"

    def idle(self) -> bool:
        """Nothing waiting in rings, nothing in flight, nothing awaiting acknowledgement, and
        nothing done but not yet committed: under exactly-once an input is done when its
        result joins the transaction, and a transaction that aborts sends it back (an idle
        exit during that abort used to stop with the whole input uncommitted)."""
        return (
            self.tracker.total_pending() == 0
            and not self.tracker.commit_candidates()
            and all(w.idle() for w in self.workers)
        )

    def run(self, exit_when_idle_s: float | None = None) -> RunSummary:
        """Run until :meth:`request_stop`, a fatal error, or ``exit_when_idle_s`` seconds with
        no new input, no rebalance and nothing in flight while partitions are assigned; then
        close. Returns the summary (exit code 0 or 1).

        With ``exit_when_idle_s``, time with no partition assigned is never idle (before the
        first assignment, after the group lost its partitions, after a rebalance revoked the
        last one; see :mod:`streamproc.idle`): if none is assigned for
        ``kafka.assignment_timeout_s`` the run stops with exit code 1 and says why, instead
        of exiting 0 with input left behind.
        """
        started_s = time.monotonic()
        if self.state is State.CREATED:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        watch = (
            None
            if exit_when_idle_s is None
            else IdleExit(exit_when_idle_s, self.config.kafka.assignment_timeout_s, started_s)
        )
        source = self.source
        next_wake_s = 0.0
        while not self._stop.wait(0.1):
            if watch is None:
                continue
            now_s = time.monotonic()
            # single-attribute reads of what the source and lag threads publish
            unassigned = source.assignment.unassigned
            last_input_s = source.last_input_s
            last_rebalance_s = source.assignment.last_rebalance_s
            empty_at = self.lag.empty_at
            unfetched = [
                tp
                for tp, position in source.positions().items()
                if position is None and empty_at.get(tp, -1.0) < last_rebalance_s
            ]
            verdict = watch.check(
                now_s, unassigned, last_input_s, last_rebalance_s, unfetched, self.idle
            )
            if verdict is Verdict.UNASSIGNED_TOO_LONG:
                assert unassigned is not None
                topics = [p.input_topic for p in self.config.pipelines]
                self._on_fatal(watch.error(unassigned, self.config.kafka.group_id, topics))
            elif verdict is Verdict.UNFETCHED and now_s >= next_wake_s:
                self.lag.wake()  # measure those partitions now rather than in lag_interval_s
                next_wake_s = now_s + LAG_WAKE_INTERVAL_S
            elif verdict is Verdict.IDLE:
                quiet_s = now_s - max(last_input_s, last_rebalance_s)
                log.info("idle; exiting", idle_s=round(quiet_s, 1))
                break
        self.close()
        error = None if self._fatal is None else f"{type(self._fatal).__name__}: {self._fatal}"
        return RunSummary(
            exit_code=0 if self._fatal is None else 1,
            elapsed_s=time.monotonic() - started_s,
            batch_sizes={d.topic: dict(d.batch_sizes) for d in self.dispatchers},
            error=error,
            device_batches={stage.lane.topic: stage.load.batches() for stage in self._stages},
        )

    def close(self) -> None:
        """Drain and stop; idempotent.

        Steps:
            1. stop fetching (pause all partitions; the consumer keeps polling);
            2. stop the dispatchers (records still in rings stay uncommitted);
            3. let the device workers finish their in-flight batches, and the resequencers
               hand their results over in cut order (what waits behind a batch that never
               completed is dropped, uncommitted);
            4. leak check: every staging slab and output buffer set must be back in its pool;
               an error log names each pool missing some (count and the batches holding
               them); ``streamproc_pool_leaked_buffers{topic,pool}`` and :attr:`leaks` say
               the same (0 / empty after a clean close);
            5. flush the producer, so every acknowledgement reaches the tracker;
            6. commit the final watermarks and close the consumer (leave the group);
            7. stop the lag monitor, the HTTP endpoint, the sink, the decode sizer and the
               decode workers.
        """
        if self.state in (State.CLOSED, State.DRAINING):
            return
        try:
            self._close()
        finally:
            # process-wide: handed back even if a close step raised (set in __init__)
            torch.set_num_threads(self._torch_threads_before)

    def _close(self) -> None:
        if self.state is State.CREATED:  # never started: just release the clients
            self.source.close(0.0)
            self.sink.close(1.0)
            if self.http is not None:
                self.http.close()
            self._close_decoders()
            self.state = State.CLOSED
            return
        self.state = State.DRAINING
        timeout_s = self.config.shutdown_timeout_s
        log.info("draining", shutdown_timeout_s=timeout_s)
        deadline_s = time.monotonic() + timeout_s
        # Step 1
        self.source.stop_fetching()
        # Step 2
        for dispatcher in self.dispatchers:
            dispatcher.stop(max(0.1, deadline_s - time.monotonic()))
        # Step 3
        for worker in self.workers:
            worker.close(max(0.1, deadline_s - time.monotonic()))
        for stage in self._stages:
            stage.resequencer.close(max(0.1, deadline_s - time.monotonic()))
        # Step 4
        self.leaks = self._check_pools()
        # Step 5
        left = self.sink.flush(max(0.1, deadline_s - time.monotonic()))
        if left:
            log.warning("producer flush timed out; those inputs stay uncommitted", left=left)
        # Step 6
        self.source.close(max(1.0, deadline_s - time.monotonic()))
        # Step 7
        self.lag.close()
        if self.http is not None:
            self.http.close()
        self.sink.close(1.0)
        self._close_decoders()
        # Hand the start-up objects back to the collector, so interpreter shutdown (or a next
        # pipeline in this process) finalises them normally.
        gc.unfreeze()
        self.state = State.CLOSED
        if isinstance(self._fatal, FatalPipelineError):
            log.error("pipeline stopped", error=str(self._fatal))
