"""The local broker's GC log: written where :attr:`LocalKafka.gc_log_path` says, in the form
:func:`streamproc.tools.broker_gc.pauses` reads (the overload bench prints the broker's pauses
from it)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from streamproc.tools.broker_gc import pauses
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars

pytestmark = [pytest.mark.core, pytest.mark.timeout(180)]


def test_a_collection_of_the_local_broker_is_read_back_as_a_pause() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-broker-gc-"))
    broker = LocalKafka(run_dir, ensure_kafka_jars())
    try:
        broker.start()
        before = len(pauses(broker.gc_log_path))
        asked_s = time.time()
        # jcmd comes with the JDK the broker runs on; System.gc(): with
        # -XX:+ExplicitGCInvokesConcurrent, a young pause that starts a
        # concurrent cycle (then its remark and cleanup pauses)
        subprocess.run(["jcmd", str(broker.pid), "GC.run"], check=True, capture_output=True)
        found = pauses(broker.gc_log_path)
        assert len(found) > before
        assert any(p.kind == "Young" and p.end_s >= asked_s - 1.0 for p in found[before:])
    finally:
        broker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
