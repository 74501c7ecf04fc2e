"""A labelled Prometheus histogram observed a batch of values per call (:class:`BatchHistogram`),
exposed exactly like ``prometheus_client.Histogram``."""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

SMALL_BATCH = 16
"""Up to this many values :meth:`BatchHistogramSeries.observe_many` counts in Python, one
bucket search each: numpy's fixed cost per call (about 4.5 µs on these cores) is more than a
bucket search per value (about 0.2 µs) up to about 16 values (docs/benchmarks.md, "Small
batches' histograms")."""

_go_float: Callable[[float], str] = floatToGoString
"""prometheus_client's ``le`` label format (``0.25``, ``1.0``, ``+Inf``), typed here: the library
leaves the function unannotated."""


class BatchHistogramSeries:
    """One labelled series of a :class:`BatchHistogram` (thread-safe). Each bucket keeps the
    latest exemplar given with a value it counted (OpenMetrics exposition shows it)."""

    def __init__(self, bounds: np.ndarray) -> None:
        self._bounds = bounds
        self._bounds_list: list[float] = bounds.tolist()
        self._counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # last: above every bound
        self._sum = 0.0
        self._exemplars: dict[int, Exemplar] = {}
        self._lock = threading.Lock()

    def observe_many(self, values: np.ndarray, exemplar: dict[str, str] | None = None) -> None:
        """Count every value of ``values`` (any shape, converted to float64; e.g. seconds) at
        once. Like ``Histogram.observe``, a NaN is added to the sum and counted in no bucket.
        ``exemplar`` (labels, e.g. ``{"trace_id": ...}``) goes with the largest value."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if values.size == 0:
            return
        if values.size <= SMALL_BATCH:
            self._observe_few(values.tolist(), exemplar)
            return
        # bucket i counts value <= bounds[i] (Prometheus "le"): the first bound >= value
        counted = values[~np.isnan(values)]
        counts = np.bincount(np.searchsorted(self._bounds, counted), minlength=len(self._counts))
        total = float(values.sum())
        with self._lock:
            self._counts += counts
            self._sum += total
        if exemplar is not None and counted.size:
            self._keep(float(counted.max()), exemplar)

    def _observe_few(self, values: list[float], exemplar: dict[str, str] | None) -> None:
        """:meth:`observe_many` of a few values, one bucket search each (the same counts and
        sum: ``bisect_left`` is ``searchsorted``'s left side, a NaN fails ``v == v``)."""
        bounds = self._bounds_list
        found = [bisect.bisect_left(bounds, value) for value in values if value == value]
        total = sum(values)
        with self._lock:
            counts = self._counts
            for index in found:
                counts[index] += 1
            self._sum += total
        if exemplar is not None and found:
            self._keep(max(value for value in values if value == value), exemplar)

    def observe_repeated(
        self, value: float, count: int, exemplar: dict[str, str] | None = None
    ) -> None:
        """Count ``value`` (e.g. seconds) ``count`` times at once: what ``observe_many`` of
        ``count`` copies of it would count, in one bucket search (a batch's duration, counted
        once per record of the batch). ``count`` <= 0 counts nothing. ``exemplar``: labels
        kept with ``value`` as its bucket's exemplar."""
        if count <= 0:
            return
        if math.isnan(value):
            with self._lock:
                self._sum += value
            return
        index = bisect.bisect_left(self._bounds_list, value)
        with self._lock:
            self._counts[index] += count
            self._sum += value * count
        if exemplar is not None:
            self._keep(value, exemplar)

    def _keep(self, value: float, exemplar: dict[str, str]) -> None:
        index = bisect.bisect_left(self._bounds_list, value)
        found = Exemplar(exemplar, value, time.time())
        with self._lock:
            self._exemplars[index] = found

    def exemplars(self) -> dict[int, Exemplar]:
        """The latest exemplar of each bucket that has one, by bucket index (the last: +Inf)."""
        with self._lock:
            return dict(self._exemplars)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) estimated from the buckets as PromQL's
        ``histogram_quantile`` does: linear within the bucket holding it (from 0 in the first
        one); the largest finite bound where it falls above every bound; None when nothing was
        observed.

        Raises:
            ValueError: ``q`` outside 0..1.
        """
        cumulative, _ = self.snapshot()
        return bucket_quantile(self._bounds_list, cumulative, q)

    def snapshot(self) -> tuple[list[int], float]:
        """Cumulative bucket counts (one per bound, then +Inf) and the sum."""
        with self._lock:
            return np.cumsum(self._counts).tolist(), self._sum


def bucket_quantile(bounds: Sequence[float], cumulative: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram given as finite upper ``bounds`` and the
    ``cumulative`` counts per bound plus a last one for ``+Inf``, estimated as PromQL's
    ``histogram_quantile`` does (linear within the bucket, the first from 0; the largest finite
    bound for the ``+Inf`` bucket); None when the histogram is empty.

    Raises:
        ValueError: ``q`` outside 0..1, or ``cumulative`` not one longer than ``bounds``.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside 0..1")
    if len(cumulative) != len(bounds) + 1:
        raise ValueError(f"{len(cumulative)} cumulative counts for {len(bounds)} bounds")
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    index = bisect.bisect_left(cumulative, rank)
    if index >= len(bounds):
        return float(bounds[-1])
    lower = 0.0 if index == 0 else float(bounds[index - 1])
    below = 0 if index == 0 else cumulative[index - 1]
    inside = cumulative[index] - below
    if inside <= 0:
        return float(bounds[index])
    return lower + (float(bounds[index]) - lower) * (rank - below) / inside


class BatchHistogram(Collector):
    """A labelled Prometheus histogram observed a batch of values per call.

    Exposed like a ``prometheus_client.Histogram`` (the same ``_bucket``/``_count``/``_sum``
    samples and ``le`` labels; no ``_created`` sample), but
    :meth:`BatchHistogramSeries.observe_many` counts a whole batch in one numpy pass and one
    lock, where ``Histogram.observe`` takes the lock once per value.

    Args:
        name: metric name without suffix (units in the name).
        documentation: help text.
        labelnames: label names.
        buckets: finite upper bounds, increasing (``+Inf`` is implied).

        registry: where to register.

    Raises:
        ValueError: empty, unordered or non-finite buckets.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = np.asarray(buckets, dtype=np.float64)
        if (
            self._bounds.size == 0
            or (np.diff(self._bounds) <= 0).any()
            or not np.isfinite(self._bounds).all()
        ):
            raise ValueError(
                f"{name}: buckets must be finite, non-empty and increasing, got {buckets}"
            )
        self._series: dict[tuple[str, ...], BatchHistogramSeries] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, *values: object) -> BatchHistogramSeries:
        """The series for these label values (created on first use; values become ``str`` as
        in ``prometheus_client``)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
        key = tuple(str(value) for value in values)
        series = self._series.get(key)
        if series is None:
            with self._lock:
                series = self._series.setdefault(key, BatchHistogramSeries(self._bounds))
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        les = [*(_go_float(b) for b in self._bounds.tolist()), "+Inf"]
        for values, series in list(self._series.items()):
            cumulative, total = series.snapshot()
            exemplars = series.exemplars()
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = [
                (le, count) if index not in exemplars else (le, count, exemplars[index])
                for index, (le, count) in enumerate(zip(les, cumulative, strict=True))
            ]
            family.add_metric(list(values), buckets, total)
        yield family
