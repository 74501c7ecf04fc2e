"""All three built-in workloads plus the example user pipeline in one consumer process, with
every kind of bad record mixed among valid ones."""

from __future__ import annotations

import itertools
import uuid

import orjson
import pytest
from confluent_kafka import Producer

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_CLASS, H_STAGE
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import messages
from streamproc.tools.verify import read_topic, verify
from streamproc.workloads.iot import WINDOW
from streamproc.workloads.sampledata import CYCLING_CHANNELS

pytestmark = pytest.mark.workloads

GOOD = {"video": 24, "iot": 40, "trades": 200, "zscore": 30}
BAD = {
    "video": [b"\xff\xd8\xff\xe0" + b"\x00" * 64, b"", None, b"\xff\xd8" + b"\x00" * 400_000],
    "iot": [
        b'{"device_id": "x", "ts_ms": 1,',  # malformed JSON
        b'{"device_id": "x"}',  # wrong schema
        orjson.dumps(
            {
                "device_id": "x",
                "ts_ms": 1,
                "channels": list(CYCLING_CHANNELS),
                "window": [[0.0] * 4] * (WINDOW + 3),
            }
        ),  # wrong window length
        b"",
        None,
    ],
    "trades": [b"not json", orjson.dumps({"symbol": "X", "price": "cheap"}), b"", None],
    "zscore": [b'{"sensor": "a", "values": [1, 2]}', b"[]", None],
}


def zscore_messages() -> itertools.count:  # type: ignore[type-arg]
    return (
        {"sensor": f"s{i % 5}", "values": [20.0 + (i % 7) * 0.1] * 7 + [20.0 + i % 11]}
        for i in itertools.count()
    )


def test_four_pipelines_in_one_process_with_dead_letters(bootstrap_servers: str) -> None:
    suffix = uuid.uuid4().hex[:6]
    topics = {w: (f"{w}.in.{suffix}", f"{w}.out.{suffix}") for w in GOOD}
    ensure_topics(
        bootstrap_servers,
        {
            name: (1 if name.endswith(".dlq") else 2)
            for inp, out in topics.values()
            for name in (inp, out, f"{inp}.dlq")
        },
    )
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all"})
    for workload, count in GOOD.items():
        inp = topics[workload][0]
        if workload == "zscore":
            good = (
                (f"s{i}".encode(), orjson.dumps(doc), [])
                for i, doc in enumerate(itertools.islice(zscore_messages(), count))
            )
        else:
            good = (
                (m.key, m.value, list(m.headers))
                for m in itertools.islice(messages(workload), count)
            )
        bad = iter(BAD[workload])
        for i, (key, value, headers) in enumerate(good):
            producer.produce(inp, key=key, value=value, headers=headers, partition=i % 2)
            if i % 3 == 1 and (bad_value := next(bad, "done")) != "done":
                producer.produce(
                    inp, key=b"bad", value=bad_value, partition=i % 2, headers=[("origin", b"test")]
                )
        assert next(bad, "done") == "done", f"too few good {workload} records to mix in"
    assert producer.flush(30) == 0

    group = f"g-{suffix}"
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": group,
                "commit_interval_ms": 200,
            },
            "pipelines": [
                {
                    "name": w,
                    "input_topic": inp,
                    "output_topic": out,
                    "workload": "examples.zscore:make_workload" if w == "zscore" else w,
                    **({"options": {"window": 8}} if w == "zscore" else {}),
                }
                for w, (inp, out) in topics.items()
            ],
            "worker": {"max_message_bytes": 300_000},
            "metrics": {"port": 0},
        }
    )
    summary = Pipeline(config).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error

    for workload, (inp, out) in topics.items():
        verdict = verify(bootstrap_servers, inp, out, f"{inp}.dlq", group)
        print(
            f"\n{workload}: inputs={verdict.inputs} results={verdict.results} "
            f"dead={verdict.dead_lettered} missing={len(verdict.missing)} "
            f"duplicates={verdict.duplicates} committed==end={verdict.committed_equals_end}"
        )
        assert verdict.missing == [] and verdict.duplicates == 0, workload
        assert verdict.results == GOOD[workload], workload
        assert verdict.dead_lettered == len(BAD[workload]), workload
        assert verdict.committed_equals_end, workload
        for key, value, headers, _ in read_topic(bootstrap_servers, f"{inp}.dlq").records.values():
            assert key == b"bad" and headers["origin"] == b"test"
            assert headers[H_STAGE] == b"decode" and headers[H_CLASS] == b"DecodeError"
            assert value in BAD[workload]
        results = read_topic(bootstrap_servers, out).records.values()
        doc = orjson.loads(next(iter(results))[1])
        expected_field = {
            "video": "top5",
            "iot": "anomaly",
            "trades": "anomaly",
            "zscore": "alert",
        }[workload]
        assert expected_field in doc
