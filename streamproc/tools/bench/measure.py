"""What the bench reads off the broker, and the statistics it prints.

Every topic the bench creates has ``message.timestamp.type=LogAppendTime``: the broker stamps
each record with the time it appended it, whatever the producer sent. So:

* throughput = ``(n - 1) / (last - first output append time)`` on each contender's own output
  topic, the same rule for every contender (start-up and model loading excluded);
* end-to-end latency = output append time - input append time, per input record (matched by the
  ``streamproc.source.partition``/``offset`` headers that streamproc and the floors write): the
  replayer's own leg is left out, and the output's linger and append are counted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_OFFSET, H_PARTITION, H_TIMING, parse_timing
from streamproc.tools.verify import TopicDump

LOG_APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}
"""Topic config of every bench topic: record timestamps are the broker's append time."""


def create_topics(bootstrap: str, topics: Sequence[str], partitions: int) -> None:
    """Create ``topics`` (``partitions`` each) with broker append timestamps."""
    ensure_topics(bootstrap, dict.fromkeys(topics, partitions), topic_config=LOG_APPEND_TIME)


@dataclass(frozen=True)
class OutputStats:
    """A contender's output topic: record count, throughput (msg/s, None below 2 records or a
    zero span) and the first and last append times (ms since the epoch)."""

    count: int
    rate_msg_s: float | None
    first_ms: int | None
    last_ms: int | None


def output_stats(dump: TopicDump) -> OutputStats:
    """Throughput and span of the records in ``dump`` (see the module docstring)."""
    stamps = sorted(ts for _, _, _, ts in dump.records.values())
    if not stamps:
        return OutputStats(0, None, None, None)
    span_s = (stamps[-1] - stamps[0]) / 1000.0
    rate = (len(stamps) - 1) / span_s if len(stamps) > 1 and span_s > 0 else None
    return OutputStats(len(stamps), rate, stamps[0], stamps[-1])


@dataclass(frozen=True)
class Latency:
    """End-to-end latency of one paced run (ms; see the module docstring).

    Attributes:
        p50_ms, p99_ms: quantiles of output append - input append.
        count: inputs matched with a result.
        quantiles_ms: the 0th to 100th percentiles (101 values; the CDF plot).
        p99_processing_ms: P99 of ``processing_ms`` in the ``streamproc.timing`` header (consumed ->
            result produced, inside the consumer).
    """

    p50_ms: float
    p99_ms: float
    count: int
    quantiles_ms: list[float]
    p99_processing_ms: float | None


def end_to_end(inputs: TopicDump, outputs: TopicDump) -> Latency | None:
    """Match every result of ``outputs`` with its input record by its source headers (the
    input topic is a single topic); None when nothing matched."""
    input_ms = {coord: ts for coord, (_, _, _, ts) in inputs.records.items()}
    latencies: list[float] = []
    processing: list[float] = []
    for _, _, headers, ts in outputs.records.values():
        try:
            coord = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        except (KeyError, ValueError):
            continue
        appended_ms = input_ms.get(coord)
        if appended_ms is None:
            continue
        latencies.append(float(ts - appended_ms))
        if H_TIMING in headers:
            processing.append(parse_timing(headers[H_TIMING])["processing_ms"])
    if not latencies:
        return None
    values = np.asarray(latencies, dtype=float)
    return Latency(
        float(np.percentile(values, 50)),
        float(np.percentile(values, 99)),
        len(latencies),
        np.percentile(values, np.linspace(0, 100, 101)).tolist(),
        float(np.percentile(processing, 99)) if processing else None,
    )


@dataclass(frozen=True)
class Spread:
    """Median, minimum and maximum of a contender's repetitions."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        """The spread of the values that are not None; None when there are none."""
        kept = [v for v in values if v is not None]
        if not kept:
            return None
        return cls(statistics.median(kept), min(kept), max(kept), len(kept))

    def format(self) -> str:
        """``median [min-max]`` (the range left out for a single value)."""
        if self.count == 1:
            return format_number(self.median)
        return (
            f"{format_number(self.median)} [{format_number(self.low)}-{format_number(self.high)}]"
        )


def format_number(value: float) -> str:
    """A rate, CPU time or ratio with the digits that matter: ``175,430``, ``312``, ``30.6``,
    ``2.9``, ``0.31``."""
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 1:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_spread(values: Sequence[float | None]) -> str:
    """:meth:`Spread.format` of ``values``, or ``-`` when none is known."""
    spread = Spread.of(values)
    return "-" if spread is None else spread.format()


def paired_ratios(
    numerators: Sequence[float | None], denominators: Sequence[float | None]
) -> list[float]:
    """Per repetition ``i`` (runs ``i`` of two contenders were neighbours in time), the ratio
    ``numerators[i] / denominators[i]``; repetitions missing either value are left out."""
    return [
        a / b
        for a, b in zip(numerators, denominators, strict=False)
        if a is not None and b is not None and b > 0
    ]
