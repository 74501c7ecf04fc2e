"""The asynchronous backends' (CUDA's) two event waiters of one device worker.

``slabs-<label>`` waits on each launched batch's ``copied`` event, in launch order, and gives
its staging slab back; ``completion-<label>`` waits on each batch's ``done`` event, in launch
order, and completes it (the worker's ``complete``: outputs to ``on_complete``). Both sleep in
the wait (blocking sync events, the GIL released): no thread polls. A batch's slab never waits
for an earlier batch's compute. The copies are waited on in launch order: a copy that finishes
before an earlier batch's (its stream was free sooner) gives its slab back only after that one;
the pool then has one slab fewer for a moment, never a slab back too early.

Ownership: the two deques (batches not yet done, batches whose slab is not yet back) belong to
:class:`EventWaiters` (its condition); the device thread appends (:meth:`EventWaiters.hand_over`),
each waiting thread pops its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from streamproc.device.launch import Launched
from streamproc.device.staging import StagingPool


class EventWaiters:
    """The slab and completion threads of one device worker on an asynchronous backend.

    Args:
        pool: the staging pool the batches' slabs go back to.
        complete: completes a batch whose ``done`` event fired (on the completion thread).
        bind_thread: makes the device the calling thread's current one (each thread first).
        thread: makes a daemon thread ``<role>-<label>`` running a function (the worker's:
            what it raises goes to the worker's ``on_fatal``).
    """

    def __init__(
        self,
        pool: StagingPool,
        complete: Callable[[Launched], None],
        bind_thread: Callable[[], None],
        thread: Callable[[Callable[[], None], str], threading.Thread],
    ) -> None:
        self._pool = pool
        self._complete = complete
        self._bind_thread = bind_thread
        self._cond = threading.Condition()
        self._inflight: deque[Launched] = deque()  # not yet done (under _cond)
        self._copying: deque[Launched] = deque()  # slab not yet back (under _cond)
        self._stopping = False
        self.threads = [
            thread(self._completion_loop, "completion"),
            thread(self._slab_loop, "slabs"),
        ]

    def hand_over(self, item: Launched) -> None:
        """A launched batch (device thread): both threads take it from here."""
        with self._cond:
            self._inflight.append(item)
            self._copying.append(item)
            self._cond.notify_all()

    def stop(self) -> None:
        """The threads finish what was handed over, then return."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _completion_loop(self) -> None:
        """Per batch in launch order: wait (sleeping) on its ``done`` event, complete it."""
        self._bind_thread()
        while (head := self._next(self._inflight)) is not None:
            head.done.synchronize()
            with self._cond:
                self._inflight.popleft()
            self._complete(head)

    def _slab_loop(self) -> None:
        """Per batch in launch order: wait (sleeping) on its ``copied`` event, give its staging
        slab back."""
        self._bind_thread()
        while (item := self._next(self._copying)) is not None:
            item.copied.synchronize()
            self._pool.release(item.job.slab)
            with self._cond:
                self._copying.popleft()
                item.slab_released = True

    def _next(self, items: deque[Launched]) -> Launched | None:
        """The first of ``items`` once there is one (left in place); None once stopped with
        none left."""
        with self._cond:
            while not items:
                if self._stopping:
                    return None
                self._cond.wait()
            return items[0]
