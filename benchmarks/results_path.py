"""CPU cost of the results path alone: encode, headers and produce of real trades results.

Usage (from a checkout's root, with its .venv; a broker at ``--bootstrap``)::

    .venv/bin/python benchmarks/results_path.py --bootstrap 127.0.0.1:9092 --label new

Builds 100 batches of 256 real trade records (the workload's replay data) with the model's real
outputs (then ``gc.freeze()``, as the pipeline does after start-up), then hands them, one batch
after the other, to a :class:`ResultHandler` over a real :class:`Sink` (idempotent ``acks=all``
producer; the sink thread polls delivery reports). Prints one JSON line: CPU-µs per result of
the calling thread (the lane's ``results`` thread in the pipeline), of the whole process (the
sink thread's delivery reports and librdkafka's threads included), over ``--repetitions``
passes (median and range). Run two checkouts alternately to compare them.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from confluent_kafka.admin import AdminClient, NewTopic

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import AtLeastOnce
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.producer import ResultsProducer, build_producer, producer_settings
from streamproc.output.results import ResultHandler
from streamproc.output.sink import Sink
from streamproc.records import Batch, Headers, Record, TopicPartition
from streamproc.workloads import ModelFn, Workload, load_workload
from streamproc.workloads.trades import replay_messages

BATCH = 256


def batch_results(
    workload: Workload,
    model: ModelFn,
    messages: Sequence[tuple[bytes | None, bytes | None, Headers]],
    tp: TopicPartition,
    generation: int,
    tracker: OffsetTracker,
    offsets: Iterator[int],
) -> list[DeviceResult]:
    """``messages`` in batches of :data:`BATCH` as the device worker hands them over: records
    of ``tp`` at assignment ``generation`` (tracked as consumed in ``tracker``, offsets from
    ``offsets``), decoded, and the model's outputs on the host."""
    results = []
    for start in range(0, len(messages), BATCH):
        chunk = messages[start : start + BATCH]
        records = tuple(
            Record(tp, next(offsets), key, value, headers, 0, time.monotonic(), generation)
            for key, value, headers in chunk
        )
        tracker.consumed_many(records)
        rows = np.zeros((len(records), *workload.item_shape), dtype=workload.item_dtype)
        failed = workload.decode_many(records, rows)
        outputs = tuple(o.numpy() for o in model(torch.from_numpy(rows)))
        results.append(
            DeviceResult(Batch(start, records, time.monotonic()), outputs, failed, None, 1e-3)
        )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = load_workload("trades")
    model = workload.bind_model(workload.load_module(torch.device("cpu")), torch.device("cpu"))
    tp = TopicPartition("results-path-in", 0)
    tracker = OffsetTracker()
    generation = tracker.assign([tp])[tp]
    messages = list(itertools.islice(replay_messages(), BATCH * args.batches))
    metrics = Metrics()
    settings = producer_settings({"bootstrap.servers": args.bootstrap})
    producer = ResultsProducer(build_producer(settings), settings, metrics, print)
    sink = Sink(producer, AtLeastOnce(tracker, metrics), metrics, print)
    sink.start()
    run = uuid.uuid4().hex[:8]
    pipeline = PipelineConfig(
        name="trades", input_topic=tp.topic, output_topic=f"results-path-{run}", workload="trades"
    )
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    for future in admin.create_topics([NewTopic(pipeline.output_topic, 4, 1)]).values():
        future.result()
    handler = ResultHandler(pipeline, workload, sink, metrics)
    offsets = itertools.count()
    thread_us: list[float] = []
    process_us: list[float] = []
    for _ in range(args.repetitions):
        results = batch_results(workload, model, messages, tp, generation, tracker, offsets)
        count = sum(len(r.batch) for r in results)
        gc.collect()
        gc.freeze()  # as the pipeline does after start-up: collections never walk the inputs
        thread_s, process_s = time.thread_time(), time.process_time()
        for result in results:
            handler(result)
        left = sink.flush(30.0)
        thread_us.append(1e6 * (time.thread_time() - thread_s) / count)
        process_us.append(1e6 * (time.process_time() - process_s) / count)
        assert left == 0, f"{left} results not delivered"
    sink.close()

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    print(
        json.dumps(
            {
                "label": args.label,
                "results_thread_us_per_msg": spread(thread_us),
                "process_us_per_msg": spread(process_us),
            }
        )
    )


if __name__ == "__main__":
    main()
