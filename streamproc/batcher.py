"""When to cut a batch: a pure policy over ring views and an injected clock.

The dispatcher asks :meth:`Batcher.decide` only when a device slot is free, so batches are cut
at dispatch time (never on a timer while the device is busy). A cut happens when

(a) ``max_batch_size`` messages are waiting (or their bytes reach ``max_batch_bytes``), or
(b) the oldest waiting message was consumed ``max_wait_ms`` ago or more (deadline counted from
    its consume time, not from when the device became free).

Otherwise the answer is "wait until the oldest message's deadline". Batches are never empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamproc.buffers import RingView


@dataclass(frozen=True, slots=True)
class Cut:
    """Take up to ``count`` messages now (oldest first); ``reason`` is "size", "bytes" or
    "deadline"."""

    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to cut yet; ask again at ``until_s`` (monotonic seconds), or None: no messages."""

    until_s: float | None


class Batcher:
    """Batch-cut policy.

    Args:
        max_batch_size: most messages per batch (>= 1).
        max_batch_bytes: most key+value bytes per batch (the first message is always taken).
        max_wait_ms: longest time the oldest message may wait after it was consumed.
    """

    def __init__(self, max_batch_size: int, max_batch_bytes: int, max_wait_ms: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_batch_bytes = max_batch_bytes
        self.max_wait_s = max_wait_ms / 1000.0

    def decide(self, views: Sequence[RingView], now_s: float) -> Cut | Wait:
        """Decide on the waiting messages described by ``views`` at time ``now_s``."""
        if not views:
            return Wait(None)
        waiting = sum(v.size for v in views)
        if waiting >= self.max_batch_size:
            return Cut(self.max_batch_size, "size")
        if sum(v.bytes for v in views) >= self.max_batch_bytes:
            return Cut(self.max_batch_size, "bytes")
        deadline_s = min(v.oldest_consumed_at_s for v in views) + self.max_wait_s
        if now_s >= deadline_s:
            return Cut(self.max_batch_size, "deadline")
        return Wait(deadline_s)
