"""kill -9 of a real consumer process mid-stream, then restart: nothing is lost."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, end_offset_total, start_consumer, wait_for

pytestmark = pytest.mark.core


@pytest.mark.timeout(600)  # two processes that each load a video model, on a loaded machine
def test_kill_9_mid_stream_then_restart_loses_nothing(
    bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    total = 200
    produce("video", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kafka": {
                    "bootstrap_servers": bootstrap_servers,
                    "group_id": topics.group,
                    "commit_interval_ms": 200,
                },
                "pipelines": [
                    {
                        "name": "frames",
                        "input_topic": topics.input,
                        "output_topic": topics.output,
                        "workload": "video",
                    }
                ],
                "metrics": {"port": 0},
                "batching": {"max_batch_size": 4, "max_wait_ms": 10},
            }
        )
    )
    log = tmp_path / "consumer.log"
    first = start_consumer(config, log)
    try:
        # a video model starting in a fresh process takes minutes with both cores busy
        wait_for(
            lambda: (
                end_offset_total(bootstrap_servers, topics.output) >= 40 or first.poll() is not None
            ),
            240,
            "40 results before the crash",
        )
        assert first.poll() is None, "consumer exited before the crash:\n" + log.read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    written_at_crash = end_offset_total(bootstrap_servers, topics.output)
    assert written_at_crash < total, "crash came too late to test anything"

    second = start_consumer(config, log)
    assert second.wait(180) == 0, log.read_text()[-3000:]

    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    print(
        f"\nafter kill -9 at {written_at_crash} results: inputs={verdict.inputs} "
        f"missing={len(verdict.missing)} duplicates={verdict.duplicates}"
    )
    assert verdict.inputs == total
    assert verdict.missing == []  # every input has >= 1 result
    assert verdict.committed_equals_end
