from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from streamproc.tools.broker_gc import Pause, pauses, within

# lines as the local broker writes them (-Xlog:gc:...:time,tags) and as `jcmd VM.log
# decorators=time,uptimemillis` does, with the lines around them that are not pauses
LOG = """\
[2026-12-07T14:32:20.100+0000][gc] Using G1
[2026-12-07T14:32:21.092+0000][gc] GC(85) Pause Cleanup 183M->183M(310M) 0.073ms
[2026-12-07T14:32:21.093+0000][gc] GC(85) Concurrent Mark Cycle 107.201ms
[2026-12-07T14:32:55.666+0000][155300ms] GC(103) Pause Young (Normal) (G1 Evacuation Pause) \
273M->178M(310M) 92.096ms
[2026-12-07T14:32:25.273+0000][gc] GC(89) Pause Remark 183M->182M(310M) 7.981ms
"""
ROTATED = "[2026-12-07T14:30:00.500+0000][gc] GC(1) Pause Full (System.gc()) 40M->20M(256M) 55ms\n"


def _unix(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def test_reads_every_pause_with_its_end_and_length_in_time_order(tmp_path: Path) -> None:
    log = tmp_path / "kafkaServer-gc.log"
    log.write_text(LOG)
    (tmp_path / "kafkaServer-gc.log.0").write_text(ROTATED)  # rotated away: read too
    (tmp_path / "server.log").write_text(LOG)  # another log in the folder: not read
    found = pauses(log)
    assert [(p.kind, p.ms) for p in found] == [
        ("Full", 55.0),
        ("Cleanup", 0.073),
        ("Remark", 7.981),
        ("Young", 92.096),
    ]
    young = found[-1]
    assert young.end_s == pytest.approx(_unix("2026-12-07T14:32:55.666+0000"))


def test_no_log_gives_no_pauses(tmp_path: Path) -> None:
    assert pauses(tmp_path / "kafkaServer-gc.log") == []


def test_within_keeps_the_pauses_that_ended_in_the_window() -> None:
    found = [Pause(10.0, 5.0, "Young"), Pause(11.0, 20.0, "Young"), Pause(12.0, 1.0, "Remark")]
    assert within(found, 10.0, 12.0) == found[:2]  # the window's end is not in it
    assert within(found, 12.5, 20.0) == []
