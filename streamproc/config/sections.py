"""The sections of the configuration tree (:class:`streamproc.config.Config`): one frozen model
per top-level key, every field validated at start-up with its unit in its name."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from streamproc.records import Priority
from streamproc.workloads.registry import BUILTIN_WORKLOADS, MAX_BATCH_SIZE_LIMIT

Scalar = str | int | float | bool


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


CONSUMER_PROTOCOL_REFUSED = frozenset(
    {
        "partition.assignment.strategy",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "group.protocol.type",
    }
)
"""librdkafka consumer keys that ``group.protocol=consumer`` refuses (client creation fails)."""


ASSIGNMENT_TIMEOUT_MIN_S = 3.0
"""The shortest ``kafka.assignment_timeout_s``: three of the lag monitor's refreshes while
``run --exit-when-idle-s`` waits (it wakes the monitor every second,
``streamproc.pipeline.LAG_WAKE_INTERVAL_S``), so a measurement of the group begun after the quiet
window began has time to arrive before a drained run is judged behind (a tiny value exited 1)."""
ASSIGNMENT_TIMEOUT_MAX_S = 86_400.0
"""The longest ``kafka.assignment_timeout_s`` (a day): finite, so a run whose group stays behind
always ends (``inf`` never exited)."""


class KafkaConfig(_Section):
    """Kafka client settings. ``consumer``/``producer`` pass raw librdkafka keys through.

    ``create_topics``: at start-up, create missing output topics (with the input topic's
    partition count) and dead-letter topics (1 partition). ``startup_timeout_s``: how long to
    wait for the cluster to answer before failing. ``assignment_timeout_s`` (``run
    --exit-when-idle-s`` only): the longest stretch with no partition assigned (before the
    first assignment, after the group lost its partitions, after a rebalance revoked the last
    one) before exiting 1; it must outlast ``session.timeout.ms`` of a member that died (the
    coordinator expires it before the group rebalances). It also bounds how long a member whose
    own partitions are done waits for the rest of the group with no committed offset of the
    input moving, before exiting 1 naming the partitions behind and their lag. Seconds, finite,
    from :data:`ASSIGNMENT_TIMEOUT_MIN_S` (3) to :data:`ASSIGNMENT_TIMEOUT_MAX_S` (86400).
    ``transactional_id`` (exactly-once only): unique per process and stable across its
    restarts; default ``<group_id>-<$STREAMPROC_INSTANCE_ID>``, else a host slot per process of
    the group (``<group_id>-<host name>[-<slot>]``, see ``streamproc.offsets.identity``).
    ``max_transaction_aborts`` (exactly-once only): aborted transactions in a row that teach
    nothing new (no record refused for its own sake learned, nothing committed) before the
    process stops (exit 1) naming the offsets and the error, instead of retrying forever.

    ``group_protocol``: ``classic`` (the default: the group rebalances through its leader,
    cooperative-sticky assignment, ``session_timeout_ms`` from here) or ``consumer`` (KIP-848:
    the broker assigns partitions incrementally; the session timeout is the broker's
    ``group.consumer.session.timeout.ms``, so ``session_timeout_ms`` and the librdkafka keys
    the protocol refuses, :data:`CONSUMER_PROTOCOL_REFUSED`, fail at start-up). Measured side
    by side in docs/operations.md ("Rebalances and scaling").
    ``group_instance_id``: static membership (``group.instance.id``): a member that comes back
    under the same id within the session timeout takes its partitions back without a
    rebalance; a member that leaves for good keeps its partitions unowned until the session
    timeout expires. Unique per instance and stable across its restarts (the chart sets it to
    the StatefulSet pod name); default none (dynamic membership).

    ``group_type``: ``consumer`` (the default: a consumer group, each partition read by one
    member, offsets committed) or ``share`` (a share group, KIP-932: any number of members read
    the same partitions, each record acquired by one member and acknowledged by itself, so the
    members can outnumber the partitions; at-least-once, no per-key order; see
    ``streamproc.share`` and docs/operations.md "Share groups"). ``group_protocol``,
    ``group_instance_id`` and ``session_timeout_ms`` belong to consumer groups and fail at
    start-up with ``share``. ``auto_offset_reset`` becomes the share group's
    ``share.auto.offset.reset`` (a group setting streamproc sets at start-up).
    ``share_release_after_ms`` (share only): records of a poll not done this long after it are
    released to the group (``RELEASE``) and counted; keep it below the group's record lock,
    ``group.share.record.lock.duration.ms`` (30 s by default). Milliseconds, above 0.
    ``share_max_deliveries`` (share only): a record the group delivers for this many times
    (the broker counts every delivery whose member did not acknowledge it: a crash, a kill, a
    lock that ran out) is dead-lettered (stage ``delivery``) instead of run once more, then
    rejected; keep it at most the group's ``group.share.delivery.count.limit`` (5 by default),
    which archives the record silently after that many. 5 to 10: a record delivered a third time
    runs alone, so valid ones finish by their fourth delivery (``streamproc.share.ledger``).
    """

    bootstrap_servers: str | None = None
    group_id: str = Field(default="streamproc", min_length=1)
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    commit_interval_ms: int = Field(default=1000, gt=0)
    poll_timeout_ms: int = Field(default=100, gt=0, le=1000)
    consume_batch_messages: int = Field(default=100, ge=1, le=100_000)
    session_timeout_ms: int = Field(default=45_000, gt=0)
    max_poll_interval_ms: int = Field(default=300_000, gt=0)
    startup_timeout_s: float = Field(default=30.0, gt=0)
    assignment_timeout_s: float = 120.0
    create_topics: bool = True
    transactional_id: str | None = None
    max_transaction_aborts: int = Field(default=5, ge=1, le=1000)
    group_protocol: Literal["classic", "consumer"] = "classic"
    group_instance_id: str | None = Field(default=None, min_length=1, max_length=249)
    group_type: Literal["consumer", "share"] = "consumer"
    share_release_after_ms: int = Field(default=25_000, gt=0)
    share_max_deliveries: int = Field(default=5, ge=5, le=10)
    consumer: dict[str, Scalar] = Field(default_factory=dict)
    producer: dict[str, Scalar] = Field(default_factory=dict)

    @field_validator("transactional_id")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(
                "blank; set a transactional.id unique per process and stable "
                "across its restarts, or remove the key (STREAMPROC_INSTANCE_ID or a host slot)"
            )
        return value

    @field_validator("assignment_timeout_s")
    @classmethod
    def _assignment_timeout(cls, value: float) -> float:
        if not ASSIGNMENT_TIMEOUT_MIN_S <= value <= ASSIGNMENT_TIMEOUT_MAX_S:  # NaN too
            raise ValueError(
                f"must be a finite number of seconds from {ASSIGNMENT_TIMEOUT_MIN_S:g} to "
                f"{ASSIGNMENT_TIMEOUT_MAX_S:g}"
            )
        return value

    @model_validator(mode="after")
    def _group_keys(self) -> KafkaConfig:
        owned = {"group.protocol": "group_protocol", "group.instance.id": "group_instance_id"}
        for key, field in owned.items():
            if key in self.consumer:
                raise ValueError(
                    f'kafka.consumer."{key}": set kafka.{field} instead (streamproc reads it)'
                )
        if self.group_type == "share":
            consumer_only = sorted(
                {"group_protocol", "group_instance_id", "session_timeout_ms"}
                & self.model_fields_set
            )
            if consumer_only:
                raise ValueError(
                    f"kafka.{consumer_only[0]}: not supported with kafka.group_type=share (a "
                    "share group has no partition assignment to keep, no static membership, and "
                    "the broker's group.share.session.timeout.ms applies); remove it, or set "
                    "kafka.group_type to consumer"
                )
            return self
        if self.group_protocol != "consumer":
            return self
        if "session_timeout_ms" in self.model_fields_set:
            raise ValueError(
                "kafka.session_timeout_ms: not supported with kafka.group_protocol=consumer "
                "(the broker's group.consumer.session.timeout.ms applies); remove it, or set "
                "kafka.group_protocol to classic"
            )
        refused = sorted(CONSUMER_PROTOCOL_REFUSED & self.consumer.keys())
        if refused:
            raise ValueError(
                f"kafka.consumer: {refused} not supported with kafka.group_protocol=consumer "
                "(the broker assigns partitions and times sessions out; group.remote.assignor "
                "picks its assignor); remove them, or set kafka.group_protocol to classic"
            )
        return self

    @property
    def poll_timeout_s(self) -> float:
        """``poll_timeout_ms`` in seconds (the core works in seconds)."""
        return self.poll_timeout_ms / 1000.0

    @property
    def commit_interval_s(self) -> float:
        """``commit_interval_ms`` in seconds."""
        return self.commit_interval_ms / 1000.0


ModelPrecision = Literal["fp32", "bf16", "fp16", "int8"]
"""``worker.precision`` / ``pipelines[].precision`` (streamproc.models.precision checks, at
start-up, that the device and the workload support it)."""


class ShadowConfig(_Section):
    """Shadow scoring of a candidate version (``pipelines[].model.mode: shadow``): the candidate
    also scores ``sample`` of the live batches on the same device, after the serving version;
    its results are compared, never produced. ``promote_after_batches`` shadowed batches
    meeting both thresholds promote it (None: only ``streamproc model use`` promotes)."""

    sample: float = Field(default=0.1, gt=0, le=1)  # share of batches the candidate scores
    atol: float = Field(default=1e-4, ge=0)  # a row agrees when every output is isclose(...)
    rtol: float = Field(default=1e-3, ge=0)
    promote_after_batches: int | None = Field(default=None, ge=1)
    promote_min_agreement: float = Field(default=0.99, ge=0, le=1)  # share of rows
    promote_max_latency_ratio: float = Field(default=2.0, gt=0)  # candidate P99 / serving P99


class RollbackConfig(_Section):
    """Probation of a newly serving version: for ``window_batches`` batches its predecessor
    stays resident; once ``min_batches`` ran, it is rolled back when more than
    ``max_error_share`` of its batches raised; once ``latency_min_batches`` ran (a P99 of
    fewer batches is their maximum: one slow batch on a busy host would decide), when its P99
    device time per row exceeds ``max_p99_ratio`` times its predecessor's over as many batches
    (a window shorter than ``latency_min_batches`` never judges latency)."""

    window_batches: int = Field(default=300, ge=1)
    min_batches: int = Field(default=10, ge=1)
    max_error_share: float = Field(default=0.05, ge=0, le=1)
    latency_min_batches: int = Field(default=100, ge=1)
    max_p99_ratio: float = Field(default=3.0, gt=1)

    @model_validator(mode="after")
    def _min_within_window(self) -> RollbackConfig:
        if self.min_batches > self.window_batches:
            raise ValueError(
                f"rollback.min_batches ({self.min_batches}) must be at most "
                f"rollback.window_batches ({self.window_batches})"
            )
        return self


class ModelConfig(_Section):
    """A pipeline's versioned model (``pipelines[].model``; without it the workload's own model
    serves, version ``builtin``).

    ``source: folder``: ``<repository>/<name>/<version>/`` holds a TorchScript (``*.pt``,
    ``*.ts``) or ``torch.export`` (``*.pt2``) file, or a ``version.json`` naming a plug-in
    (``{"plugin": "package.module:factory"}``); ``latest`` is the highest version (numeric
    names by number). ``source: mlflow``: MLflow's model registry at ``tracking_uri``;
    ``version`` is a number, ``@alias`` or ``latest``. ``poll_interval_s`` seconds between
    looks at the source for a new version (0: only ``streamproc model use`` changes it);
    ``mode`` says what a version found by polling does: ``swap`` (serve once loaded and warmed
    up) or ``shadow`` (score beside the serving one first)."""

    source: Literal["folder", "mlflow"] = "folder"
    name: str = Field(min_length=1)
    # folder: default $STREAMPROC_MODEL_REPOSITORY
    repository: str | None = None
    # mlflow: default $MLFLOW_TRACKING_URI
    tracking_uri: str | None = None
    version: str = Field(default="latest", min_length=1)

    @field_validator("version", mode="before")
    @classmethod
    def _version_number(cls, value: Any) -> Any:
        # `version: 3` in YAML is an int: the name "3"
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    poll_interval_s: float = Field(default=30.0, ge=0)
    mode: Literal["swap", "shadow"] = "swap"
    memory_headroom: float = Field(default=1.5, ge=1)  # free memory needed / the new version's size
    shadow: ShadowConfig = Field(default_factory=ShadowConfig)
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)

    @model_validator(mode="before")
    @classmethod
    def _locations_from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        source = data.get("source", "folder")
        if source == "folder" and data.get("repository") is None:
            found = os.environ.get("STREAMPROC_MODEL_REPOSITORY")
            if found:
                data = {**data, "repository": found}
        if source == "mlflow" and data.get("tracking_uri") is None:
            found = os.environ.get("MLFLOW_TRACKING_URI")
            if found:
                data = {**data, "tracking_uri": found}
        return data

    @model_validator(mode="after")
    def _location_given(self) -> ModelConfig:
        if self.source == "folder" and not self.repository:
            raise ValueError(
                "model.repository: the model repository folder is needed with source: folder "
                "(or $STREAMPROC_MODEL_REPOSITORY)"
            )
        if self.source == "mlflow" and not self.tracking_uri:
            raise ValueError(
                "model.tracking_uri: the MLflow tracking server URL is needed with source: "
                "mlflow (or $MLFLOW_TRACKING_URI)"
            )
        return self


DEFAULT_LATENCY_TARGET_MS: dict[str, float] = {"high": 30.0, "normal": 100.0, "low": 2000.0}
"""``pipelines[].latency_target_ms`` left unset, by the pipeline's priority class (its
``priority``, else its workload's): ``high`` 30 ms, what a trading or fraud check is judged by
(issue 41's trades target); ``normal`` 100 ms, the budget of an interactive answer (sensor
alerts, recommendations); ``low`` 2 s, a bulk model that must keep up rather than answer fast
(video). docs/operations.md ("Latency target") says why."""
LATENCY_TARGET_MAX_MS = 3_600_000.0
"""The longest ``pipelines[].latency_target_ms`` (an hour): finite, as every max wait."""


class PipelineConfig(_Section):
    """One input topic bound to one workload and one output topic; ``precision`` overrides
    ``worker.precision`` for this pipeline's model.

    ``latency_target_ms``: the P99 from consume to the acknowledgement of the result that the
    batcher aims for (``streamproc.intake.latency``): waits and batch sizes are kept within it
    while the device can; ``streamproc_latency_p99_seconds`` and
    ``streamproc_latency_over_target_seconds_total`` say when it cannot. Milliseconds, above 0,
    up to 3600000; unset: by priority (:data:`DEFAULT_LATENCY_TARGET_MS`).

    ``max_batch_size``: this pipeline's largest batch (1..4096); unset: ``batching.max_batch_size``
    where that is set, else the workload's own (``Workload.max_batch_size``: trades and iot
    64, video 4, other workloads 4).
    """

    name: str = Field(min_length=1)
    input_topic: str = Field(min_length=1)
    output_topic: str = Field(min_length=1)
    workload: str = Field(min_length=1)
    dlq_topic: str | None = None
    priority: PriorityName | None = None  # default: the workload's (trades high, video low)
    precision: ModelPrecision | None = None  # default: worker.precision
    options: dict[str, Any] = Field(default_factory=dict)
    # the input value format: json, or avro / protobuf / jsonschema through schema_registry
    # (the workload must read it)
    format: Literal["json", "avro", "protobuf", "jsonschema"] = "json"
    # the results' value format; default: the input's (avro / protobuf / jsonschema: framed
    # with the id of a result schema registered at start-up)
    output_format: Literal["json", "avro", "protobuf", "jsonschema"] | None = None
    # versioned model source; None: the workload's own model (version "builtin")
    model: ModelConfig | None = None
    # deadlines (docs/guarantees.md): a record older than this (ms after its Kafka timestamp)
    # when its batch is cut is not run; None: only its streamproc.deadline header expires it
    max_age_ms: int | None = Field(default=None, gt=0)
    # what a record past its deadline becomes: an `expired` result on the output topic, or a
    # dead-letter record (stage `deadline`)
    on_expired: Literal["result", "dead_letter"] = "result"
    # when a record expires at the cut: also once its batch is expected to be acknowledged
    # after its deadline (predicted: the 90th percentile of the lane's recent cut-to-
    # acknowledgement times), or only once its deadline has passed
    expire_when: Literal["passed", "predicted"] = "predicted"
    # the P99 consume -> acknowledgement the batcher aims for; None: by priority
    latency_target_ms: float | None = None
    # the largest batch; None: batching.max_batch_size, else the workload's
    max_batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE_LIMIT)
    # results must follow their inputs' order per key (a stateful workload): a share group
    # (kafka.group_type: share), which keeps no order, is refused for this pipeline
    ordered: bool = False

    @field_validator("latency_target_ms", mode="before")
    @classmethod
    def _latency_target(cls, value: Any) -> Any:
        if value is None:
            return value
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not 0.0 < number <= LATENCY_TARGET_MAX_MS:  # NaN too
            defaults = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LATENCY_TARGET_MS.items())
            raise ValueError(
                f"must be a number of milliseconds above 0, up to {LATENCY_TARGET_MAX_MS:.0f}; "
                f"left out, the priority's default ({defaults})"
            )
        return number

    def max_batch_rows(self, batching: BatchingConfig, workload_max: int) -> int:
        """The pipeline's largest batch in rows: its ``max_batch_size``, else
        ``batching.max_batch_size``, else ``workload_max`` (its workload's
        ``Workload.max_batch_size``)."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        if batching.max_batch_size is not None:
            return batching.max_batch_size
        return workload_max

    def latency_target_s(self, priority: Priority) -> float:
        """The latency target in seconds: ``latency_target_ms``, else the default of
        ``priority`` (the pipeline's class, resolved with its workload's)."""
        target_ms = self.latency_target_ms
        if target_ms is None:
            target_ms = DEFAULT_LATENCY_TARGET_MS[priority.label]
        return target_ms / 1000.0

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        model_file = value.endswith((".pt", ".ts", ".pt2"))
        if value in BUILTIN_WORKLOADS or ":" in value or model_file:
            return value
        raise ValueError(
            f"unknown workload {value!r}; allowed: one of {list(BUILTIN_WORKLOADS)}, "
            "a TorchScript (*.pt, *.ts) or torch.export (*.pt2) file path, "
            "or 'package.module:factory'"
        )

    @property
    def result_format(self) -> str:
        """``output_format``, else ``format``."""
        return self.output_format or self.format

    @property
    def dead_letter_topic(self) -> str:
        """The dead-letter topic: ``dlq_topic`` or ``<input_topic>.dlq``."""
        return self.dlq_topic or f"{self.input_topic}.dlq"


class BuffersConfig(_Section):
    """Per-partition ring buffers. A ring's fill is the larger of its records as a fraction of
    ``ring_capacity`` and its bytes (keys and values) as a fraction of ``ring_capacity_bytes``;
    a partition pauses when the fill reaches ``high_watermark`` and resumes at
    ``low_watermark``. The records bound rings of light messages, the bytes rings of large
    ones, so one default serves both: with 16,384 records and 8 MiB, trades (159 B) pause at
    12,288 records, iot (893 B) at about 7,000, video frames (28 KB JPEG) at about 220
    (docs/operations.md, Sizing memory).

    ``max_unacknowledged_bytes`` bounds, per pipeline, the inputs (keys and values) whose
    results are produced and not yet acknowledged: they are kept until then, because a result
    refused for good dead-letters its input. At the bound the results wait for
    acknowledgements, the devices keep their batches, and the rings fill and pause
    (``streamproc.output.window``)."""

    ring_capacity: int = Field(default=16_384, ge=2, le=1_000_000)
    ring_capacity_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1 << 40)
    max_unacknowledged_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1 << 40)
    high_watermark: float = Field(default=0.75, gt=0.0, le=1.0)
    low_watermark: float = Field(default=0.25, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> BuffersConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"buffers.low_watermark ({self.low_watermark}) must be below "
                f"buffers.high_watermark ({self.high_watermark})"
            )
        return self


PriorityName = Literal["high", "normal", "low"]
MAX_WAIT_LIMIT_MS = 3_600_000.0
"""The largest accepted max wait (1 hour): finite, so the dispatcher's timed waits stay valid."""
WaitMs = Annotated[float, Field(ge=0.0, le=MAX_WAIT_LIMIT_MS, allow_inf_nan=False)]


def _default_priority_waits() -> dict[PriorityName, float]:
    return {"high": 2.0, "low": 50.0}


class BatchingConfig(_Section):
    """When the batcher cuts a batch.

    ``max_batch_size``: the largest batch of every pipeline without its own
    (``pipelines[].max_batch_size``); unset (the default), each pipeline takes its workload's
    (``Workload.max_batch_size``: trades and iot 64, video 4; 4 for a workload that names
    none): a light record's per-batch costs are spread over many rows, a frame's batch stays
    one a CPU runs in well under a second.
    ``max_wait_ms`` is the normal class's longest wait after consume; ``priority_max_wait_ms``
    overrides it per class (latency-critical ``high`` cuts early). ``adaptive_batch_size``
    measures the device (calibrated at start-up on zero batches, then on every batch) and aims
    for the throughput-optimal size up to ``max_batch_size`` (the smallest within 5 % of it).
    A batch below that size is also cut before its deadline when the typical gap between the
    lane's recent messages is longer than the time left (waiting would add latency only).
    """

    max_batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE_LIMIT)
    max_batch_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    max_wait_ms: WaitMs = 20.0
    priority_max_wait_ms: dict[PriorityName, WaitMs] = Field(
        default_factory=_default_priority_waits
    )
    adaptive_batch_size: bool = True

    @property
    def max_wait_s(self) -> dict[Priority, float]:
        """Seconds per priority class (a class without its own ``priority_max_wait_ms`` waits
        ``max_wait_ms``)."""
        waits = {Priority.parse(name): ms for name, ms in self.priority_max_wait_ms.items()}
        return {p: waits.get(p, self.max_wait_ms) / 1000.0 for p in Priority}


_DEVICE_ENTRY = re.compile(r"cpu|cuda(:\d+)?")
_DEVICES_ALLOWED = (
    "allowed: auto, or a non-empty list of cpu and cuda:N entries (e.g. [cuda:0, cuda:1] or "
    "[cpu, cpu]); a comma-separated string works too"
)


def fused_lane_refusal(devices: list[str]) -> str:
    """The error of ``worker.fused_lane: always`` on ``devices`` (not one CPU device): at config
    load for named devices, at start-up for ``auto`` ones."""
    return (
        f"worker.fused_lane: always needs one CPU device (worker.device: cpu, or "
        f"worker.devices: [cpu]), not {devices}; allowed: auto, never, always"
    )


class WorkerConfig(_Section):
    """The device workers and their host-side pools.

    Devices: ``devices`` lists the devices every pipeline runs on, one device worker (model
    instance, CUDA streams, output buffers, in-flight limit) per device per pipeline:
    ``auto`` (every visible CUDA device, else one cpu), or entries ``cpu`` / ``cuda:N``
    (``cuda`` means ``cuda:0``; ``cpu`` may repeat: logical devices sharing the cores, a
    ``cuda:N`` may not). When set it overrides ``device``; unset (the default), the single
    ``device`` is used: ``auto`` (cuda:0 when CUDA is visible, else cpu), ``cpu`` or ``cuda``.
    A CUDA device the process does not see fails at start-up. Each cut batch goes to the device
    expected to finish it first (``streamproc.dispatch.placement``).

    ``max_in_flight_batches`` is per device: batches between cut and produce on one device
    (and its output buffer sets). ``staging_buffers`` is per device too: a pipeline's staging
    pool has ``staging_buffers x devices`` slabs. ``device_stall_timeout_s``: a device that
    has not completed its oldest batch for this long is reported stalled (it gets no new
    batch meanwhile anyway: it is at its in-flight limit).

    ``precision``: the models' precision (``fp32``, ``bf16``, ``fp16``, ``int8``), unless a
    ``pipelines[]`` entry sets its own; checked at start-up against the device and the workload
    (``streamproc/models/precision.py`` has the table).

    Decode workers (threads, or processes with ``decode_mode: process``), shared by every
    pipeline: ``decode_workers`` is the count at start. With neither bound set the count stays
    there. Setting ``decode_workers_max`` and/or ``decode_workers_min`` lets the count follow
    the load between them (``streamproc.decode.sizing``): it grows while waiting for decode
    dominates a pipeline's dispatch time and shrinks while decode is idle. An unset bound
    defaults to 1 (min) or to ``decode_workers`` (max); a ``decode_workers`` left at its default
    is moved into the bounds.

    ``decode_inline`` (``decode_mode: thread`` only): ``auto`` lets each pipeline decode on its
    dispatcher thread instead of the decode threads wherever that measures cheaper per record
    (light JSON payloads; ``DecodeRoutePolicy`` in ``streamproc.decode.sizing``); ``never``
    always uses the decode threads; ``always`` always decodes inline. Decode processes are never
    bypassed.

    ``fused_lane``: where a pipeline runs on one CPU device, ``auto`` lets it run each batch
    on one thread (cut, decode, model, encode, produce: no hand-off between threads) or staged
    over its dispatcher, device and results threads, by measuring both (staged where its
    overlap shortens the lane's cycle per record by 10 %, else fused where it costs 10 % less
    CPU per record; ``streamproc/dispatch/fusion.py``; fused at start); ``never`` always
    stages; ``always``
    always fuses and fails at start-up where a pipeline runs on a GPU or on several devices.
    A GPU lane is always staged (the device works while Python prepares the next batch).

    ``priority_admission`` (pipelines of different priorities in one process): a lane's launch
    on a device waits while a more urgent lane's batch is pending there, at most
    ``priority_max_defer_ms``, and on a CPU a less urgent call runs with half its intra-op
    threads while a more urgent lane is active (``streamproc/dispatch/admission.py``);
    ``false`` lets the lanes' device threads compete as the OS schedules them.

    Model failures (``streamproc/device/recovery.py``): a batch whose model call raises is
    narrowed down to the rows that fail alone (only those are dead-lettered, stage ``model``).
    ``on_model_failure`` says what a model judged broken (failing for every row) does:
    ``hold`` (default: no row is dead-lettered; the batch is held and tried again with backoff,
    on the last version that served well where the model source has one, else on the same
    model, until a try runs; meanwhile the lane takes no batch, its partitions pause, ``/readyz``
    is not ready; ``streamproc/device/hold.py``), ``dead_letter`` (its rows are dead-lettered,
    as any failing row) or ``stop`` (the pipeline stops with a non-zero exit, those rows
    uncommitted). A device out-of-memory error
    is never the rows' fault: the batch runs again in smaller parts and the batch cap falls;
    it doubles again after each ``oom_recovery_s`` seconds without one, up to the largest batch
    that fitted at warm-up.
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: Literal["auto"] | tuple[str, ...] | None = None
    device_stall_timeout_s: float = Field(default=30.0, gt=0)
    precision: ModelPrecision = "fp32"
    max_in_flight_batches: int = Field(default=2, ge=1, le=64)
    staging_buffers: int = Field(default=4, ge=2, le=256)
    decode_workers: int = Field(default=2, ge=1, le=64)
    decode_workers_min: int | None = Field(default=None, ge=1, le=64)
    decode_workers_max: int | None = Field(default=None, ge=1, le=64)
    decode_mode: Literal["thread", "process"] = "thread"
    decode_inline: Literal["auto", "never", "always"] = "auto"
    fused_lane: Literal["auto", "never", "always"] = "auto"
    cuda_streams: int = Field(default=2, ge=1, le=16)
    torch_threads: int | None = Field(default=None, ge=1)
    max_message_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    priority_admission: bool = True
    priority_max_defer_ms: float = Field(default=250.0, ge=0, le=60_000)
    on_model_failure: Literal["hold", "dead_letter", "stop"] = "hold"
    oom_recovery_s: float = Field(default=30.0, gt=0)

    @field_validator("devices", mode="before")
    @classmethod
    def _device_list(cls, value: object) -> object:
        if value is None or value == "auto":
            return value
        if isinstance(value, str):
            value = [item for item in value.split(",") if item.strip()]
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(_DEVICES_ALLOWED)
        names: list[str] = []
        for item in value:
            name = item.strip() if isinstance(item, str) else None
            if name is None or not _DEVICE_ENTRY.fullmatch(name):
                raise ValueError(f"unknown device {item!r}; {_DEVICES_ALLOWED}")
            names.append("cuda:0" if name == "cuda" else name)
        repeated = sorted({n for n in names if n != "cpu" and names.count(n) > 1})
        if repeated:
            raise ValueError(f"{repeated} listed more than once (only cpu may repeat)")
        return tuple(names)

    @model_validator(mode="after")
    def _fusable(self) -> WorkerConfig:
        devices = self.devices if isinstance(self.devices, tuple) else None
        named = devices or (None if self.device == "auto" else (self.device,))
        if self.fused_lane == "always" and named is not None and named != ("cpu",):
            raise ValueError(fused_lane_refusal(list(named)))
        return self

    @model_validator(mode="after")
    def _enough_staging(self) -> WorkerConfig:
        if self.staging_buffers < self.max_in_flight_batches + 1:
            raise ValueError(
                f"worker.staging_buffers ({self.staging_buffers}) must be at least "
                f"worker.max_in_flight_batches + 1 ({self.max_in_flight_batches + 1})"
            )
        return self

    @model_validator(mode="after")
    def _decode_bounds(self) -> WorkerConfig:
        low, high = self.decode_workers_bounds
        if low > high:
            raise ValueError(
                f"worker.decode_workers_min ({low}) must be at most "
                f"worker.decode_workers_max ({high})"
            )
        if "decode_workers" in self.model_fields_set and not low <= self.decode_workers <= high:
            raise ValueError(
                f"worker.decode_workers ({self.decode_workers}, the count at start) must be "
                f"within worker.decode_workers_min..decode_workers_max ({low}..{high})"
            )
        return self

    @property
    def decode_workers_bounds(self) -> tuple[int, int]:
        """(min, max) decode workers; equal (a fixed count) when neither bound is set."""
        if self.decode_workers_min is None and self.decode_workers_max is None:
            return self.decode_workers, self.decode_workers
        return (
            1 if self.decode_workers_min is None else self.decode_workers_min,
            self.decode_workers if self.decode_workers_max is None else self.decode_workers_max,
        )

    @property
    def decode_workers_start(self) -> int:
        """The decode workers at start: ``decode_workers``, moved into the bounds."""
        low, high = self.decode_workers_bounds
        return min(max(self.decode_workers, low), high)


class MetricsConfig(_Section):
    """Prometheus ``/metrics`` and the ``/healthz``, ``/readyz`` probes; ``port: 0`` disables
    the endpoint (the metrics are still kept in-process)."""

    port: int = Field(default=9108, ge=0, le=65535)
    host: str = "0.0.0.0"
    lag_interval_s: float = Field(default=5.0, gt=0)
    stall_timeout_s: float = Field(default=60.0, gt=0)
    liveness_timeout_s: float = Field(default=30.0, gt=0)


MIN_TOKEN_CHARS = 16
"""``admin.token``'s least length: a guessable token would open the admin endpoint."""


class AdminConfig(_Section):
    """The admin endpoint on the metrics port (``POST /models/<pipeline>``, what ``streamproc
    model use`` calls): every call must carry ``Authorization: Bearer <token>``. Without a token
    (here or ``$STREAMPROC_ADMIN_TOKEN``) every admin call is refused (403). The token is a
    secret: never logged, never in ``repr``."""

    token: SecretStr | None = None

    @field_validator("token")
    @classmethod
    def _strong_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().strip()) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"at least {MIN_TOKEN_CHARS} characters (not blank), e.g. from "
                "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _token_from_environment(cls, data: Any) -> Any:
        found = os.environ.get("STREAMPROC_ADMIN_TOKEN")
        if isinstance(data, dict) and data.get("token") is None and found:
            return {**data, "token": found}
        return data


class SchemaRegistryConfig(_Section):
    """The Schema Registry of ``pipelines[].format: avro`` (a Confluent-compatible API: Confluent
    Schema Registry, or Apicurio's ``/apis/ccompat/v7``). ``basic_auth_user_info``
    (``user:password``) is a secret: never logged, never in ``repr``; give it through
    ``STREAMPROC_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO`` rather than the file."""

    # default: $SCHEMA_REGISTRY_URL (what `streamproc registry start` prints), as produce and demo
    url: str | None = Field(default=None, pattern=r"^https?://")
    basic_auth_user_info: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    request_timeout_s: float = Field(default=5.0, gt=0)
    startup_timeout_s: float = Field(default=60.0, gt=0)
    subject_name_strategy: Literal["topic", "record", "topic_record"] = "topic"
    auto_register_schemas: bool = True
    retry_backoff_s: float = Field(default=0.1, gt=0)
    retry_backoff_max_s: float = Field(default=5.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _url_from_environment(cls, data: Any) -> Any:
        # $SCHEMA_REGISTRY_URL when it is a URL: a JSON-only config never fails on it
        found = os.environ.get("SCHEMA_REGISTRY_URL", "")
        if isinstance(data, dict) and data.get("url") is None and re.match(r"^https?://", found):
            return {**data, "url": found}
        return data

    @model_validator(mode="after")
    def _backoff_ordered(self) -> SchemaRegistryConfig:
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(
                f"schema_registry.retry_backoff_max_s ({self.retry_backoff_max_s}) must be at "
                f"least schema_registry.retry_backoff_s ({self.retry_backoff_s})"
            )
        return self

    def client_settings(self) -> dict[str, Any]:
        """The ``SchemaRegistryClient`` configuration (holds the secret: never log it).

        Raises:
            ValueError: no ``url``.
        """
        if not self.url:
            raise ValueError("schema_registry.url is not set")
        settings: dict[str, Any] = {"url": self.url, "timeout": self.request_timeout_s}
        for key in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location"):
            value = getattr(self, key)
            if value:
                settings[key.replace("_", ".")] = value
        if self.basic_auth_user_info is not None:
            settings["basic.auth.credentials.source"] = "USER_INFO"
            settings["basic.auth.user.info"] = self.basic_auth_user_info.get_secret_value()
        return settings


class LoggingConfig(_Section):
    """Log level and format (``auto``: JSON when stderr is not a terminal)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class TracingConfig(_Section):
    """OpenTelemetry traces of the record path (``streamproc.tracing``), exported over OTLP/HTTP
    (protobuf) to ``endpoint``: the collector's base URL (``/v1/traces`` is appended), by
    default ``$OTEL_EXPORTER_OTLP_ENDPOINT`` (what ``streamproc tracing start`` prints). Tracing
    is on when an endpoint is known and ``enabled`` is true; off, nothing of it runs. An
    endpoint that is not an ``http(s)://`` URL (the environment's too) fails at start-up.

    ``sample_ratio``: the share of batches whose records carry no sampled ``traceparent`` that
    start a trace of their own (a parent-based sampler: a record's sampled context is always
    followed). ``max_links``: the links of one batch's ``process`` span to its records' contexts
    (those past it counted in ``streamproc_trace_links_dropped_total``). ``max_queue_spans``: the
    exporter's queue; a span that finds it full is dropped and counted
    (``streamproc_trace_spans_dropped_total{reason="queue_full"}``), never waited for.
    ``export_timeout_s``: one export's deadline (retries included); the spans of an export that
    fails are counted dropped (``reason="export_failed"``). ``headers``: sent with every export
    (e.g. an API key: give it through ``STREAMPROC_TRACING__HEADERS``; never logged)."""

    enabled: bool = True
    endpoint: str | None = None
    sample_ratio: float = Field(default=0.01, ge=0, le=1)
    max_links: int = Field(default=128, ge=0, le=10_000)
    max_queue_spans: int = Field(default=4096, ge=16, le=1_000_000)
    export_timeout_s: float = Field(default=5.0, gt=0, le=60)
    service_name: str = Field(default="streamproc", min_length=1)
    headers: dict[str, SecretStr] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _endpoint_from_environment(cls, data: Any) -> Any:
        found = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if isinstance(data, dict) and data.get("endpoint") is None and found:
            return {**data, "endpoint": found}  # checked as if given here
        return data

    @field_validator("endpoint")
    @classmethod
    def _a_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(
                f"an http:// or https:// URL (the collector's OTLP/HTTP base, e.g. "
                f"http://127.0.0.1:4318), got {value!r}; from $OTEL_EXPORTER_OTLP_ENDPOINT "
                "when the config gives none"
            )
        return value

    @property
    def active(self) -> bool:
        """Whether traces are made and exported: ``enabled`` and an ``endpoint`` known."""
        return self.enabled and self.endpoint is not None
