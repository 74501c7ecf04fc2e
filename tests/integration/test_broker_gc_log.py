"""The local broker's GC log: written where :attr:`LocalKafka.gc_log_path` says, in the form
:func:`streamproc.tools.broker_gc.pauses` reads (the overload bench prints the broker's pauses
from it)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.broker_gc import pauses
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

pytestmark = [pytest.mark.core, pytest.mark.timeout(180)]

HEAP_MB = 256  # the log cleaner alone takes 128 MiB
PRODUCED_MB = HEAP_MB  # the whole heap passes through it: young collections, however sized


def test_the_local_brokers_young_collections_are_read_back_as_pauses() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-broker-gc-"))
    broker = LocalKafka(run_dir, ensure_kafka_jars(), heap_mb=HEAP_MB)
    try:
        bootstrap = broker.start()
        started_s = time.time()
        ensure_topics(bootstrap, {"gc-log": 1})
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        value = os.urandom(512 * 1024)  # under the producer's message.max.bytes (1,000,000)
        for _ in range(2 * PRODUCED_MB):
            while True:
                try:
                    producer.produce("gc-log", value)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.1)
        assert producer.flush(60) == 0
        young = [p for p in pauses(broker.gc_log_path) if p.kind == "Young"]
        assert young, broker.gc_log_path.read_text()[-2000:]
        assert all(0.0 < p.ms < 60_000.0 for p in young)
        assert young[-1].end_s >= started_s - 60.0  # this run's clock, not a stale log
    finally:
        broker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
