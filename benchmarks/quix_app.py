"""The Quix Streams contender: the same decode + model (batch of 1) + encode per message,
configured as Quix's docs recommend (Application + StreamingDataFrame, at-least-once).

Run by ``streamproc bench`` with the Quix virtual environment's Python:
``quix_app.py BOOTSTRAP SOURCE SINK WORKLOAD COUNT``; exits after COUNT messages.
"""

from __future__ import annotations

import sys
import time
import uuid

import numpy as np
import torch
from quixstreams import Application

from streamproc.errors import RecordError
from streamproc.records import Record, TopicPartition
from streamproc.workloads import load_workload


def main() -> None:
    bootstrap, source, sink, workload_name, count = sys.argv[1:6]
    limit = int(count)
    workload = load_workload(workload_name)
    model = workload.build_model(torch.device("cpu"))
    row = np.zeros((1, *workload.item_shape), dtype=workload.item_dtype)
    done = {"n": 0}
    holder: dict[str, Application] = {}

    def processed(topic: str, partition: int, offset: int) -> None:
        done["n"] += 1
        if done["n"] >= limit:
            holder["app"].stop()

    app = Application(
        broker_address=bootstrap,
        consumer_group=f"quix-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        loglevel="WARNING",
        auto_create_topics=False,
        on_message_processed=processed,
    )
    holder["app"] = app

    def infer(value: bytes, key: bytes, timestamp: int, headers: object) -> bytes | None:
        record = Record(
            TopicPartition(source, 0),
            0,
            key,
            value,
            tuple(headers or ()),
            timestamp,
            time.monotonic(),
        )
        try:
            workload.decode(record, row[0])
        except RecordError:
            return None
        outputs = model(torch.from_numpy(row))
        return workload.encode(record, tuple(o[0].numpy() for o in outputs)).value

    inp = app.topic(source, value_deserializer="bytes", key_deserializer="bytes")
    out = app.topic(sink, value_serializer="bytes", key_serializer="bytes")
    sdf = app.dataframe(inp)
    sdf = sdf.apply(infer, metadata=True)
    sdf = sdf.filter(lambda value: value is not None)
    # stamp outputs with processing time, as the other contenders' producers do
    sdf = sdf.set_timestamp(lambda value, key, timestamp, headers: int(time.time() * 1000))
    sdf.to_topic(out)
    app.run()


if __name__ == "__main__":
    main()
