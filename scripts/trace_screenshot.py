"""Regenerate docs/images/trace.png (``make trace-screenshot``): one traced round trip (the
records of ``tests/support/traced.py``: produced under a producer span, run through a pipeline
exporting to the local trace backend, continued by a downstream consumer), its trace opened in
Zipkin's UI by headless Chromium (Debian's ``chromium`` package) and saved as a screenshot.

The broker is ``$KAFKA_BOOTSTRAP_SERVERS``, else a local one for the run; the backend is started
for the run and stopped after it. Network: loopback only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from streamproc.kafka.admin import ensure_topics
from streamproc.tools.kafka_local import broker_unless_given
from streamproc.tools.tracing_local import LocalTracing
from tests.support.traced import GOOD, round_trip, zipkin_trace
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "trace.png")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is missing: apt-get install chromium (Debian's package)")
    with tempfile.TemporaryDirectory(prefix="trace-shot-") as tmp:
        work = Path(tmp)
        backend = LocalTracing(work / "tracing")
        backend.start()
        try:
            with broker_unless_given(
                os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), work / "kafka"
            ) as bootstrap:
                suffix = uuid.uuid4().hex[:6]
                topics = (
                    f"frames.{suffix}",
                    f"labels.{suffix}",
                    f"frames.{suffix}.dlq",
                    f"g-{suffix}",
                )
                ensure_topics(bootstrap, {topics[0]: 1, topics[1]: 1, topics[2]: 1})
                trip = round_trip(backend.otlp_endpoint, bootstrap, topics)
            # producer, batches with 5 stage spans each, create spans, downstream consumers
            wait_until(
                lambda: (
                    len(zipkin_trace(backend.api_url, trip.trace_id))
                    >= 1 + 6 + GOOD + 1 + trip.continued
                ),
                "the whole trace in Zipkin",
                60,
            )
            url = f"{backend.ui_url}traces/{trip.trace_id}"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [
                    chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1500,1100", "--virtual-time-budget=20000",
                    f"--screenshot={args.out}", url,
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )  # fmt: skip
        finally:
            backend.stop()
    print(f"{args.out}: trace {trip.trace_id} ({url} while the backend ran)")


if __name__ == "__main__":
    main()
