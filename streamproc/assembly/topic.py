"""The stages of one pipeline (one ``pipelines[]`` entry, keyed by its input topic), one builder
per stage: staging pool, decoder, lane, placement state, result handler with resequencer, one
device worker (own model instance) per device, the fused route where the lane may run fused
(one CPU device), and the dispatcher that feeds them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import Gauge

from streamproc.assembly.models import VersionedModel, build_versioned_model
from streamproc.assembly.shared import Shared
from streamproc.config import Config
from streamproc.config.sections import PipelineConfig, fused_lane_refusal
from streamproc.decode import Decoder
from streamproc.device import DeviceResult, DeviceWorker, PoolLeak, Release, StagingPool
from streamproc.device.hold import ModelHold
from streamproc.device.recovery import RunOutcome
from streamproc.device.staging import report_leaks
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.fusion import FusedRun, LaneRoute, LaneRoutePolicy
from streamproc.dispatch.placement import DeviceLoad
from streamproc.dispatch.selection import DeviceSpec
from streamproc.errors import ConfigError
from streamproc.intake.batcher import Batcher
from streamproc.intake.lane import Lane
from streamproc.intake.rings import FlowControl, PartitionBuffers
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.models.precision import build_model
from streamproc.output.resequencer import Resequencer
from streamproc.output.results import ResultHandler
from streamproc.output.window import AckWindow
from streamproc.records import Priority
from streamproc.schemas.results import result_serializer
from streamproc.workloads import ModelFn, Workload, load_workload

log = get_logger(__name__)


@dataclass(frozen=True)
class TopicStages:
    """The stages built for one pipeline: its lane, decoder, staging pool (shared by its
    devices), one device worker per device, their placement state, and the resequencer that
    hands results to the result handler in cut order."""

    lane: Lane
    decoder: Decoder
    staging: StagingPool
    workers: tuple[DeviceWorker, ...]
    load: DeviceLoad
    resequencer: Resequencer
    fused: FusedRun | None = None
    """The lane's fused route (one CPU device and ``worker.fused_lane`` not ``never``)."""
    model: VersionedModel | None = None
    """A versioned pipeline's resident versions and model thread (``pipelines[].model``)."""
    window: AckWindow | None = None
    """The lane's acknowledgement window (``buffers.max_unacknowledged_bytes``), closed at the
    drain."""

    @property
    def topic(self) -> str:
        """The pipeline's input topic."""
        return self.lane.topic

    def calibrate(self) -> None:
        """Start-up, before the dispatcher runs: time the batch sizes the lane's adaptive model
        needs; with several devices, also one batch per device at the target size (the first
        placements use those times)."""
        lane = self.lane
        if lane.calibrate(self.workers[0].time_batch):
            log.info("batch size calibrated", topic=lane.topic, target=lane.target)
        if len(self.workers) > 1:
            size = lane.target
            for index, worker in enumerate(self.workers):
                self.load.observe(index, size, worker.time_batch(size))

    def leak_check(self, metrics: Metrics) -> tuple[PoolLeak, ...]:
        """The staging pool's and every output buffer pool's missing buffers, reported (error
        log and ``streamproc_pool_leaked_buffers``); empty when all are back."""
        checks = [self.staging.leak(), *(worker.output_leak() for worker in self.workers)]
        return report_leaks(self.topic, checks, metrics)


def results_serializer(
    spec: PipelineConfig, workload: Workload, config: Config
) -> Callable[[Any], bytes] | None:
    """The results' serialiser of ``spec`` (its schema registered at start-up), or None for
    JSON results.

    Raises:
        ConfigError: the workload has no result schema in that format, or the registry refused
            it.
    """
    if spec.result_format == "json":
        return None
    registry = config.schema_registry
    serializer = result_serializer(
        spec.result_format,
        workload,
        spec.output_topic,
        registry.client_settings(),
        strategy=registry.subject_name_strategy,
        auto_register=registry.auto_register_schemas,
        startup_timeout_s=registry.startup_timeout_s,
    )
    log.info(
        "result schema",
        topic=spec.output_topic,
        format=spec.result_format,
        schema_id=getattr(serializer, "schema_id", None),
    )
    return serializer


def build_topic_stages(spec: PipelineConfig, shared: Shared) -> TopicStages:
    """The stages of one pipeline (its dispatcher is built once the source exists).

    Raises:
        ConfigError: a device or the workload refuses the pipeline's precision, the workload
            does not have its value formats, the registry refused its result schema, or the
            workload keeps per-key order and the group is a share group.
    """
    workload = load_workload(spec.workload, spec.options)
    if workload.ordered and shared.config.kafka.group_type == "share":
        raise ConfigError(
            f"kafka.group_type: share is refused for pipeline {spec.name!r}: its workload "
            f"{spec.workload!r} needs its results in per-key order (Workload.ordered), which a "
            "share group does not keep; set kafka.group_type to consumer"
        )
    try:
        workload.use_input_format(spec.format, shared.schemas)
        workload.use_output_format(
            spec.result_format, results_serializer(spec, workload, shared.config)
        )
    except ConfigError as exc:
        raise ConfigError(f"pipelines[{spec.name!r}]: {exc}") from exc
    staging = build_staging_pool(spec, workload, shared)
    decoder = shared.decoding.decoder(spec, workload, staging)
    topic, metrics, settings = spec.input_topic, shared.metrics, shared.config.worker
    metrics.pool_capacity.labels(topic).set(staging.capacity)
    metrics.pool_allocations.labels(topic).set(staging.allocations)
    lane = build_lane(spec, workload, shared)
    labels = [device.label for device in shared.devices]
    load = DeviceLoad(
        topic, labels, settings.max_in_flight_batches, settings.device_stall_timeout_s, metrics
    )
    model: VersionedModel | None = None
    if spec.model is not None:
        model = build_versioned_model(spec, workload, shared)
        fns = model.versions.serving_version().fns
    else:
        fns = tuple(
            build_device_model(spec, workload, device.device, shared.config)
            for device in shared.devices
        )
    window = AckWindow(
        shared.config.buffers.max_unacknowledged_bytes,
        metrics.unacknowledged_bytes.labels(topic),
        metrics.unacknowledged_wait.labels(topic),
    )
    shared.sink.watch_window(window)
    handler = ResultHandler(
        spec,
        workload,
        shared.sink,
        metrics,
        observe=lane.observe,
        version_of=None if model is None else model.versions.observe,
        window=window,
    )
    resequencer = Resequencer(topic, handler, load.released, shared.on_fatal, metrics=metrics)

    def completed(result: DeviceResult, release: Release) -> None:
        load.completed(result.batch.batch_id, result.inference_s)
        resequencer.put(result, release)

    workers = tuple(
        build_device_worker(
            spec,
            fn,
            device,
            lane,
            staging,
            completed,
            shared,
            build_model_hold(topic, device.label, index, model, metrics),
        )
        for index, (device, fn) in enumerate(zip(shared.devices, fns, strict=True))
    )
    fused = None
    if fusable(shared.devices, shared.config.worker.fused_lane):
        fused = FusedRun(workers[0], resequencer, load, functools.partial(lane.observe, whole=True))
    return TopicStages(lane, decoder, staging, workers, load, resequencer, fused, model, window)


def fusable(devices: Sequence[DeviceSpec], fused_lane: str) -> bool:
    """Whether a lane on ``devices`` may run fused under ``worker.fused_lane``: one CPU
    device, and not ``never``.

    Raises:
        ConfigError: ``always`` where the lane runs on a GPU or on several devices.
    """
    one_cpu = len(devices) == 1 and devices[0].device.type == "cpu"
    if fused_lane == "always" and not one_cpu:
        raise ConfigError(fused_lane_refusal([device.label for device in devices]))
    return one_cpu and fused_lane != "never"


def build_staging_pool(spec: PipelineConfig, workload: Workload, shared: Shared) -> StagingPool:
    """``worker.staging_buffers`` slabs per device of the pipeline's largest batch
    (``PipelineConfig.max_batch_rows``) in rows of the workload's item shape and dtype;
    pinned where a device is CUDA, in shared memory where decode processes write them."""
    config = shared.config
    return StagingPool(
        config.worker.staging_buffers * len(shared.devices),
        spec.max_batch_rows(config.batching, workload.max_batch_size),
        workload.item_shape,
        workload.item_dtype,
        pin=any(d.device.type == "cuda" for d in shared.devices),
        shared=shared.decoding.shared_staging,
    )


def build_lane(spec: PipelineConfig, workload: Workload, shared: Shared) -> Lane:
    """The pipeline's rings (``buffers``) and batch-cut policy (``batching``, and its
    ``latency_target_ms``, by default its priority's); a message without a ``priority`` header
    gets the pipeline's ``priority``, else the workload's."""
    batching, buffers = shared.config.batching, shared.config.buffers
    priority = Priority.parse(spec.priority or workload.default_priority)
    return Lane(
        spec.input_topic,
        PartitionBuffers(
            buffers.ring_capacity,
            buffers.high_watermark,
            buffers.low_watermark,
            buffers.ring_capacity_bytes,
        ),
        Batcher(
            spec.max_batch_rows(batching, workload.max_batch_size),
            batching.max_batch_bytes,
            batching.max_wait_s,
            adaptive=batching.adaptive_batch_size,
            latency_target_s=spec.latency_target_s(priority),
            devices=len(shared.devices),  # one device worker on each takes the lane's batches
        ),
        shared.tracker,
        priority,
        max_age_ms=spec.max_age_ms,
        predict_expiry=spec.expire_when == "predicted",
    )


def build_device_worker(
    spec: PipelineConfig,
    model: ModelFn,
    device: DeviceSpec,
    lane: Lane,
    staging: StagingPool,
    completed: Callable[[DeviceResult, Release], None],
    shared: Shared,
    hold: ModelHold,
) -> DeviceWorker:
    """The pipeline's worker on ``device`` with its own model instance (``model``: the
    workload's, or the serving version's on that device); ``completed`` gets each batch it
    completes; ``hold`` what it does while the model is judged broken."""
    settings, topic, admission = shared.config.worker, spec.input_topic, shared.admission
    return DeviceWorker(
        model,
        device.device,
        staging,
        settings.max_in_flight_batches,
        settings.cuda_streams,
        completed,
        shared.on_fatal,
        label=device.label,
        gate=(
            None
            if admission is None
            else admission.gate(device.device, topic, device.label, shared.metrics)
        ),
        on_model_failure=settings.on_model_failure,
        oom_recovery_s=settings.oom_recovery_s,
        on_cap=cap_reporter(lane, device.label, staging.rows, shared),
        on_outcome=outcome_counter(topic, device.label, shared.metrics),
        hold=hold,
    )


def build_model_hold(
    topic: str, device: str, index: int, model: VersionedModel | None, metrics: Metrics
) -> ModelHold:
    """The :class:`ModelHold` of the worker on ``device`` (index ``index`` among the lane's
    devices): ``streamproc_model_held{topic,device}`` is 1 while it holds a batch; in a
    versioned pipeline the version judged broken is rolled back to the last version that
    served well (reloaded from the source by the model thread) and a held batch is rebound to
    the serving version before each try (an unversioned one tries the same model again)."""
    gauge = metrics.model_held.labels(topic, device)
    gauge.set(0)

    def held(version: str | None, error: str) -> None:
        gauge.set(1)
        if model is not None and version is not None:
            target = model.versions.judged_broken(version)
            if target is not None:
                model.manager.restore(target)  # a refusal is logged by the model thread

    def resumed(version: str | None, held_s: float) -> None:
        gauge.set(0)

    if model is None:
        return ModelHold(device, held, resumed)
    versions = model.versions
    return ModelHold(device, held, resumed, lambda job: versions.rebind(job, index))


def build_device_model(
    spec: PipelineConfig, workload: Workload, device: torch.device, config: Config
) -> ModelFn:
    """The pipeline's batch function on ``device`` at its precision (``pipelines[].precision``,
    else ``worker.precision``).

    Raises:
        ConfigError: the device or the workload refuses that precision (named by its key).
    """
    index = config.pipelines.index(spec)
    precision = spec.precision or config.worker.precision
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


def cap_reporter(lane: Lane, device: str, max_rows: int, shared: Shared) -> Callable[[int], None]:
    """A device worker's ``on_cap``: the lane cuts at most the cap; the gauge shows it (at
    first ``max_rows``, the pipeline's largest batch)."""
    gauge = shared.metrics.batch_size_cap.labels(lane.topic, device)
    gauge.set(max_rows)

    def report(cap: int) -> None:
        gauge.set(cap)
        lane.cap_batch(device, cap)

    return report


def outcome_counter(topic: str, device: str, metrics: Metrics) -> Callable[[RunOutcome], None]:
    """A device worker's ``on_outcome``: counts the re-runs of batches whose model call
    raised."""
    retries = metrics.model_retry_calls.labels(topic, device)
    isolated = metrics.model_isolated_rows.labels(topic, device)
    broken = metrics.model_broken_batches.labels(topic, device)
    out_of_memory = metrics.device_out_of_memory.labels(topic, device)

    def count(outcome: RunOutcome) -> None:
        retries.inc(outcome.calls - 1)
        isolated.inc(outcome.isolated)
        broken.inc(outcome.broken)
        out_of_memory.inc(outcome.out_of_memory)

    return count


def route_changed(lane: Lane, gauge: Gauge, route: LaneRoute) -> None:
    """A lane runs ``route`` now: ``streamproc_lane_fused`` says which, and a fused lane's
    adaptive batch size aims for the throughput-optimal size (its fixed costs per batch are the
    lane thread's own; staged, the smallest size within 5 % of it)."""
    gauge.set(route == "fused")
    lane.aim_for_throughput(route == "fused")


def build_dispatcher(
    stages: TopicStages, apply_flow: Callable[[FlowControl], None], shared: Shared
) -> Dispatcher:
    """The pipeline's ``dispatch-<topic>`` thread; ``apply_flow`` takes its resume decisions
    (the source's :meth:`~streamproc.intake.source.Source.apply`)."""
    gauge = shared.metrics.lane_fused.labels(stages.topic)
    fused_lane = shared.config.worker.fused_lane
    route: LaneRoute | LaneRoutePolicy = "staged"
    if stages.fused is not None:
        route = LaneRoutePolicy() if fused_lane == "auto" else "fused"
    return Dispatcher(
        stages.lane,
        stages.decoder,
        stages.staging,
        stages.workers,
        stages.load,
        apply_flow,
        shared.metrics,
        shared.on_fatal,
        fused=stages.fused,
        route=route,
        on_route=lambda now: route_changed(stages.lane, gauge, now),
        bind=None if stages.model is None else stages.model.versions.bind,
        resequencer=stages.resequencer,
        stages=shared.stage_recorder(stages.topic),
    )
