"""The batch-observed histogram exposes what prometheus_client's own Histogram would."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from streamproc.histograms import BatchHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith("lat_seconds") and "_created" not in line
    )


def test_batch_observations_match_the_library_histogram_sample_for_sample() -> None:
    rng = np.random.default_rng(7)
    # bucket bounds themselves included: "le" is inclusive
    values = np.concatenate([rng.exponential(0.05, 500), np.array(BUCKETS), [0.0, 99.0]])
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("lat_seconds", "latency", ["topic"], BUCKETS, ours_registry)
    theirs = Histogram(
        "lat_seconds", "latency", ["topic"], buckets=BUCKETS, registry=theirs_registry
    )
    for chunk in np.array_split(values, 7):
        ours.labels("a").observe_many(chunk)
        for value in chunk:
            theirs.labels("a").observe(float(value))
    ours.labels("b").observe_many(np.array([0.5]))
    theirs.labels("b").observe(0.5)
    ours_lines, theirs_lines = _samples(ours_registry), _samples(theirs_registry)
    assert len(ours_lines) == 2 * (len(BUCKETS) + 3)  # buckets, +Inf, _count, _sum per series
    names = [line.rsplit(" ", 1)[0] for line in ours_lines]
    assert names == [line.rsplit(" ", 1)[0] for line in theirs_lines]
    for mine, library in zip(ours_lines, theirs_lines, strict=True):
        assert float(mine.rsplit(" ", 1)[1]) == pytest.approx(float(library.rsplit(" ", 1)[1]))


def test_nan_integer_arrays_and_non_string_labels_match_the_library() -> None:
    # int64 values once wrapped their sum, NaN landed in +Inf and _count, and an int label
    # value failed the whole /metrics scrape
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("lat_seconds", "latency", ["partition"], BUCKETS, ours_registry)
    theirs = Histogram(
        "lat_seconds", "latency", ["partition"], buckets=BUCKETS, registry=theirs_registry
    )
    huge = np.array([2**62] * 3, dtype=np.int64)
    ours.labels(0).observe_many(huge)
    ours.labels(0).observe_many(np.array([[0.5, np.nan]]))  # any shape
    for value in [*huge.tolist(), 0.5, float("nan")]:
        theirs.labels(0).observe(float(value))
    ours_lines, theirs_lines = _samples(ours_registry), _samples(theirs_registry)
    assert [line.rsplit(" ", 1)[0] for line in ours_lines] == [
        line.rsplit(" ", 1)[0] for line in theirs_lines
    ]
    for mine, library in zip(ours_lines, theirs_lines, strict=True):
        assert float(mine.rsplit(" ", 1)[1]) == pytest.approx(
            float(library.rsplit(" ", 1)[1]), nan_ok=True
        )
    assert 'lat_seconds_count{partition="0"} 4.0' in ours_lines


def test_bad_buckets_and_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        BatchHistogram("x_seconds", "x", ["topic"], (1.0, 0.5), CollectorRegistry())
    with pytest.raises(ValueError, match="finite"):
        BatchHistogram("z_seconds", "z", ["topic"], (1.0, float("inf")), CollectorRegistry())
    histogram = BatchHistogram("y_seconds", "y", ["topic"], BUCKETS, CollectorRegistry())
    with pytest.raises(ValueError, match="expected labels"):
        histogram.labels("a", "b")


@pytest.mark.parametrize("seed", range(40))
def test_a_few_values_are_counted_as_the_numpy_pass_counts_them(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # up to SMALL_BATCH values are counted in Python, one bucket search each: the same buckets,
    # count, sum and exemplar as the numpy pass that counts larger arrays
    import streamproc.histograms as histograms

    small = histograms.SMALL_BATCH
    rng = np.random.default_rng(seed)
    specials = [*BUCKETS, 0.0, -1.0, np.nan, np.inf, -np.inf, 1e-12]
    for index in range(30):
        size = int(rng.integers(0, small + 1))
        values = rng.exponential(0.05, size)
        mixed = rng.random(size) < 0.3
        values[mixed] = rng.choice(specials, int(mixed.sum()))
        shaped = values.reshape(1, -1) if size % 2 else values  # any shape
        registry = CollectorRegistry()
        few = BatchHistogram("few_seconds", "x", ["t"], BUCKETS, registry).labels("a")
        whole = BatchHistogram("whole_seconds", "x", ["t"], BUCKETS, registry).labels("a")
        few.observe_many(shaped, {"trace_id": str(index)})
        monkeypatch.setattr(histograms, "SMALL_BATCH", 0)  # the numpy pass
        with np.errstate(invalid="ignore"):  # inf + -inf: numpy warns, then sums to NaN too
            whole.observe_many(shaped, {"trace_id": str(index)})
        monkeypatch.setattr(histograms, "SMALL_BATCH", small)
        (few_counts, few_sum), (whole_counts, whole_sum) = few.snapshot(), whole.snapshot()
        assert few_counts == whole_counts, values
        assert few_sum == pytest.approx(whole_sum, nan_ok=True), values
        assert {i: (e.labels, e.value) for i, e in few.exemplars().items()} == {
            i: (e.labels, e.value) for i, e in whole.exemplars().items()
        }, values
