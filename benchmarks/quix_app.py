"""The Quix Streams contender: the same decode + model (batch of 1) + encode per message,
configured as Quix's docs recommend (Application + StreamingDataFrame, at-least-once).

Run by ``streamproc bench`` with the Quix virtual environment's Python:
``quix_app.py BOOTSTRAP SOURCE SINK WORKLOAD COUNT [TORCH_THREADS]``; exits after COUNT
messages. TORCH_THREADS (default: torch's own choice) is what the bench gives every contender.
Its last output line is ``BENCH-TRACE {json}``: its CPU window from the first message to the
last one processed (:class:`streamproc.tools.bench.cpu.CpuTrace`), from which the bench takes
CPU-µs per message as for every other contender. ``quixstreams`` is imported only in
:func:`main` (it lives in the bench's own virtual environment); :func:`make_infer` needs none.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from streamproc.errors import RecordError
from streamproc.records import Record, TopicPartition
from streamproc.tools.bench.cpu import CpuMeter
from streamproc.workloads import ModelFn, Workload, load_workload

Infer = Callable[[bytes, bytes, int, Sequence[tuple[str, bytes]] | None], bytes | None]


def make_infer(workload: Workload, model: ModelFn, source: str, meter: CpuMeter) -> Infer:
    """The per-message step Quix runs: decode one value into a (1, *item_shape) row, the model
    at batch 1, encode; returns the result value, or None for a record that fails decode
    (filtered out, as streamproc dead-letters it). The first call opens ``meter``'s window."""
    row = np.zeros((1, *workload.item_shape), dtype=workload.item_dtype)
    tp = TopicPartition(source, 0)

    def infer(
        value: bytes, key: bytes, timestamp: int, headers: Sequence[tuple[str, bytes]] | None
    ) -> bytes | None:
        meter.mark_start()  # the first call opens the CPU window
        record = Record(tp, 0, key, value, tuple(headers or ()), timestamp, time.monotonic())
        try:
            workload.decode(record, row[0])
        except RecordError:
            return None
        outputs = model(torch.from_numpy(row))
        return workload.encode(record, tuple(o[0].numpy() for o in outputs)).value

    return infer


def main() -> None:
    from quixstreams import Application  # the bench's Quix environment has it; ours need not

    bootstrap, source, sink, workload_name, count = sys.argv[1:6]
    limit = int(count)
    if len(sys.argv) > 6:
        torch.set_num_threads(int(sys.argv[6]))
    meter = CpuMeter()
    workload = load_workload(workload_name)
    infer = make_infer(workload, workload.build_model(torch.device("cpu")), source, meter)
    done = {"n": 0}
    holder: dict[str, Any] = {}

    def processed(topic: str, partition: int, offset: int) -> None:
        done["n"] += 1
        if done["n"] >= limit:
            meter.mark_end()
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
    inp = app.topic(source, value_deserializer="bytes", key_deserializer="bytes")
    out = app.topic(sink, value_serializer="bytes", key_serializer="bytes")
    sdf = app.dataframe(inp)
    sdf = sdf.apply(infer, metadata=True)
    sdf = sdf.filter(lambda value: value is not None)
    sdf.to_topic(out)  # the bench's topics stamp records with the broker's append time
    app.run()
    print("BENCH-TRACE " + json.dumps(asdict(meter.trace)), flush=True)


if __name__ == "__main__":
    main()
