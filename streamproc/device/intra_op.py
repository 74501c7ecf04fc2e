"""The intra-op thread count of one thread's torch calls, set for that thread only.

``torch.set_num_threads`` is process-wide in effect: it sets the calling thread's OpenMP thread
count *and* the value every thread that has not run a parallel op yet starts from, so calling
it on one lane's device thread would change the others'. OpenMP itself keeps the count per
thread (``omp_set_num_threads`` sets the calling thread's ``nthreads-var``), and torch's CPU
kernels (ATen's ``parallel_for``, oneDNN and MKL under the GNU OpenMP runtime torch ships on
Linux) size their parallel regions from the calling thread's value. :class:`IntraOpThreads`
sets that value through the OpenMP runtime torch loaded; where there is none (a torch built
without OpenMP) it does nothing and says so once.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from streamproc.logs import get_logger

log = get_logger(__name__)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime loaded with torch, or None."""
    try:
        setter = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        log.info("no OpenMP runtime found: low-priority calls keep every intra-op thread")
        return None
    setter.argtypes = [ctypes.c_int]
    setter.restype = None
    return setter


class IntraOpThreads:
    """The calling thread's intra-op threads: its own default, or half of it while yielding.

    Make and use it on one thread only (a device thread): the count it sets belongs to the
    thread that calls :meth:`use`.
    """

    def __init__(self) -> None:
        self._default: int | None = None
        self._current: int | None = None

    def use(self, yield_threads: bool) -> int:
        """Run this thread's next torch calls with half its default threads (at least one)
        when ``yield_threads``, else with its default; returns the count in effect."""
        if self._default is None:
            # torch sets a thread's count at its first parallel op: settle that first, so it
            # never overwrites ours
            self._default = self._current = torch.get_num_threads()
        wanted = max(1, self._default // 2) if yield_threads else self._default
        if wanted != self._current:
            setter = _omp_set_num_threads()
            if setter is None:
                return self._default
            setter(wanted)
            self._current = wanted
        return wanted
