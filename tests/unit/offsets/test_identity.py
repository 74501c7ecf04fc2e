"""The transactional id of a process: explicit, per StatefulSet instance, or a host slot held
by a ``flock`` that a dead process releases (so its restart takes the same id back)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError
from streamproc.offsets.identity import claim_transactional_id

PIPELINE = {"name": "p", "input_topic": "in", "output_topic": "out", "workload": "trades"}


def config(**kafka: Any) -> Config:
    return load_config(
        overrides={
            "pipelines": [PIPELINE],
            "processing_guarantee": "exactly_once",
            "kafka": {"group_id": "g", **kafka},
        }
    )


@pytest.fixture(autouse=True)
def no_instance_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMPROC_INSTANCE_ID", raising=False)


def test_an_explicit_id_or_an_instance_id_is_used_as_today(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    explicit = claim_transactional_id(config(transactional_id="mine"), tmp_path, "h")
    assert (explicit.transactional_id, explicit.slot) == ("mine", None)
    monkeypatch.setenv("STREAMPROC_INSTANCE_ID", "streamproc-2")
    instance = claim_transactional_id(config(), tmp_path, "h")
    assert (instance.transactional_id, instance.slot) == ("g-streamproc-2", None)
    assert list(tmp_path.iterdir()) == []  # no slot taken


def test_processes_of_one_host_get_a_slot_each_and_a_released_slot_is_reused(
    tmp_path: Path,
) -> None:
    cfg = config()
    first = claim_transactional_id(cfg, tmp_path, "h")
    second = claim_transactional_id(cfg, tmp_path, "h")
    third = claim_transactional_id(cfg, tmp_path, "h")
    assert [c.transactional_id for c in (first, second, third)] == ["g-h", "g-h-1", "g-h-2"]
    first.release()
    first.release()  # idempotent
    again = claim_transactional_id(cfg, tmp_path, "h")
    assert (again.transactional_id, again.slot) == ("g-h", 0)
    other_group = claim_transactional_id(config(group_id="other"), tmp_path, "h")
    assert other_group.transactional_id == "other-h"  # slots are per consumer group
    for claim in (second, third, again, other_group):
        claim.release()


def test_a_slot_of_a_process_killed_minus_9_is_free_again(tmp_path: Path) -> None:
    holder = f"""
import sys
from pathlib import Path
from streamproc.config import load_config
from streamproc.offsets.identity import claim_transactional_id
cfg = load_config(overrides={{"pipelines": [{PIPELINE!r}],
                  "processing_guarantee": "exactly_once", "kafka": {{"group_id": "g"}}}})
claim = claim_transactional_id(cfg, Path({str(tmp_path)!r}), "h")
print("id=" + claim.transactional_id, flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("id="):  # the log line before it
            line = proc.stdout.readline()
        assert line.strip() == "id=g-h"
        busy = claim_transactional_id(config(), tmp_path, "h")
        assert busy.transactional_id == "g-h-1"  # slot 0 is held
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        restarted = claim_transactional_id(config(), tmp_path, "h")
        assert restarted.transactional_id == "g-h"  # the killed process's id, back at once
        busy.release()
        restarted.release()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaped, its pipes closed


def test_an_unwritable_lock_directory_fails_naming_the_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kafka\.transactional_id.*STREAMPROC_INSTANCE_ID"):
        claim_transactional_id(config(), tmp_path / "missing", "h")
