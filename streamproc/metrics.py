"""Prometheus metrics (prefix ``streamproc_``, units in the names).

Each :class:`Metrics` owns its own ``CollectorRegistry`` so several pipelines can live in one
process (tests, the demo); :class:`~streamproc.health.HealthServer` exposes it over HTTP on
``metrics.port``.
"""

from __future__ import annotations

from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from streamproc.histograms import BatchHistogram

MetricT = TypeVar("MetricT", bound=MetricWrapperBase)

_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_STAGE_BUCKETS_S = (
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
)
"""1-2-5 steps from 0.1 ms: each stage's quantiles (``histogram_quantile``, the bench's stage
columns) within a factor 2.5 of the truth, where the coarser latency buckets would give 10."""
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_TOPIC = ("topic",)
_TOPIC_DEVICE = ("topic", "device")
_TOPIC_PARTITION = ("topic", "partition")


class Metrics:
    """All metrics of one pipeline process, by family (in registration order): messages,
    batches and latency, flow control, offsets, staging pools, devices, model failures, decode,
    consumer lag, GPU. Every metric is created at construction; labelled series appear on
    first use."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._add_messages()
        self._add_batches()
        self._add_flow_control()
        self._add_offsets()
        self._add_staging_pools()
        self._add_devices()
        self._add_model_failures()
        self._add_model_versions()
        self._add_decode()
        self._add_lag()
        self._add_gpu()
        self._add_tracing()
        self._nvml: object | None = None
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}

    def _add_messages(self) -> None:
        """Messages in and out, by topic: consumed (and read again), produced, produced again,
        dead-lettered."""
        reg = self.registry
        self.consumed = Counter(
            "streamproc_messages_consumed", "Messages consumed", _TOPIC, registry=reg
        )
        self.read_again = Counter(
            "streamproc_messages_read_again",
            "Messages consumed at an offset this process had consumed before (partitions "
            "rewound after an aborted transaction, or back after a rebalance); part of "
            "messages_consumed",
            _TOPIC,
            registry=reg,
        )
        self.produced = Counter(
            "streamproc_messages_produced",
            "Results acknowledged by the broker",
            _TOPIC,
            registry=reg,
        )
        self.produce_retries = Counter(
            "streamproc_produce_retries",
            "Records produced again because the cluster could not take them (timed out, too "
            "few in-sync replicas, no leader)",
            _TOPIC,
            registry=reg,
        )
        self.dead_lettered = Counter(
            "streamproc_messages_dead_lettered",
            "Dead-letter records acknowledged",
            ("topic", "stage"),
            registry=reg,
        )
        self.expired = Counter(
            "streamproc_expired",
            "Input records past their deadline when their batch was cut (not run; an expired "
            "result or a dead-letter record instead), by input topic",
            _TOPIC,
            registry=reg,
        )
        self.deadline_header_invalid = Counter(
            "streamproc_deadline_header_invalid",
            "Input records whose streamproc.deadline header did not parse or lay more than a "
            "year from their timestamp (ignored), by input topic",
            _TOPIC,
            registry=reg,
        )

    def _add_batches(self) -> None:
        """Batch sizes and the latency histograms, by input topic."""
        reg = self.registry
        self.batch_size = Histogram(
            "streamproc_batch_size_messages",
            "Messages per batch",
            _TOPIC,
            buckets=_BATCH_BUCKETS,
            registry=reg,
        )
        self.queue_wait = BatchHistogram(
            "streamproc_queue_wait_seconds",
            "Consume to batch cut",
            _TOPIC,
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.inference = Histogram(
            "streamproc_inference_seconds",
            "Batch launch to outputs on the host",
            _TOPIC,
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.end_to_end = BatchHistogram(
            "streamproc_end_to_end_seconds",
            "Input record timestamp to output acknowledgement",
            _TOPIC,
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.latency_p99 = Gauge(
            "streamproc_latency_p99_seconds",
            "P99 from consume to the acknowledgement of the result, over the last 10 s of "
            "results (as of the last result), by input topic",
            _TOPIC,
            registry=reg,
        )
        self.latency_target = Gauge(
            "streamproc_latency_target_seconds",
            "The pipeline's latency target (pipelines[].latency_target_ms): the P99 from "
            "consume to acknowledgement its batcher aims for, by input topic",
            _TOPIC,
            registry=reg,
        )
        self.latency_over_target = Counter(
            "streamproc_latency_over_target_seconds",
            "Time the measured P99 (streamproc_latency_p99_seconds) was over the target, by "
            "input topic",
            _TOPIC,
            registry=reg,
        )

        self.stage = BatchHistogram(
            "streamproc_stage_seconds",
            "Time each input record spent in each stage of the record path, by input topic and "
            "stage (streamproc.stages.STAGES: consume, ring, batch, decode, device, encode, "
            "produce, commit; back to back, so a record's stages up to produce add up to its "
            "end-to-end latency); a batch's stage counts once per record of the batch",
            ("topic", "stage"),
            buckets=_STAGE_BUCKETS_S,
            registry=reg,
        )

    def _add_flow_control(self) -> None:
        """Ring fill per partition and the partitions paused by flow control."""
        reg = self.registry
        self.ring_fill = Gauge(
            "streamproc_ring_fill_ratio",
            "Ring buffer fill: the larger of records / ring_capacity and bytes / "
            "ring_capacity_bytes (0..1; the bytes can pass 1 by one poll)",
            _TOPIC_PARTITION,
            registry=reg,
        )
        self.paused = Gauge(
            "streamproc_paused_partitions", "Partitions paused by flow control", registry=reg
        )
        self.unacknowledged_bytes = Gauge(
            "streamproc_unacknowledged_bytes",
            "Bytes (keys and values) of inputs whose results are produced and not yet "
            "acknowledged, by input topic (bounded by buffers.max_unacknowledged_bytes)",
            _TOPIC,
            registry=reg,
        )
        self.unacknowledged_wait = Counter(
            "streamproc_unacknowledged_wait_seconds",
            "Time the results waited for acknowledgements at buffers.max_unacknowledged_bytes "
            "before they were produced, by input topic",
            _TOPIC,
            registry=reg,
        )

    def _add_offsets(self) -> None:
        """Commits, transactions and results that can no longer be committed."""
        reg = self.registry
        self.commits = Counter("streamproc_commits", "Offset commits accepted", registry=reg)
        self.commit_failures = Counter(
            "streamproc_commit_failures", "Offset commits that failed", registry=reg
        )
        self.transaction_aborts = Counter(
            "streamproc_transaction_aborts",
            "Transactions aborted (exactly-once), by the error's name",
            ("reason",),
            registry=reg,
        )
        self.producer_renewals = Counter(
            "streamproc_producer_renewals",
            "Transactional producers replaced because a call into them never returned",
            registry=reg,
        )
        self.late_results = Counter(
            "streamproc_late_results",
            "Results for partitions no longer owned (not committed)",
            registry=reg,
        )
        # share groups (kafka.group_type: share; streamproc.share)
        self.share_in_flight = Gauge(
            "streamproc_share_in_flight_records",
            "Records this member acquired from its share group and has not acknowledged yet",
            registry=reg,
        )
        self.share_busy = Gauge(
            "streamproc_share_busy_ratio",
            "Share of the last 5 s in which this member held records not yet acknowledged: "
            "near 1 while the group has a backlog for it, near 0 once it finds nothing to "
            "acquire (the share-group scaling signal)",
            registry=reg,
        )
        self.share_acknowledged = Counter(
            "streamproc_share_acknowledged",
            "Records acknowledged to the share group (ACCEPT: result or dead-letter record "
            "durable), as the broker confirmed them",
            _TOPIC,
            registry=reg,
        )
        self.share_released = Counter(
            "streamproc_share_released",
            "Records released back to the share group before they were done (RELEASE: their "
            "lock was about to expire, or the process stopped), by why",
            ("topic", "reason"),
            registry=reg,
        )
        self.share_ack_failures = Counter(
            "streamproc_share_acknowledgement_failures",
            "Records whose acknowledgement the broker refused (their lock had expired: the "
            "group delivers them again, a duplicate result)",
            _TOPIC,
            registry=reg,
        )
        self.share_acquired_end = Gauge(
            "streamproc_share_acquired_end_offset",
            "One past the highest offset this member has acquired from the partition. With "
            "streamproc_partition_end_offset: a share group's records not yet acquired by any "
            "member are max by (topic, partition) of the end offset minus max by (topic, "
            "partition) of this gauge (Kafka's admin API has the group's own start offsets; "
            "confluent-kafka 2.16 has no call for them)",
            _TOPIC_PARTITION,
            registry=reg,
        )
        self.partition_end_offset = Gauge(
            "streamproc_partition_end_offset",
            "End offset (high watermark) of every partition of the input topics, measured by "
            "the lag thread every metrics.lag_interval_s (share groups: kafka.group_type share)",
            _TOPIC_PARTITION,
            registry=reg,
        )
        self.share_redelivered = Counter(
            "streamproc_share_redelivered",
            "Records acquired with a delivery count above 1 (delivered before to some member "
            "that did not acknowledge them); part of messages_consumed",
            _TOPIC,
            registry=reg,
        )

    def _add_staging_pools(self) -> None:
        """Staging buffers per input topic, and the leak check at close."""
        reg = self.registry
        self.pool_in_use = Gauge(
            "streamproc_pinned_pool_in_use_buffers", "Staging buffers leased", _TOPIC, registry=reg
        )
        self.pool_capacity = Gauge(
            "streamproc_pinned_pool_capacity_buffers",
            "Staging buffers in the pool",
            _TOPIC,
            registry=reg,
        )
        self.pool_allocations = Gauge(
            "streamproc_pinned_pool_allocations",
            "Host buffers ever allocated by the pool",
            _TOPIC,
            registry=reg,
        )
        self.pool_leaked = Gauge(
            "streamproc_pool_leaked_buffers",
            "Buffers not back in their pool at close (0 after a clean close; pool: staging, or "
            "output <device>)",
            ("topic", "pool"),
            registry=reg,
        )

    def _add_devices(self) -> None:
        """Placement, busy time, stalls and admission per input topic and device, and the
        results waiting to be handed over in cut order."""
        reg = self.registry
        self.device_batches = Counter(
            "streamproc_device_batches",
            "Batches placed on each device",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_in_flight = Gauge(
            "streamproc_device_in_flight_batches",
            "Batches on each device between placement and produce",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_busy = Counter(
            "streamproc_device_busy_seconds",
            "Device seconds (copy in, model, copy out) of completed batches; its rate is the "
            "device's utilisation",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_stalled = Gauge(
            "streamproc_device_stalled",
            "1 while a device has not completed its oldest batch for worker.device_stall_timeout_s",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_deferred = Counter(
            "streamproc_device_deferred_launches",
            "Batches whose launch waited for a more urgent lane's batch on the same device "
            "(device admission, worker.priority_max_defer_ms)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_yielded = Counter(
            "streamproc_device_yielded_launches",
            "Batches run with half the intra-op threads because a more urgent lane was active "
            "on the same CPU (device admission)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.results_waiting = Gauge(
            "streamproc_results_waiting_batches",
            "Completed batches waiting for an earlier batch of their lane that is not complete "
            "yet (result order across devices)",
            _TOPIC,
            registry=reg,
        )

    def _add_model_failures(self) -> None:
        """Re-runs of batches whose model call raised, and the batch-size cap, per input topic
        and device."""
        reg = self.registry
        self.model_retry_calls = Counter(
            "streamproc_model_retry_calls",
            "Model calls beyond the first of a batch: re-runs in parts after the model raised "
            "(narrowing down failing rows, or splitting a batch that ran out of device memory)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.model_isolated_rows = Counter(
            "streamproc_model_isolated_rows",
            "Rows the model failed on alone (dead-lettered with stage model; the rest of their "
            "batch got results)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.model_broken_batches = Counter(
            "streamproc_model_broken_batches",
            "Batches dead-lettered whole without narrowing down: the model was judged broken "
            "(failing for every row)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.model_held = Gauge(
            "streamproc_model_held",
            "1 while the device holds a batch because the model is judged broken (failing "
            "for every row; worker.on_model_failure hold): the lane takes no batch, nothing is "
            "dead-lettered, the batch is tried again with backoff",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.device_out_of_memory = Counter(
            "streamproc_device_out_of_memory",
            "Device out-of-memory errors of live batches (each re-run in smaller parts, never "
            "dead-lettered)",
            _TOPIC_DEVICE,
            registry=reg,
        )
        self.batch_size_cap = Gauge(
            "streamproc_batch_size_cap",
            "Largest batch the device runs now (rows): lowered by out-of-memory errors (and at "
            "warm-up), raised again after worker.oom_recovery_s without one",
            _TOPIC_DEVICE,
            registry=reg,
        )

    def _add_decode(self) -> None:
        """The decode workers of the process, and where each input topic decodes."""
        reg = self.registry
        self.decode_workers = Gauge(
            "streamproc_decode_workers",
            "Decode workers (threads or processes) of the process, set by the decode sizer",
            registry=reg,
        )
        self.decode_wait_ratio = Gauge(
            "streamproc_decode_wait_ratio",
            "Share of the last sizing window the topic's dispatcher spent waiting for decode",
            _TOPIC,
            registry=reg,
        )
        self.lane_fused = Gauge(
            "streamproc_lane_fused",
            "1 while the topic's settled route is fused (cut, decode, model, encode and "
            "produce on one thread), 0 while staged over its dispatcher, device and results "
            "threads (a probe runs 16 batches the other way without changing it)",
            _TOPIC,
            registry=reg,
        )
        self.decode_inline = Gauge(
            "streamproc_decode_inline",
            "1 while the topic decodes on its dispatcher thread, 0 while on the decode workers",
            _TOPIC,
            registry=reg,
        )

    def _add_lag(self) -> None:
        """Consumer lag per partition and the partitions that stopped progressing."""
        reg = self.registry
        self.consumer_lag = Gauge(
            "streamproc_consumer_lag_messages",
            "Messages not yet processed: in the pipeline and not yet done, plus the latest "
            "offset minus the consumer's position (transaction markers read are excluded)",
            _TOPIC_PARTITION,
            registry=reg,
        )
        self.consumer_lag_seconds = Gauge(
            "streamproc_consumer_lag_seconds",
            "Age of the oldest message in the pipeline not yet done (now minus its record "
            "timestamp); 0 when none is",
            _TOPIC_PARTITION,
            registry=reg,
        )
        self.stalled = Gauge(
            "streamproc_stalled_partitions",
            "Assigned partitions with lag > 0 and no progress for metrics.stall_timeout_s",
            registry=reg,
        )

    def _add_tracing(self) -> None:
        """Tracing (``streamproc.tracing``): record contexts ignored, links left out, spans
        exported and dropped."""
        reg = self.registry
        self.trace_context_invalid = Counter(
            "streamproc_trace_context_invalid_total",
            "Input records whose traceparent header could not be read (ignored: the record is "
            "processed as one without a context)",
            _TOPIC,
            registry=reg,
        )
        self.trace_links_dropped = Counter(
            "streamproc_trace_links_dropped_total",
            "Record contexts a batch's process span did not link: past tracing.max_links",
            _TOPIC,
            registry=reg,
        )
        self.trace_spans_exported = Counter(
            "streamproc_trace_spans_exported_total",
            "Spans the trace backend accepted",
            registry=reg,
        )
        self.trace_spans_dropped = Counter(
            "streamproc_trace_spans_dropped_total",
            "Spans never exported: queue_full (the export queue, tracing.max_queue_spans, was "
            "full: the backend is down or slow) or export_failed (the backend refused them or "
            "did not answer within tracing.export_timeout_s)",
            ("reason",),
            registry=reg,
        )

    def _add_gpu(self) -> None:
        """GPU utilisation and memory per GPU index (NVML; absent without a GPU)."""
        reg = self.registry
        self.gpu_utilization = Gauge(
            "streamproc_gpu_utilization_ratio",
            "GPU utilisation (0..1, NVML)",
            ("gpu",),
            registry=reg,
        )
        self.gpu_memory_used = Gauge(
            "streamproc_gpu_memory_used_bytes", "GPU memory in use (NVML)", ("gpu",), registry=reg
        )

    def _add_model_versions(self) -> None:
        """Versioned models (``pipelines[].model``): the serving version, batches per version,
        swaps, refusals, rollbacks, the swap pause, and shadow scoring's agreement and
        latency (labels: the pipeline's input topic and the version name; a pipeline keeps at
        most two versions resident, so a handful of series)."""
        reg = self.registry
        self.model_serving = Gauge(
            "streamproc_model_serving",
            "1 for the model version serving the pipeline, 0 for versions that served before",
            ("topic", "version"),
            registry=reg,
        )
        self.model_batches = Counter(
            "streamproc_model_batches",
            "Batches whose results a model version made",
            ("topic", "version"),
            registry=reg,
        )
        self.model_fallbacks = Counter(
            "streamproc_model_fallback_batches",
            "Batches a version in probation raised on (its predecessor made the results)",
            ("topic", "version"),
            registry=reg,
        )
        self.model_swaps = Counter(
            "streamproc_model_swaps",
            "Version switches at a batch boundary, by why (new, promoted, rollback, operator)",
            ("topic", "reason"),
            registry=reg,
        )
        self.model_refused = Counter(
            "streamproc_model_refused_versions",
            "Versions refused before serving, by reason (load, warmup, memory, contract, source)"
            " and attempt (first: the version's first try; retry: a try after its files changed)",
            ("topic", "reason", "attempt"),
            registry=reg,
        )
        self.model_rollbacks = Counter(
            "streamproc_model_rollbacks",
            "Automatic rollbacks, by reason: a version in probation (errors, latency), a version "
            "judged broken after it (broken: the last version that served well reloaded), the "
            "operator's (operator)",
            ("topic", "reason"),
            registry=reg,
        )
        self.model_swap_pause = Histogram(
            "streamproc_model_swap_pause_seconds",
            "Time with no batch of the pipeline in flight around a version switch",
            _TOPIC,
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.shadow_batches = Counter(
            "streamproc_shadow_batches",
            "Batches a shadow candidate also scored",
            ("topic", "version"),
            registry=reg,
        )
        self.shadow_errors = Counter(
            "streamproc_shadow_errors",
            "Shadowed batches the candidate raised on",
            ("topic", "version"),
            registry=reg,
        )
        self.shadow_agreement = Gauge(
            "streamproc_shadow_agreement_ratio",
            "Share of shadowed rows whose outputs agreed with the serving version's",
            ("topic", "version"),
            registry=reg,
        )
        self.shadow_latency_ratio = Gauge(
            "streamproc_shadow_latency_ratio",
            "Candidate P99 call time / serving P99 call time on the shadowed batches",
            ("topic", "version"),
            registry=reg,
        )

    def child(self, metric: MetricT, *labels: str) -> MetricT:
        """``metric.labels(*labels)``, looked up once (for per-message counters whose series
        are never removed)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(MetricT, found)  # keyed by id(metric): a child of that same metric

    def counter_value(self, counter: Counter, **labels: str) -> float:
        """The current value of one series of ``counter``, read through the registry's public
        ``get_sample_value`` (0.0 while the series does not exist). ``labels``: every label of
        the counter by name, e.g. ``counter_value(m.consumed, topic="frames")``."""
        (family,) = counter.describe()  # the metric family; its samples are named <name>_total
        value = self.registry.get_sample_value(f"{family.name}_total", labels)
        return 0.0 if value is None else value

    def sample_gpu(self) -> None:
        """Update the GPU gauges from NVML when a GPU and nvidia-ml-py are present."""
        try:
            import pynvml
        except ImportError:
            return
        try:
            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                util = pynvml.nvmlDeviceGetUtilizationRates(handle)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                self.gpu_utilization.labels(str(index)).set(util.gpu / 100.0)
                self.gpu_memory_used.labels(str(index)).set(memory.used)
        except pynvml.NVMLError:
            return  # no driver / no GPU: the gauges stay absent
