"""The main job against a real broker: real frames in, one result per frame out, commits."""

from __future__ import annotations

import orjson
import pytest
import torch
from confluent_kafka import Producer

from streamproc.output.headers import H_CLASS, H_MESSAGE, H_OFFSET, H_PARTITION, H_STAGE, H_TOPIC
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import produce, recording_size
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import Topics, make_config

pytestmark = pytest.mark.core


def test_all_frames_once_then_nothing_new_on_rerun(bootstrap_servers: str, topics: Topics) -> None:
    total = recording_size("video")
    assert total == 370
    assert produce("video", topics.input, bootstrap_servers, 3, progress=False) == total

    summary = Pipeline(make_config(bootstrap_servers, topics)).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error

    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    print(
        f"\ninputs={verdict.inputs} results={verdict.results} missing={len(verdict.missing)} "
        f"duplicates={verdict.duplicates} committed={verdict.committed}"
    )
    assert verdict.inputs == total
    assert verdict.results == total and verdict.dead_lettered == 0
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end

    # every result keeps the input key and names its source coordinates
    inputs = read_topic(bootstrap_servers, topics.input).records
    for key, value, headers, _ in read_topic(bootstrap_servers, topics.output).records.values():
        coord = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        assert headers[H_TOPIC].decode() == topics.input
        assert key == inputs[coord][0]
        doc = orjson.loads(value)
        assert doc["source"] == {"topic": topics.input, "partition": coord[0], "offset": coord[1]}
        assert len(doc["top5"]) == 5 and doc["top5"][0]["score"] >= doc["top5"][4]["score"]

    # (b) a second run of the same group processes nothing new
    rerun = Pipeline(make_config(bootstrap_servers, topics))
    summary = rerun.run(exit_when_idle_s=2)
    assert summary.exit_code == 0
    assert sum(sum(sizes.values()) for sizes in summary.batch_sizes.values()) == 0
    again = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    assert again.results == total and again.duplicates == 0


@pytest.mark.parametrize("decode_inline", ["auto", "always"])
def test_bad_records_go_to_the_dead_letter_topic_and_offsets_advance(
    bootstrap_servers: str, topics: Topics, decode_inline: str
) -> None:
    """``always``: every batch decoded on the dispatcher thread dead-letters exactly the same
    records with the same headers as ``auto`` (which starts on the decode threads)."""
    from streamproc.workloads.video import video_frames

    frames = video_frames()[:6]
    bad = {
        b"corrupt": b"\xff\xd8\xff\xe0" + b"\x00" * 64,
        b"empty": b"",
        b"tombstone": None,
        b"truncated": frames[0].jpeg[: len(frames[0].jpeg) // 4],
        b"oversized": frames[1].jpeg + b"\x00" * 300_000,
    }
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all"})
    sent_good = 0
    for i, frame in enumerate(frames):
        producer.produce(topics.input, key=b"cam", value=frame.jpeg, partition=0)
        sent_good += 1
        name = list(bad)[i % len(bad)] if i < len(bad) else None
        if name is not None:
            producer.produce(
                topics.input, key=name, value=bad[name], partition=0, headers=[("origin", b"test")]
            )
    assert producer.flush(30) == 0

    config = make_config(
        bootstrap_servers,
        topics,
        worker={
            "max_message_bytes": 200_000,
            "torch_threads": 1,
            "decode_inline": decode_inline,
        },
    )
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert Pipeline(config).run(exit_when_idle_s=2).exit_code == 0
        assert torch.get_num_threads() == 2  # the process-wide setting is handed back at close
    finally:
        torch.set_num_threads(threads_before)

    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.results == sent_good and verdict.dead_lettered == len(bad)
    assert verdict.committed_equals_end  # offsets moved past every bad record

    inputs = read_topic(bootstrap_servers, topics.input).records
    dead = read_topic(bootstrap_servers, topics.dlq).records.values()
    by_key = {key: (value, headers) for key, value, headers, _ in dead}
    assert set(by_key) == set(bad)
    for name, (value, headers) in by_key.items():
        assert value == bad[name]  # original bytes kept
        assert headers["origin"] == b"test"  # original headers kept
        assert headers[H_STAGE] == b"decode"
        assert headers[H_CLASS] == b"DecodeError"
        coord = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        assert inputs[coord][0] == name
    assert b"tombstone" in by_key[b"tombstone"][1][H_MESSAGE]
    assert b"max_message_bytes" in by_key[b"oversized"][1][H_MESSAGE]
