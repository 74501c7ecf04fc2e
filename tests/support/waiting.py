"""Waiting on a condition with a deadline (never a bare sleep standing in for synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` every 5 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.005)
