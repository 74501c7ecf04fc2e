"""A broker's stop-the-world pauses, read from its GC log: when the broker stopped serving
produce and fetch requests, and for how long.

The log is what ``-Xlog:gc`` (or ``gc*``) writes with the ``time`` decorator, as the local
broker does (:attr:`streamproc.tools.kafka_local.LocalKafka.gc_log_path`,
``logs/kafkaServer-gc.log``) and Kafka's own ``kafka-server-start.sh`` does; for a running JVM
the JDK's ``jcmd <pid> VM.log output=<file> what=gc decorators=time`` turns it on. A line such
as::

    [2026-12-07T14:32:55.666+0000][gc] GC(103) Pause Young (Normal) (G1 Evacuation Pause) ...
        ... 273M->178M(310M) 92.096ms

(one line in the log) is one pause of 92.096 ms that ended at that time. Lines without a pause
(a concurrent cycle, the JVM's start-up report) are skipped.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_PAUSE = re.compile(
    r"^\[(?P<time>\d{4}-\d\d-\d\dT[^\]]+)\].*\bGC\(\d+\) Pause (?P<kind>\w+)\b.* "
    r"(?P<ms>\d+(?:\.\d+)?)ms$"
)


@dataclass(frozen=True, slots=True)
class Pause:
    """One stop-the-world pause.

    Attributes:
        end_s: when it ended, Unix seconds (the log line's time stamp).
        ms: its length, milliseconds.
        kind: G1's name for it: ``Young``, ``Remark``, ``Cleanup`` or ``Full``.
    """

    end_s: float
    ms: float
    kind: str


def pauses(path: Path) -> list[Pause]:
    """Every pause in the GC log ``path`` and in its rotated files (``path.0``, ``path.1``,
    ...), in time order; an empty list when there is no such log.

    Raises:
        OSError: a log file exists but cannot be read.
    """
    files = [path, *sorted(path.parent.glob(f"{glob.escape(path.name)}.[0-9]*"))]
    found = [pause for file in files if file.exists() for pause in _read(file)]
    return sorted(found, key=lambda pause: pause.end_s)


def _read(file: Path) -> list[Pause]:
    found: list[Pause] = []
    with file.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            match = _PAUSE.match(line.rstrip())
            if match is None:
                continue
            stamp = datetime.strptime(match["time"], "%Y-%m-%dT%H:%M:%S.%f%z")
            found.append(Pause(stamp.timestamp(), float(match["ms"]), match["kind"]))
    return found


def within(found: list[Pause], start_s: float, end_s: float) -> list[Pause]:
    """The pauses of ``found`` that ended in ``[start_s, end_s)`` (Unix seconds)."""
    return [pause for pause in found if start_s <= pause.end_s < end_s]
