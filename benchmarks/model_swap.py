"""What a live model swap costs (issue 26): the pause around the switch and the memory of the
second resident version.

    .venv/bin/python benchmarks/model_swap.py [--repeats 5]      # make bench-models

Two parts, each repeated (median and range printed):

* **pause** (``streamproc model demo`` end to end, a local broker started once): the iot
  pipeline serving version 1 at 500 msg/s, a switch to version 2 through the admin endpoint
  mid-stream. Printed: the interval between the last batch produced by version 1 and the first
  produced by version 2 (``streamproc_model_swap_pause_seconds``), beside the median interval
  between consecutive batches of the same run: a switch that stalled nothing shows a pause of
  about one ordinary gap. Every run also checks 0 missing, 0 dead-lettered, one version change
  per partition.
* **memory** (a fresh process per repetition, no Kafka): the video workload's EfficientNet-Lite0
  (a plug-in version, the packaged weights) loaded as version 1, then a second version loaded
  beside it (:func:`~streamproc.models.loading.load_version`, warm-up included), then the first
  let go. Printed: resident memory (RSS, MiB) at each step; "second resident" minus "one" is the
  memory a swap needs; the model file is 18 MiB of float32 weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.model_demo import run_model_demo

MEMORY_CHILD = r"""
import gc, json, sys
from pathlib import Path
import psutil, torch
torch.set_num_threads(1)
from streamproc.models.loading import load_version
from streamproc.models.sources import FolderSource
from streamproc.workloads.video import VideoWorkload

root = Path(sys.argv[1])
for name in ("1", "2"):
    (root / "video" / name).mkdir(parents=True, exist_ok=True)
    (root / "video" / name / "version.json").write_text(
        json.dumps({"plugin": "streamproc.workloads.video:load_efficientnet_lite0"}))
rss = lambda: psutil.Process().memory_info().rss / 2**20
workload, cpu, source = VideoWorkload(), [torch.device("cpu")], FolderSource(root, "video")
gc.collect(); base = rss()
one = load_version(source.fetch("1"), workload, cpu, "fp32", 8)
gc.collect(); with_one = rss()
two = load_version(source.fetch("2"), workload, cpu, "fp32", 8, one)
gc.collect(); with_two = rss()
del one; gc.collect(); after = rss()
print(json.dumps({"base": base, "one": with_one, "two": with_two, "after": after,
                  "load_s": two.loaded_s}))
"""


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):7.1f} - {max(values):7.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    memory: dict[str, list[float]] = {}
    pauses: list[float] = []
    gaps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalKafka(Path(tmp) / "kafka", ensure_kafka_jars())
        bootstrap = broker.start()
        try:
            for repeat in range(args.repeats):
                report = run_model_demo(bootstrap)
                assert report.ok, report.render()
                assert report.pause_ms is not None and report.median_gap_ms is not None
                pauses.append(report.pause_ms)
                gaps.append(report.median_gap_ms)
                child = subprocess.run(
                    [sys.executable, "-c", MEMORY_CHILD, str(Path(tmp) / f"models{repeat}")],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                for key, value in json.loads(child.stdout.splitlines()[-1]).items():
                    memory.setdefault(key, []).append(value)
        finally:
            broker.stop()
    print(f"\nmodel swap, {args.repeats} repetitions: median [min - max]")
    print(f"pause at the switch (ms)              {spread(pauses)}")
    print(f"median gap between batches (ms)       {spread(gaps)}")
    ratios = [p / g for p, g in zip(pauses, gaps, strict=True)]
    print(f"pause / median gap                    {spread(ratios)}")
    print("video EfficientNet-Lite0, resident memory (MiB):")
    for key, label in (
        ("base", "before loading"),
        ("one", "version 1 serving"),
        ("two", "version 2 loaded beside it"),
        ("after", "version 1 let go"),
    ):
        print(f"  {label:<34}  {spread(memory[key])}")
    extra = [t - o for t, o in zip(memory["two"], memory["one"], strict=True)]
    print(f"  {'second version costs':<34}  {spread(extra)}")
    print(f"  {'load + warm-up of version 2 (s)':<34}  {spread(memory['load_s'])}")


if __name__ == "__main__":
    main()
