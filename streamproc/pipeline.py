"""The process: lifecycle (start, run, stop, drain) and health. It builds nothing itself
(:mod:`streamproc.assembly` builds the stages from the config) and holds no stage logic.

Threads of one process (docs/architecture.md lists what each owns and the lock order)::

    source (consumer, rebalances, commits) -> lane rings -> dispatch-<topic> (cut, decode inline
      or on the decode pool, place on a device) -> device-<d> -> completion-<d> (CUDA events;
      on CPU the device thread completes its batches), per device
      -> results-<topic> (back in cut order; encode, produce)
      -> sink (producer poll, delivery reports) -> offset tracker -> source (commits)

    a fused lane (one CPU device; worker.fused_lane): dispatch-<topic> cuts, decodes, runs the
      model, encodes and produces itself (streamproc.dispatch.fusion)

A *pipeline* is one ``pipelines[]`` entry of the config (DESIGN.md's word); the class
:class:`Pipeline` is the process hosting all of them (the name of DESIGN.md's library API).
The stages of one pipeline are a :class:`~streamproc.assembly.TopicStages`.
"""

from __future__ import annotations

import enum
import gc
import threading
import time
from dataclasses import dataclass, field

import torch
from confluent_kafka import Producer

from streamproc.assembly import Intake, Stages, admin_settings, assemble
from streamproc.config import Config
from streamproc.decode.sizing import DecodeSizer
from streamproc.device import DeviceWorker, PoolLeak
from streamproc.errors import FatalPipelineError, RegistryUnavailable
from streamproc.idle import IdleDecision, IdleExit, not_yet_fetched
from streamproc.kafka.admin import (
    cluster_metadata,
    ensure_topics,
    max_message_bytes,
    partition_count,
)
from streamproc.kafka.clients import build_admin
from streamproc.kafka.protocols import AdminFactory, ConsumerFactory, ProducerFactory
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.outcomes import RunCounts
from streamproc.offsets.tracker import OffsetTracker
from streamproc.share.source import ShareSource, set_start_offset

log = get_logger(__name__)


LAG_WAKE_INTERVAL_S = 1.0
"""While ``--exit-when-idle-s`` waits for the lag monitor to measure partitions that delivered
nothing, or the group's committed offsets, it wakes the monitor at most this often (each
refresh is a few requests per partition)."""
MODEL_THREAD_JOIN_S = 5.0
"""Longest a drain waits for a model thread's load in progress (it is a daemon: a load that
takes longer ends with the process; what it would offer is never switched to)."""


_MEASURE = (IdleDecision.UNFETCHED, IdleDecision.GROUP_BEHIND)
"""The idle-exit verdicts that wait for a measurement of the lag monitor."""


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass
class RunSummary:
    """What one run did. ``batch_sizes`` maps batch size -> number of batches, per topic;
    ``device_batches`` maps device label -> batches placed on it, per topic; ``outcomes``
    maps input topic -> records read (and read again) and produced, counted as readers of
    the topics see them (:mod:`streamproc.offsets.outcomes`)."""

    exit_code: int
    elapsed_s: float
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    error: str | None = None
    device_batches: dict[str, dict[str, int]] = field(default_factory=dict)
    outcomes: dict[str, RunCounts] = field(default_factory=dict)


class Pipeline:
    """The consumer process: one lane per ``pipelines[]`` entry, sharing one consumer, the
    devices and one sink.

    Usage::

        pipeline = Pipeline(load_config("config.yaml"))
        summary = pipeline.run(exit_when_idle_s=5)   # or until request_stop()

    Args:
        config: the validated config.
        consumer_factory: builds the consumer (default: ``confluent_kafka.Consumer``, or
            ``confluent_kafka.ShareConsumer`` with ``kafka.group_type: share``).
        producer_factory: builds the producers (default: ``confluent_kafka.Producer``).
        admin_factory: builds the admin clients (start-up topic checks).

    Attributes:
        stages: every stage, built (:class:`~streamproc.assembly.Stages`).
        state: the lifecycle state.
        leaks: what the leak check at close found missing (empty after a clean close).

    Raises:
        ConfigError: librdkafka refused a setting under ``kafka.consumer``/``kafka.producer``,
            or a model refused its precision.
    """

    def __init__(
        self,
        config: Config,
        consumer_factory: ConsumerFactory | None = None,
        producer_factory: ProducerFactory = Producer,
        admin_factory: AdminFactory = build_admin,
    ) -> None:
        self.config = config
        self.state = State.CREATED
        self.leaks: tuple[PoolLeak, ...] = ()
        self._admin_factory = admin_factory
        self._stop = threading.Event()
        self._quieting = False  # a share member found idle stopped taking records
        self._fatal: BaseException | None = None
        # torch's intra-op thread count is process-wide: set for this pipeline's life (before
        # the models are built) and restored at close, or here if building fails (an embedding
        # application, or a benchmark's next contender, gets its own setting back).
        self._torch_threads_before = torch.get_num_threads()
        if config.worker.torch_threads:
            torch.set_num_threads(config.worker.torch_threads)
        probes = (self.liveness, self.readiness)
        try:
            self.stages: Stages = assemble(
                config, self._on_fatal, *probes, consumer_factory, producer_factory
            )
        except BaseException:
            torch.set_num_threads(self._torch_threads_before)
            raise

    # -- the stages embedders, tools and tests read ------------------------------------------
    @property
    def metrics(self) -> Metrics:
        return self.stages.shared.metrics

    @property
    def tracker(self) -> OffsetTracker:
        return self.stages.shared.tracker

    @property
    def source(self) -> Intake:
        return self.stages.source

    @property
    def decode_sizer(self) -> DecodeSizer:
        return self.stages.shared.decoding.sizer

    @property
    def workers(self) -> list[DeviceWorker]:
        """Every device worker, by pipeline, then device."""
        return self.stages.workers

    # -- lifecycle -------------------------------------------------------------------------
    def _on_fatal(self, exc: BaseException) -> None:
        if isinstance(exc, RegistryUnavailable) and self.state is State.DRAINING:
            # the drain gave up a lookup waiting for an unreachable Schema Registry: those
            # records stay uncommitted and are read again after a restart; not a failure
            log.warning("draining: records waiting for the schema registry left uncommitted",
                        error=str(exc))  # fmt: skip
            return
        if self._fatal is None:
            self._fatal = exc
            log.error("fatal error; stopping", error=repr(exc))
        self._stop.set()

    def request_stop(self) -> None:
        """Ask :meth:`run` to drain and return (thread- and signal-safe)."""
        self._stop.set()

    def start(self) -> None:
        """Start every thread (sink, workers, dispatchers, then the source)."""
        if self.state is not State.CREATED:
            raise RuntimeError(f"cannot start a pipeline in state {self.state.value}")
        stages = self.stages
        self._prepare_topics()
        if stages.http is not None:
            stages.http.start()
        stages.shared.decoding.start()
        stages.lag.start()
        stages.shared.sink.start()
        for worker in stages.workers:
            worker.start()
        for topic in stages.topics:
            topic.resequencer.start()
            topic.calibrate()
        for dispatcher in stages.dispatchers:
            dispatcher.start()
        stages.source.start()
        for manager in stages.managers:
            manager.start()
        # Everything alive now (torch, the models, the clients) lives as long as the process:
        # move it out of the cyclic collector's reach, so a full collection scans only what the
        # stream allocates (a gen-2 collection pauses every thread; docs/benchmarks-history.md).
        gc.collect()
        gc.freeze()
        self.state = State.RUNNING
        log.info(
            "pipeline running",
            devices=[d.label for d in stages.shared.devices],
            topics=[p.input_topic for p in self.config.pipelines],
        )

    def _prepare_topics(self) -> None:
        """Fail fast when the cluster is unreachable; create missing output and DLQ topics;
        learn the output and dead-letter topics' record size limits; a share group's start
        offset (``share.auto.offset.reset``) from ``kafka.auto_offset_reset``."""
        admin_config = admin_settings(self.config)
        kafka = self.config.kafka
        timeout_s = kafka.startup_timeout_s
        factory = self._admin_factory
        metadata = cluster_metadata(admin_config, timeout_s, factory)
        if kafka.group_type == "share":
            set_start_offset(
                factory(admin_config), kafka.group_id, kafka.auto_offset_reset, timeout_s
            )
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
        self.stages.shared.sink.set_topic_limits(
            max_message_bytes(admin_config, sorted(limited), timeout_s, factory)
        )

    # -- health ------------------------------------------------------------------------------
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
        """``/readyz``: running, owning at least one partition (a share group: a member of
        it), and no device holding a batch because its model is judged broken
        (:mod:`streamproc.device.hold`)."""
        if self.state is not State.RUNNING:
            return False, self.state.value
        assignment = self.source.assignment
        if assignment.unassigned is not None:
            return False, "no partitions assigned"
        held = [f"{w.label}: {w.hold.held}" for w in self.workers if w.hold.held is not None]
        if held:
            return False, "batch held, the model is judged broken: " + "; ".join(held)
        if self.config.kafka.group_type == "share":
            return True, f"share group member ({len(assignment.assigned)} partitions read)"
        return True, f"{len(assignment.assigned)} partitions assigned"

    def idle(self) -> bool:
        """Nothing waiting in rings, nothing in flight, nothing awaiting acknowledgement, and
        nothing done but not yet committed (under exactly-once an input is done when its
        result joins the transaction, and a transaction that aborts sends it back)."""
        return (
            self.tracker.total_pending() == 0
            and not self.tracker.commit_candidates()
            and all(w.idle() for w in self.workers)
        )

    # -- run ---------------------------------------------------------------------------------
    def run(self, exit_when_idle_s: float | None = None) -> RunSummary:
        """Run until :meth:`request_stop`, a fatal error, or ``exit_when_idle_s`` seconds with
        no new input, no rebalance and nothing in flight while partitions are assigned; then
        close. Returns the summary (exit code 0 or 1).

        With ``exit_when_idle_s``, time with no partition assigned is never idle (before the
        first assignment, after the group lost its partitions, after a rebalance revoked the
        last one; see :mod:`streamproc.idle`): if none is assigned for
        ``kafka.assignment_timeout_s`` the run stops with exit code 1 and says why, instead
        of exiting 0 with input left behind. Nor is this member's idleness enough: exit 0
        also needs the group's committed offset at the end offset of every partition of the
        input topics (the lag monitor measures them); a group behind with no committed offset
        moving for ``kafka.assignment_timeout_s`` stops the run with exit code 1 naming the
        partitions and their lag.
        """
        started_s = time.monotonic()
        if self.state is State.CREATED:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        if exit_when_idle_s is None:
            while not self._stop.wait(0.1):
                continue
        else:
            kafka = self.config.kafka
            whole_group = kafka.group_type == "consumer"
            if whole_group:
                topics = [p.input_topic for p in self.config.pipelines]
                self.stages.lag.watch_group(topics, kafka.auto_offset_reset)
            timeout_s = kafka.assignment_timeout_s
            self._run_until_idle(IdleExit(exit_when_idle_s, timeout_s, started_s, whole_group))
        self.close()
        fatal = self._fatal
        return RunSummary(
            exit_code=0 if fatal is None else 1,
            elapsed_s=time.monotonic() - started_s,
            batch_sizes={d.topic: dict(d.batch_sizes) for d in self.stages.dispatchers},
            error=None if fatal is None else f"{type(fatal).__name__}: {fatal}",
            device_batches={t.topic: t.load.batches() for t in self.stages.topics},
            outcomes=self.outcomes(),
        )

    def outcomes(self) -> dict[str, RunCounts]:
        """Per input topic: records read (and read again) and produced so far, counted as
        readers of the topics see them (:mod:`streamproc.offsets.outcomes`)."""
        metrics, guarantee = self.metrics, self.stages.shared.guarantee
        return {
            spec.input_topic: RunCounts(
                round(metrics.counter_value(metrics.consumed, topic=spec.input_topic)),
                round(metrics.counter_value(metrics.read_again, topic=spec.input_topic)),
                guarantee.produced(metrics, spec),
                round(metrics.counter_value(metrics.share_redelivered, topic=spec.input_topic)),
            )
            for spec in self.config.pipelines
        }

    def _run_until_idle(self, watch: IdleExit) -> None:
        """Wait for a stop, a fatal error or the idle exit, asking ``watch`` every 0.1 s."""
        source, config = self.source, self.config
        next_wake_s = 0.0
        while not self._stop.wait(0.1):
            now_s = time.monotonic()
            # single-attribute reads of what the source and lag threads publish
            unassigned = source.assignment.unassigned
            last_input_s = source.last_input_s
            last_rebalance_s = source.assignment.last_rebalance_s
            empty_at = self.stages.lag.empty_at
            unfetched = not_yet_fetched(source.positions(), empty_at, last_rebalance_s)
            group = self.stages.lag.group
            verdict = watch.check(
                now_s, unassigned, last_input_s, last_rebalance_s, unfetched, self.idle, group
            )
            if verdict is IdleDecision.UNASSIGNED_TOO_LONG:
                assert unassigned is not None
                topics = [p.input_topic for p in config.pipelines]
                self._on_fatal(watch.error(unassigned, config.kafka.group_id, topics))
            elif verdict is IdleDecision.GROUP_BEHIND_TOO_LONG:
                self._on_fatal(watch.group_error(config.kafka.group_id))
            elif verdict in _MEASURE and now_s >= next_wake_s:
                self.stages.lag.wake()  # measure now, not in metrics.lag_interval_s
                next_wake_s = now_s + LAG_WAKE_INTERVAL_S
            elif verdict is IdleDecision.IDLE:
                if not self._share_member_quiet():
                    continue
                quiet_s = now_s - max(last_input_s, last_rebalance_s)
                log.info("idle; exiting", idle_s=round(quiet_s, 1))
                return

    def _share_member_quiet(self) -> bool:
        """Whether a member found idle may exit now. A consumer group's may (what a poll
        returned meanwhile stays uncommitted: read again). A share member first stops taking
        records and runs what it already acquired: a poll that returned between the idle check
        and the drain would otherwise be released at the stop, and with every member of the
        group exiting the same way, be left to no one (measured: 13 of 960 records left)."""
        source = self.source
        if not isinstance(source, ShareSource):
            return True
        if source.fetching:
            if not self._quieting:
                source.stop_fetching()
                self._quieting = True
            return False  # the source thread takes the request between polls
        return source.in_flight == 0

    # -- stop and drain ------------------------------------------------------------------------
    def close(self) -> None:
        """Drain and stop; idempotent.

        Steps:
            1. stop fetching (pause all partitions; the consumer keeps polling);
            2. close the acknowledgement windows (results no longer wait for acknowledgements:
               intake has stopped), stop the model threads (no version is loaded from then on)
               and the dispatchers (records still in rings stay uncommitted);
            3. let the device workers finish their in-flight batches, and the resequencers
               hand their results over in cut order (what waits behind a batch that never
               completed is dropped, uncommitted);
            4. leak check: every staging slab and output buffer set must be back in its pool;
               an error log names each pool missing some (count and the batches holding
               them); ``streamproc_pool_leaked_buffers{topic,pool}`` and :attr:`leaks` say
               the same (0 / empty after a clean close);
            5. flush the producer, so every acknowledgement reaches the tracker;
            6. commit the final watermarks and close the consumer (leave the group);
            7. stop the lag monitor, the HTTP endpoint, the sink, the trace export (what is
               queued is exported first), the decode sizer and the decode workers.
        """
        if self.state in (State.CLOSED, State.DRAINING):
            return
        try:
            if self.state is State.CREATED:
                self._close_unstarted()
            else:
                self._drain()
        finally:
            # process-wide: handed back even if a close step raised (set in __init__)
            torch.set_num_threads(self._torch_threads_before)

    def _close_unstarted(self) -> None:
        """Never started: just release the clients, the HTTP port and the decode workers."""
        stages = self.stages
        stages.source.close(0.0)
        stages.shared.sink.close(1.0)
        if stages.http is not None:
            stages.http.close()
        self._close_shared()
        self.state = State.CLOSED

    def _drain(self) -> None:
        """The steps of :meth:`close` for a started pipeline."""
        stages = self.stages
        self.state = State.DRAINING
        timeout_s = self.config.shutdown_timeout_s
        log.info("draining", shutdown_timeout_s=timeout_s)
        deadline_s = time.monotonic() + timeout_s

        def left_s(at_least_s: float = 0.1) -> float:
            return max(at_least_s, deadline_s - time.monotonic())

        # Step 1
        stages.source.stop_fetching()
        if stages.shared.schemas is not None:
            stages.shared.schemas.abandon()  # lookups waiting for an unreachable registry end
        # Step 2
        for topic in stages.topics:  # intake stopped: results no longer wait for their acks
            if topic.window is not None:
                topic.window.close()
        for manager in stages.managers:
            manager.stop(min(left_s(), MODEL_THREAD_JOIN_S))  # no new version while draining
        for dispatcher in stages.dispatchers:
            dispatcher.stop(left_s())
        # Step 3
        for worker in stages.workers:
            worker.close(left_s())
        for topic in stages.topics:
            topic.resequencer.close(left_s())
        # Step 4
        self.leaks = tuple(leak for t in stages.topics for leak in t.leak_check(self.metrics))
        # Step 5
        left = stages.shared.sink.flush(left_s())
        if left:
            log.warning("producer flush timed out; those inputs stay uncommitted", left=left)
        # Step 6
        stages.source.close(left_s(1.0))
        # Step 7
        stages.lag.close()
        if stages.http is not None:
            stages.http.close()
        stages.shared.sink.close(1.0)
        self._close_shared(left_s(1.0))
        # Hand the start-up objects back to the collector, so interpreter shutdown (or a next
        # pipeline in this process) finalises them normally.
        gc.unfreeze()
        self.state = State.CLOSED
        if isinstance(self._fatal, FatalPipelineError):
            log.error("pipeline stopped", error=str(self._fatal))

    def _close_shared(self, timeout_s: float | None = None) -> None:
        if self.stages.shared.schemas is not None:
            self.stages.shared.schemas.close()  # lookups waiting for the registry give up
        if self.stages.shared.tracing is not None:  # the spans queued are exported
            self.stages.shared.tracing.shutdown(timeout_s)
        self.stages.shared.decoding.close()
        for topic in self.stages.topics:
            topic.staging.close()
