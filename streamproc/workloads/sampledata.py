"""Real recordings shipped in the ``bokeh-sampledata`` package, read offline without pandas.

* ``cycling.csv.gz`` (CC0): a 1 Hz bike-computer recording of one workout, 4,391 samples with
  altitude (m), power (W), cadence (rpm) and speed (m/s) among other channels.
* ``stocks.csv.gz`` (public domain, Quandl WIKI prices): daily unadjusted OHLCV bars of AAPL,
  GOOG, IBM and MSFT (2000-03-01 to 2013-03-01; GOOG from 2004-08-19).
"""

from __future__ import annotations

import csv
import functools
import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CYCLING_CHANNELS = ("altitude", "power", "cadence", "speed")
STOCK_SYMBOLS = ("AAPL", "GOOG", "IBM", "MSFT")


def data_dir() -> Path:
    """The ``_data`` folder of bokeh-sampledata (located without importing the package)."""
    spec = importlib.util.find_spec("bokeh_sampledata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bokeh-sampledata is not installed: it ships the recordings")
    return Path(next(iter(spec.submodule_search_locations))) / "_data"


@functools.cache
def cycling() -> np.ndarray:
    """The cycling recording: (4391, 4) float32, columns :data:`CYCLING_CHANNELS`, 1 Hz."""
    with gzip.open(data_dir() / "cycling.csv.gz", "rt", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return np.array([[float(row[c]) for c in CYCLING_CHANNELS] for row in rows], dtype=np.float32)


@dataclass(frozen=True)
class Bar:
    """One daily OHLCV bar (prices in USD, volume in shares)."""

    symbol: str
    date: str
    open: float
    high: float
    low: float
    close: float
    volume: int


@functools.cache
def stock_bars() -> dict[str, tuple[Bar, ...]]:
    """Daily bars per symbol in date order, for :data:`STOCK_SYMBOLS`."""
    out: dict[str, list[Bar]] = {s: [] for s in STOCK_SYMBOLS}
    with gzip.open(data_dir() / "stocks.csv.gz", "rt", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Ticker"] in out:
                out[row["Ticker"]].append(
                    Bar(
                        row["Ticker"],
                        row["Date"],
                        float(row["Open"]),
                        float(row["High"]),
                        float(row["Low"]),
                        float(row["Close"]),
                        int(float(row["Volume"])),
                    )
                )
    return {s: tuple(sorted(bars, key=lambda b: b.date)) for s, bars in out.items()}
