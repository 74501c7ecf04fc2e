"""The headers streamproc writes, byte for byte: consumers of the output topics read them."""

from __future__ import annotations

import pytest

from streamproc.output.headers import (
    MAX_ERROR_MESSAGE_CHARS,
    ResultHeaders,
    dead_letter_headers,
    parse_timing,
    source_headers,
)
from streamproc.records import Record, TopicPartition


def record(partition: int, offset: int, consumed_at_s: float = 0.0) -> Record:
    tp = TopicPartition("video.frames", partition)
    return Record(tp, offset, b"k", b"value", (("camera", b"7"),), 0, consumed_at_s, 1)


def test_source_headers_are_ascii_decimal_coordinates() -> None:
    assert source_headers(record(12, 34567)) == (
        ("streamproc.source.topic", b"video.frames"),
        ("streamproc.source.partition", b"12"),
        ("streamproc.source.offset", b"34567"),
    )


def test_result_headers_per_partition_with_timings_and_version_then_the_workloads_own() -> None:
    headers = ResultHeaders("video.frames")
    built = headers.build(
        [record(0, 5, consumed_at_s=10.0), record(3, 9, consumed_at_s=10.5)],
        [(("label", b"cat"),), ()],
        cut_at_s=10.75,
        inference_ms=2.0,
        now_s=11.0,
        version=b"7",
    )
    assert built == [
        [
            ("streamproc.source.topic", b"video.frames"),
            ("streamproc.source.partition", b"0"),
            ("streamproc.source.offset", b"5"),
            (
                "streamproc.timing",
                b"queue_wait_ms=750.000;inference_ms=2.000;processing_ms=1000.000",
            ),
            ("streamproc.model.version", b"7"),
            ("label", b"cat"),
        ],
        [
            ("streamproc.source.topic", b"video.frames"),
            ("streamproc.source.partition", b"3"),
            ("streamproc.source.offset", b"9"),
            (
                "streamproc.timing",
                b"queue_wait_ms=250.000;inference_ms=2.000;processing_ms=500.000",
            ),
            ("streamproc.model.version", b"7"),
        ],
    ]
    assert parse_timing(built[1][3][1]) == {
        "queue_wait_ms": 250.0,
        "inference_ms": 2.0,
        "processing_ms": 500.0,
    }
    with pytest.raises(ValueError):
        headers.build([record(0, 1)], [], 0.0, 0.0, 0.0)


def test_results_of_one_poll_share_a_timing_and_each_keeps_its_own_header_list() -> None:
    """Records of a batch consumed by different polls, interleaved across partitions: each
    result's timing is its own consume time's; extending one result's headers (a trace's)
    leaves the others as they were."""
    headers = ResultHeaders("video.frames")
    consumed = [10.0, 10.5, 10.0, 10.25, 10.5, 10.0]
    records = [record(i % 2, i, consumed_at_s=s) for i, s in enumerate(consumed)]
    built = headers.build(records, [()] * 6, cut_at_s=11.0, inference_ms=1.5, now_s=12.0)
    timings = [parse_timing(dict(result)["streamproc.timing"]) for result in built]
    assert timings == [
        {
            "queue_wait_ms": (11.0 - s) * 1000,
            "inference_ms": 1.5,
            "processing_ms": (12.0 - s) * 1000,
        }
        for s in consumed
    ]
    assert [dict(result)["streamproc.source.offset"] for result in built] == [
        b"%d" % i for i in range(6)
    ]
    built[0].append(("traceparent", b"00-1"))
    assert [len(result) for result in built] == [6, 5, 5, 5, 5, 5]


def test_dead_letter_headers_keep_the_inputs_then_add_the_error() -> None:
    message = "é" + "x" * (2 * MAX_ERROR_MESSAGE_CHARS)
    headers = dead_letter_headers(record(2, 8), "decode", "DecodeError", message, True)
    assert headers[:6] == [
        ("camera", b"7"),
        ("streamproc.source.topic", b"video.frames"),
        ("streamproc.source.partition", b"2"),
        ("streamproc.source.offset", b"8"),
        ("streamproc.error.stage", b"decode"),
        ("streamproc.error.class", b"DecodeError"),
    ]
    name, text = headers[6]
    assert name == "streamproc.error.message"
    assert text == message[:MAX_ERROR_MESSAGE_CHARS].encode()
    assert headers[7:] == [("streamproc.error.value_omitted", b"5")]
    kept = dead_letter_headers(record(2, 8), "model", "RuntimeError", "boom", False)
    assert [name for name, _ in kept][-1] == "streamproc.error.message"


def test_parse_timing_refuses_what_it_did_not_write() -> None:
    with pytest.raises(ValueError, match=r"not a streamproc\.timing header"):
        parse_timing(b"queue_wait_ms")
