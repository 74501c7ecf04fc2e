"""Where each lane decodes: on the decode threads or inline on its dispatcher thread (a pure
policy per lane; ``worker.decode_mode: thread`` only).

:class:`DecodeRoutePolicy` is owned by the lane's :class:`~streamproc.decode.threads.ThreadDecoder`
on its dispatcher thread. The dispatcher waits for its batch's decode either way; the decode
threads cost a submit, a future and a wake-up per slice, and GIL contention between slices, and
pay only where splitting a batch shortens that wait (a decoder that releases the GIL, on free
cores). Which way wins depends on the decoder, the batch size and the free cores, so the policy
measures both, per batch, the dispatcher's wait (wall) and the CPU of every thread that
decoded, and settles on the pool if its wait is shorter by a margin (the split pays), else
inline if its CPU is lower by the margin (the pool only adds hand-offs), else the current way
(the pool at start); it probes again later, less often while the way holds.

A lane whose decode turns expensive (its CPU per record doubles) is probed at once and goes
back to the pool where the split shortens its wait; there the decode sizer can give it more
workers.

The measuring policy is :class:`streamproc.routes.RoutePolicy` (shared with the fused lane's
choice); measurements behind these defaults: ``docs/benchmarks-history.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from streamproc.routes import RouteChange as _RouteChange
from streamproc.routes import RoutePolicy

Route = Literal["inline", "pool"]
"""Where a lane decodes a batch: on its dispatcher thread, or on the decode threads (``"pool"``,
the value the ``decode route changed`` log event carries)."""

RouteChange = _RouteChange[Route]
"""A decision: the lane decodes ``route`` from now on; ``reason`` says why (logged)."""


class DecodeRoutePolicy(RoutePolicy[Route]):
    """Whether one lane decodes inline (on its dispatcher thread) or on the decode threads, by
    the measured CPU and wall seconds per record of each way (see the module docstring): a
    :class:`~streamproc.routes.RoutePolicy` whose simple way is ``inline`` and parallel way
    ``pool``, alternating batch by batch in a probe.

    Not thread-safe: its one owner (the lane's decoder, on the lane's dispatcher thread) calls
    :meth:`route` before each batch and :meth:`observe` after it (``wall_s``: the dispatcher's
    wait for the decode; ``cpu_s``: the dispatcher's CPU plus the decode threads' on the pool).

    Args:
        clock: monotonic seconds (injected; tests pass a
            :class:`~tests.support.kafka_fakes.FakeClock`).
        start: the way at start, kept until a probe shows the other better.
        probe_batches, margin, recheck_s, max_recheck_s, drift, drift_batches: as
            :class:`~streamproc.routes.RoutePolicy`.

    Raises:
        ValueError: a non-positive count or period, a margin outside [0, 1) or a drift <= 1.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        start: Route = "pool",
        probe_batches: int = 8,
        margin: float = 0.1,
        recheck_s: float = 30.0,
        max_recheck_s: float = 600.0,
        drift: float = 2.0,
        drift_batches: int = 64,
    ) -> None:
        super().__init__(
            "inline",
            "pool",
            "decode",
            clock,
            start=start,
            probe_batches=probe_batches,
            margin=margin,
            recheck_s=recheck_s,
            max_recheck_s=max_recheck_s,
            drift=drift,
            drift_batches=drift_batches,
        )
