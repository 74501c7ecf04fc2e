"""``streamproc model demo``: a model swap live, on the real IoT recording.

1. A model repository in a temporary folder: ``iot/1`` the packaged autoencoder
   (``scripts/train_iot.py``, seed 0) and ``iot/2`` that model fine-tuned for a few epochs on
   the whole recording (the "next week's" retrain), both as ``torch.export`` programs.
2. A local broker (unless ``--bootstrap`` or ``$KAFKA_BOOTSTRAP_SERVERS``), the iot pipeline
   serving version 1 with the admin endpoint on a free loopback port, and a replay of the
   recording at a steady rate.
3. Once version 1 made some batches, the same call as ``streamproc model use iot 2``; the replay
   goes on; then the report: results per version and per partition (the version changes once
   per partition), missing, duplicates, dead-lettered, committed offsets, the swap's pause
   against the usual gap between batches, and the process's resident memory before the load,
   with both versions resident, and after the old one was let go.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # no stubs in the lock
import torch

from streamproc.config import load_config
from streamproc.kafka.admin import ensure_topics
from streamproc.output.headers import H_MODEL_VERSION, H_OFFSET, H_PARTITION
from streamproc.pipeline import Pipeline
from streamproc.tools.kafka_local import LocalKafka, ensure_kafka_jars
from streamproc.tools.model_admin import models_state, use_version
from streamproc.tools.replay import produce, recording_size
from streamproc.tools.verify import Verdict, read_topic, verify
from streamproc.workloads.iot import WINDOW, IotWorkload, reconstruction_error, windows
from streamproc.workloads.sampledata import cycling

FINE_TUNE_EPOCHS = 3
COUNT, RATE = 4000, 500.0
IDLE_S = 3.0
PROBATION_BATCHES = 60


def export(module: torch.nn.Module, path: Path) -> None:
    """``module`` (the iot autoencoder) as a ``torch.export`` program with a dynamic batch."""
    features = WINDOW * 4
    program = torch.export.export(
        module.eval(),
        (torch.zeros(2, features),),
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))


def build_repository(root: Path) -> None:
    """``root/iot/1`` (the packaged model) and ``root/iot/2`` (fine-tuned on the whole
    recording, seed 1, :data:`FINE_TUNE_EPOCHS` epochs; CPU, a few seconds)."""
    workload = IotWorkload()
    packaged = workload.load_module(torch.device("cpu"))
    export(packaged, root / "iot" / "1" / "model.pt2")
    torch.manual_seed(1)
    mean, std = workload.checkpoint["mean"], workload.checkpoint["std"]
    data = torch.from_numpy(windows(cycling(), 4))
    tuned = IotWorkload().load_module(torch.device("cpu")).train()
    optimiser = torch.optim.Adam(tuned.parameters(), lr=1e-4)
    for _ in range(FINE_TUNE_EPOCHS):
        for start in range(0, len(data), 256):
            loss = reconstruction_error(tuned, data[start : start + 256], mean, std).mean()
            optimiser.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimiser.step()
    export(tuned, root / "iot" / "2" / "model.pt2")


@dataclass
class ModelDemoReport:
    """What the demo measured."""

    verdict: Verdict
    by_version: dict[str, int]
    changes_per_partition: dict[int, int]
    pause_ms: float | None
    median_gap_ms: float | None
    load_s: float
    rss_mib: dict[str, float]

    @property
    def ok(self) -> bool:
        v = self.verdict
        return (
            v.missing == []
            and v.dead_lettered == 0
            and v.committed_equals_end
            and set(self.by_version) == {"1", "2"}
            and all(n == 1 for n in self.changes_per_partition.values())
        )

    def render(self) -> str:
        v = self.verdict
        lines = [
            f"inputs {v.inputs}, results {v.results}, missing {len(v.missing)}, "
            f"duplicates {v.duplicates}, dead-lettered {v.dead_lettered}, "
            f"committed == end: {v.committed_equals_end}",
            "results by model version: "
            + ", ".join(f"{k}: {n}" for k, n in sorted(self.by_version.items())),
            "version changes per input partition (1 = one batch boundary): "
            + ", ".join(f"p{p}: {n}" for p, n in sorted(self.changes_per_partition.items())),
            f"version 2 loaded and warmed up beside version 1 in {self.load_s:.2f} s (the HTTP "
            "call's time; version 1 served meanwhile)",
            f"swap pause: {self.pause_ms} ms between the last batch of 1 and the first of 2 "
            f"(median gap between batches: {self.median_gap_ms} ms)",
            "resident memory (MiB): " + ", ".join(f"{k} {n:.0f}" for k, n in self.rss_mib.items()),
            "PASS" if self.ok else "FAIL",
        ]
        return "\n".join(lines)


def version_changes(results: list[tuple[int, str]]) -> int:
    """How often the version changes along (input offset, version) pairs in offset order."""
    names = [version for _, version in sorted(results)]
    return sum(a != b for a, b in itertools.pairwise(names))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_mib() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def run_model_demo(bootstrap_servers: str | None = None, partitions: int = 3) -> ModelDemoReport:
    """Run the demo (see the module docstring); stops the broker it started."""
    run_dir = Path(tempfile.mkdtemp(prefix="streamproc-model-demo-"))
    broker: LocalKafka | None = None
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    try:
        print("model repository: version 1 (packaged), version 2 (fine-tuned) ...", flush=True)
        build_repository(run_dir / "models")
        if not bootstrap:
            print("starting a local Apache Kafka broker ...", flush=True)
            broker = LocalKafka(run_dir / "kafka", ensure_kafka_jars())
            bootstrap = broker.start()
        suffix = uuid.uuid4().hex[:6]
        inp, out, dlq = f"demo.iot.{suffix}", f"demo.iot.results.{suffix}", f"demo.iot.{suffix}.dlq"
        ensure_topics(bootstrap, {inp: partitions, out: partitions, dlq: 1})
        port, token = _free_port(), secrets.token_urlsafe(16)
        group = f"streamproc-model-demo-{suffix}"
        config = load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": group},
                "pipelines": [
                    {
                        "name": "iot",
                        "input_topic": inp,
                        "output_topic": out,
                        "dlq_topic": dlq,
                        "workload": "iot",
                        "model": {
                            "source": "folder",
                            "repository": str(run_dir / "models"),
                            "name": "iot",
                            "version": "1",
                            "poll_interval_s": 0,
                            "rollback": {"window_batches": PROBATION_BATCHES},
                        },
                    }
                ],
                "metrics": {"port": port, "host": "127.0.0.1"},
                "admin": {"token": token},
            }
        )
        recording_size("iot")
        pipeline = Pipeline(config)
        pipeline.start()
        url = f"http://127.0.0.1:{port}"
        registry = pipeline.metrics.registry
        rss: dict[str, float] = {"serving 1": _rss_mib()}
        print(f"replaying {COUNT} real iot messages at {RATE:g} msg/s ...", flush=True)
        replay = threading.Thread(
            target=produce,
            args=("iot", inp, bootstrap, partitions, COUNT, RATE),
            kwargs={"progress": False},
        )
        replay.start()
        deadline_s = time.monotonic() + 120
        while (
            registry.get_sample_value(
                "streamproc_model_batches_total", {"topic": inp, "version": "1"}
            )
            or 0
        ) < 30 and time.monotonic() < deadline_s:
            time.sleep(0.1)
        print(f'POST {url}/models/iot {{"version": "2"}}  (streamproc model use iot 2)', flush=True)
        asked_s = time.monotonic()
        answer = use_version(url, token, "iot", "2")
        load_s = time.monotonic() - asked_s
        rss["1 and 2 resident"] = _rss_mib()
        print(f"answer: {answer} (loaded and warmed up; it serves from the next batch)", flush=True)
        replay.join()
        state: dict[str, Any] = models_state(url)["iot"]
        summary = pipeline.run(exit_when_idle_s=IDLE_S)
        rss["after 1 was let go"] = _rss_mib()
        if summary.exit_code != 0:
            raise RuntimeError(f"the pipeline failed: {summary.error}")
        outputs = read_topic(bootstrap, out)
        verdict = verify(bootstrap, inp, out, dlq, group, outputs=outputs)
        by_version: Counter[str] = Counter()
        sequences: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for _, _, headers, _ in outputs.records.values():
            made_by = headers[H_MODEL_VERSION].decode()
            by_version[made_by] += 1
            sequences[int(headers[H_PARTITION])].append((int(headers[H_OFFSET]), made_by))
        changes = {p: version_changes(seq) for p, seq in sequences.items()}
        return ModelDemoReport(
            verdict,
            dict(by_version),
            changes,
            state.get("last_switch_pause_ms"),
            state.get("median_batch_gap_ms"),
            load_s,
            rss,
        )
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
