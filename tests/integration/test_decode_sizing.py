"""Self-sizing decode workers in a real pipeline against the broker: decode processes shrink
when idle, the count is exported, and a stream decoded across the resize loses nothing."""

from __future__ import annotations

import threading

import pytest

from streamproc.pipeline import Pipeline, RunSummary
from streamproc.tools.replay import produce
from streamproc.tools.verify import verify
from tests.integration.conftest import Topics, make_config, report, wait_for

pytestmark = pytest.mark.core


def test_decode_processes_shrink_when_idle_and_the_stream_loses_nothing(
    bootstrap_servers: str, topics: Topics
) -> None:
    config = make_config(
        bootstrap_servers,
        topics,
        pipelines=[
            {
                "name": "trades",
                "input_topic": topics.input,
                "output_topic": topics.output,
                "dlq_topic": topics.dlq,
                "workload": "trades",
            }
        ],
        worker={
            "decode_mode": "process",
            "decode_workers": 2,
            "decode_workers_min": 1,
            "decode_workers_max": 2,
        },
    )
    pipeline = Pipeline(config)
    gauge = pipeline.metrics.decode_workers
    produced = pipeline.metrics.produced
    summary: list[RunSummary] = []
    runner = threading.Thread(target=lambda: summary.append(pipeline.run()))
    runner.start()
    try:
        first = produce("trades", topics.input, bootstrap_servers, 3, limit=600, progress=False)

        def results() -> float:
            return sum(s.value for m in produced.collect() for s in m.samples if "_total" in s.name)

        wait_for(lambda: results() >= first, 120, "the first results")
        assert gauge._value.get() == 2
        # Trades decode in microseconds: the dispatcher waits for decode far below a quarter
        # of the time, so after three quiet 2-s windows one process is retired.
        # the sizer records a resize after it stopped the process and set the gauge: waiting
        # on the stopped process alone raced the gauge (it read 2 on a loaded machine)
        sizer = pipeline.decode_sizer
        wait_for(lambda: any(r.workers == 1 for r in sizer.resizes), 60, "the shrink to one")
        assert sizer.workers == 1 and gauge._value.get() == 1
        assert sizer.resizes[-1].reason.startswith("idle")
        second = produce("trades", topics.input, bootstrap_servers, 3, limit=400, progress=False)
        wait_for(lambda: results() >= first + second, 120, "the results after the shrink")
    finally:
        pipeline.request_stop()
        runner.join(120)
    assert summary and summary[0].exit_code == 0, summary
    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    report("decode shrink", verdict)
    assert verdict.inputs == first + second == verdict.results
    assert verdict.missing == [] and verdict.duplicates == 0 and verdict.dead_lettered == 0
    assert verdict.committed_equals_end
