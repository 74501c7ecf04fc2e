"""Acknowledgements that lag, on a real broker: the inputs awaiting them stay bounded in bytes.

A producer quota (``producer_byte_rate`` on the pipeline producer's ``client.id``, set with
Kafka's own ``kafka-configs``) makes the broker delay the results' acknowledgements while the
consumer fetches at full speed. Each result keeps its input until it is acknowledged
(``OutputBatch.records``); before the acknowledgement window, a backlog was consumed, run and
handed to the producer as fast as the model went, so its inputs piled up behind the throttled
acknowledgements (measured here: librdkafka's count of results awaiting delivery reports grew
towards the whole backlog). With ``buffers.max_unacknowledged_bytes`` the results wait at the
bound, and once the quota is lifted every input has its result, committed == end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from streamproc.config import load_config
from streamproc.pipeline import Pipeline, RunSummary
from streamproc.records import Record
from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, report, wait_for
from tests.support.quotas import set_producer_byte_rate

pytestmark = pytest.mark.failures

BACKLOG = 2_000
LIMIT_BYTES = 8 * 1024  # about 50 trades (159 B each)
BATCH = 16


def test_throttled_acknowledgements_hold_at_most_the_window_of_inputs(
    bootstrap_servers: str, topics: Topics
) -> None:
    produce("trades", topics.input, bootstrap_servers, 3, limit=BACKLOG, progress=False)
    client_id = f"streamproc-throttled-{topics.group}"
    set_producer_byte_rate(bootstrap_servers, client_id, 4096)
    config = load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": bootstrap_servers,
                "group_id": topics.group,
                "commit_interval_ms": 200,
                "producer": {"client.id": client_id},
            },
            "pipelines": [
                {
                    "name": "trades",
                    "input_topic": topics.input,
                    "output_topic": topics.output,
                    "dlq_topic": topics.dlq,
                    "workload": "trades",
                    "max_batch_size": BATCH,
                }
            ],
            "buffers": {"max_unacknowledged_bytes": LIMIT_BYTES},
            "metrics": {"port": 0},
        }
    )
    pipeline = Pipeline(config)
    sink = pipeline.stages.shared.sink
    window = pipeline.stages.topics[0].window
    assert window is not None
    # at each hand-over, librdkafka's own count of results awaiting their delivery report
    # (queued, in flight, or reported and not yet polled): each still holds its input
    awaiting: list[int] = []
    handed = [0]
    smallest, largest = [1 << 30], [0]
    send_results = sink.send_results

    def counted(topic: str, records: Sequence[Record], *args: Any, **kwargs: Any) -> None:
        awaiting.append(len(sink._producer.client))
        handed[0] += len(records)
        sizes = [r.size_bytes for r in records]
        smallest[0], largest[0] = min(smallest[0], *sizes), max(largest[0], *sizes)
        send_results(topic, records, *args, **kwargs)

    sink.send_results = counted  # type: ignore[method-assign]
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run(exit_when_idle_s=3)))
    runner.start()
    waited = pipeline.metrics.unacknowledged_wait.labels(topics.input)
    try:
        # the window fills, the broker's acknowledgements let a batch go, it fills again
        wait_for(lambda: waited._value.get() > 0, 120, "a wait at the window that ended")
        wait_for(lambda: window.waiting == 1, 120, "the results waiting at the window again")
        during = max(awaiting)
        assert handed[0] < BACKLOG  # the rest of the backlog still waits upstream
    finally:
        set_producer_byte_rate(bootstrap_servers, client_id, None)
    runner.join(180)
    assert summary and summary[0].exit_code == 0, summary and summary[0].error
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("throttled acknowledgements", verdict)
    print(f"results awaiting acknowledgement at hand-over: max {during} while throttled")
    assert verdict.inputs == BACKLOG and not verdict.missing and verdict.committed_equals_end
    assert verdict.dead_lettered == 0
    # never more than the window's bytes of inputs awaiting acknowledgement at a hand-over, and
    # one batch: the one whose last report woke the results thread may still be counted by
    # librdkafka until the sink thread's poll has served the rest of its reports
    assert during * smallest[0] <= LIMIT_BYTES + BATCH * largest[0], (during, smallest[0])
    assert window.held_bytes == 0
