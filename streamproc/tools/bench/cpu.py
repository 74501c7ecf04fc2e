"""Process CPU time of a bench contender, from ``/proc``, excluding start-up and model loading.

Every contender runs in a process of its own (:mod:`streamproc.tools.bench.child`), so its
process CPU is its own: every thread of the process (librdkafka's and torch's included, and
threads that have already exited), plus, where asked, its child processes (streamproc's decode
processes, from their ``/proc/<pid>/stat``). Per-thread time comes from
``/proc/self/task/<tid>/stat`` (the profile in ``bench.json``).

The process's own total is read from the kernel's process CPU clock
(``CLOCK_PROCESS_CPUTIME_ID``): the same sum as user + system time in ``/proc/self/stat``, in
nanoseconds instead of clock ticks of ``1 / SC_CLK_TCK`` s (10 ms). The honest floor spends
about 0.2 s on 20,000 trades; in ticks that is 20, and one tick would be 5 % of the value.

A :class:`CpuMeter` reads the process total when the contender's first input arrives and again
when its last result is acknowledged: CPU per message is the difference over the results, so
start-up, model loading, group join, the idle wait at the end and close are left out for every
contender alike.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
"""Seconds per clock tick, the unit of ``utime``/``stime`` in ``/proc/.../stat``."""


@dataclass(frozen=True)
class StatLine:
    """The fields of one ``/proc/<pid>[/task/<tid>]/stat`` line the bench uses.

    Attributes:
        pid: process or thread id (field 1).
        name: ``comm``, the executable's or thread's name (field 2, without the parentheses).
        user_ticks: ``utime`` (field 14), clock ticks in user mode.
        system_ticks: ``stime`` (field 15), clock ticks in kernel mode.
    """

    pid: int
    name: str
    user_ticks: int
    system_ticks: int

    @property
    def cpu_s(self) -> float:
        """User + system CPU time in seconds."""
        return (self.user_ticks + self.system_ticks) * TICK_S


def parse_stat(line: str) -> StatLine:
    """Parse one stat line. ``comm`` may hold spaces and parentheses (a thread may name itself
    ``a) b``), so the fields after it are found from the *last* closing parenthesis.

    Raises:
        ValueError: not a stat line.
    """
    head, paren, rest = line.rpartition(")")
    pid, open_paren, name = head.partition(" (")
    fields = rest.split()
    if not paren or not open_paren or len(fields) < 13:
        raise ValueError(f"not a /proc stat line: {line[:80]!r}")
    # fields[0] is field 3 (state): utime is field 14, stime field 15
    return StatLine(int(pid), name, int(fields[11]), int(fields[12]))


def read_stat(path: str | Path) -> StatLine | None:
    """The stat line at ``path``; None when the process or thread is gone."""
    try:
        with open(path) as stat:
            return parse_stat(stat.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def child_pids(pid: int | str = "self") -> list[int]:
    """Direct child processes of ``pid`` (``/proc/<pid>/task/*/children``)."""
    pids: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids.extend(int(p) for p in children.read_text().split())
        except FileNotFoundError:  # the thread exited meanwhile
            continue
    return pids


def process_cpu_s(pid: int | str = "self", children: bool = False) -> float:
    """CPU seconds of process ``pid`` (every thread, live or exited); with ``children``, plus
    those of its live child processes and theirs. 0.0 when the process is gone."""
    stat = read_stat(f"/proc/{pid}/stat")
    total = stat.cpu_s if stat is not None else 0.0
    if children:
        total += sum(process_cpu_s(child, children=True) for child in child_pids(pid))
    return total


def machine_busy_s(stat: str = "/proc/stat") -> float:
    """Seconds the machine's cores have spent busy since boot, summed over the cores: the
    ``cpu`` line of ``/proc/stat`` (clock ticks) less its ``idle`` and ``iowait`` (and the
    ``guest`` fields, already counted in ``user`` and ``nice``). The difference of two readings
    over the wall time between them is how many cores were busy on average.

    Raises:
        ValueError: the file's first line is not the ``cpu`` line."""
    fields = Path(stat).read_text().split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"{stat} does not start with the cpu line: {fields[:1]}")
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) * TICK_S


def own_cpu_s(children: bool = False) -> float:
    """CPU seconds of this process (every thread, live or exited; nanosecond resolution); with
    ``children``, plus those of its live child processes (clock ticks)."""
    total = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
    if children:
        total += sum(process_cpu_s(pid, children=True) for pid in child_pids())
    return total


def thread_cpu(pid: int | str = "self") -> dict[int, StatLine]:
    """Per live thread of ``pid``: its stat line, by thread id."""
    threads: dict[int, StatLine] = {}
    for path in Path(f"/proc/{pid}/task").glob("*/stat"):
        stat = read_stat(path)
        if stat is not None:
            threads[stat.pid] = stat
    return threads


def thread_deltas(
    first: dict[int, StatLine], last: dict[int, StatLine], names: dict[int, str]
) -> dict[str, float]:
    """CPU seconds per thread name between two :func:`thread_cpu` readings (threads with the
    same name add up; a thread born in between counts from zero; one gone by ``last`` is left
    out). ``names`` maps thread ids to Python thread names; other threads keep their ``comm``
    (librdkafka's ``rdk:broker1``, torch's workers)."""
    used: dict[str, float] = {}
    for tid, stat in last.items():
        before = first.get(tid)
        name = names.get(tid) or stat.name
        used[name] = used.get(name, 0.0) + stat.cpu_s - (before.cpu_s if before else 0.0)
    return {name: round(seconds, 4) for name, seconds in used.items() if seconds > 0}


@dataclass
class CpuTrace:
    """The CPU window of one contender run; crosses the process boundary (picklable).

    Attributes:
        start_wall_s, start_cpu_s: ``time.time()`` and process CPU seconds when the first
            input arrived (None: never).
        end_wall_s, end_cpu_s: the same when the last result was acknowledged.
        threads_cpu_s: CPU seconds per thread name within the window; streamproc's decode
            processes as ``decode processes``.
    """

    start_wall_s: float | None = None
    start_cpu_s: float | None = None
    end_wall_s: float | None = None
    end_cpu_s: float | None = None
    threads_cpu_s: dict[str, float] = field(default_factory=dict)

    def cpu_s(self) -> float | None:
        """Process CPU seconds within the window; None when it was not closed."""
        if self.start_cpu_s is None or self.end_cpu_s is None:
            return None
        return self.end_cpu_s - self.start_cpu_s


class CpuMeter:
    """Opens and closes a contender's CPU window (see the module docstring).

    Each mark reads ``/proc`` once (the process total, every thread and, with ``children``,
    the child processes): there is no sampling thread, which would take the GIL from the
    contender 100 times a second. Only the first call of each mark counts; the marks may come
    from different threads (streamproc: the source thread opens, a watcher closes).

    Args:
        children: add the CPU of child processes (streamproc's decode processes).
    """

    def __init__(self, children: bool = False) -> None:
        self.trace = CpuTrace()
        self._children = children
        self._threads_first: dict[int, StatLine] = {}
        self._children_first_s = 0.0

    def _children_cpu_s(self) -> float:
        return sum(process_cpu_s(pid, children=True) for pid in child_pids())

    def mark_start(self) -> None:
        """The contender's first input arrived now."""
        if self.trace.start_cpu_s is not None:
            return
        self._threads_first = thread_cpu()
        if self._children:
            self._children_first_s = self._children_cpu_s()
        self.trace.start_wall_s = time.time()
        self.trace.start_cpu_s = own_cpu_s(self._children)

    def mark_end(self) -> None:
        """The contender's last result was acknowledged now (ignored before the start)."""
        if self.trace.start_cpu_s is None or self.trace.end_cpu_s is not None:
            return
        self.trace.end_cpu_s = own_cpu_s(self._children)
        self.trace.end_wall_s = time.time()
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
        threads = thread_deltas(self._threads_first, thread_cpu(), names)
        if self._children:
            threads["decode processes"] = round(self._children_cpu_s() - self._children_first_s, 4)
        self.trace.threads_cpu_s = threads
