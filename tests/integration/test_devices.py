"""Several devices against a real broker: two logical CPU devices share one lane."""

from __future__ import annotations

from collections import defaultdict

import pytest

from streamproc.output.headers import H_OFFSET, H_PARTITION
from streamproc.pipeline import Pipeline
from streamproc.tools.replay import produce
from streamproc.tools.verify import read_topic, verify
from tests.integration.conftest import Topics, make_config

pytestmark = pytest.mark.core


def test_two_cpu_devices_one_result_per_input_in_offset_order(
    bootstrap_servers: str, topics: Topics
) -> None:
    total = 3000
    assert produce("trades", topics.input, bootstrap_servers, 3, limit=total, progress=False)
    config = make_config(
        bootstrap_servers,
        topics,
        pipelines=[
            {
                "name": "trades",
                "input_topic": topics.input,
                "output_topic": topics.output,
                "workload": "trades",
            }
        ],
        batching={"max_batch_size": 16, "max_wait_ms": 10},
        worker={"devices": ["cpu", "cpu"], "torch_threads": 1},
    )
    summary = Pipeline(config).run(exit_when_idle_s=2)
    assert summary.exit_code == 0, summary.error

    per_device = summary.device_batches[topics.input]
    print(f"\nbatches per device: {per_device}")
    assert set(per_device) == {"cpu:0", "cpu:1"}
    assert all(count > 0 for count in per_device.values()), per_device
    assert sum(per_device.values()) == sum(summary.batch_sizes[topics.input].values())

    verdict = verify(bootstrap_servers, topics.input, topics.output, topics.dlq, topics.group)
    assert verdict.inputs == total
    assert verdict.results == total and verdict.dead_lettered == 0
    assert verdict.missing == [] and verdict.duplicates == 0
    assert verdict.committed_equals_end

    # Per input partition, results were produced in input-offset order: within every output
    # partition (the producer keeps each partition's order), the source offsets of one input
    # partition only go up.
    output = read_topic(bootstrap_servers, topics.output).records
    seen: dict[tuple[int, int], list[int]] = defaultdict(list)
    for out_partition, out_offset in sorted(output):
        headers = output[(out_partition, out_offset)][2]
        seen[(out_partition, int(headers[H_PARTITION]))].append(int(headers[H_OFFSET]))
    assert sum(len(offsets) for offsets in seen.values()) == total
    for key, offsets in seen.items():
        assert offsets == sorted(offsets), f"output partition / input partition {key} reordered"
