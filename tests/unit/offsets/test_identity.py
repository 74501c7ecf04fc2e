"""The transactional id of a process: explicit, per StatefulSet instance, or a host slot held
by a ``flock`` that a dead process releases (so its restart takes the same id back)."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import structlog

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError
from streamproc.offsets import identity
from streamproc.offsets.identity import claim_transactional_id

DIGEST_G = hashlib.sha256(b"g").hexdigest()[:16]
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
        claim_transactional_id(config(), tmp_path / "missing" / "locks", "h")


def test_the_lock_folder_does_not_follow_each_processs_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes of one group whose $TMPDIR differs (a systemd unit's environment, a shell's)
    still see each other's slot: the folder is STREAMPROC_LOCK_DIR, never $TMPDIR."""
    monkeypatch.setenv("STREAMPROC_LOCK_DIR", str(tmp_path / "locks"))
    claims = []
    for tmpdir in ("a", "b"):
        (tmp_path / tmpdir).mkdir()
        monkeypatch.setenv("TMPDIR", str(tmp_path / tmpdir))
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads $TMPDIR again
        claims.append(claim_transactional_id(config(), host="h"))
    assert [c.transactional_id for c in claims] == ["g-h", "g-h-1"]
    assert {c.lock_path.parent for c in claims if c.lock_path} == {tmp_path / "locks"}
    for claim in claims:
        claim.release()


def test_the_default_lock_folder_is_fixed_and_shared_by_every_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STREAMPROC_LOCK_DIR", raising=False)
    default = tmp_path / "streamproc-locks"
    monkeypatch.setattr(identity, "DEFAULT_LOCK_DIR", default)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    old = os.umask(0o077)
    try:
        claim = claim_transactional_id(config(), host="h")
    finally:
        os.umask(old)
    assert claim.lock_path == default / f"streamproc-txn-{DIGEST_G}-0.lock"
    assert stat.S_IMODE(default.stat().st_mode) == 0o1777  # created by the first, for all users
    assert stat.S_IMODE(claim.lock_path.stat().st_mode) == 0o644  # umask 077 or not
    claim.release()


@pytest.mark.parametrize("make", ["missing-parent", "a-file"])
def test_an_unusable_lock_folder_fails_at_start_up_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: str
) -> None:
    (tmp_path / "f").write_text("not a folder")
    folder = tmp_path / "f" / "locks" if make == "missing-parent" else tmp_path / "f"
    monkeypatch.setenv("STREAMPROC_LOCK_DIR", str(folder))
    with pytest.raises(ConfigError, match=r"STREAMPROC_LOCK_DIR.*kafka\.transactional_id"):
        claim_transactional_id(config(), host="h")


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_lock_dir_setting_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("STREAMPROC_LOCK_DIR", value)
    with pytest.raises(ConfigError, match="STREAMPROC_LOCK_DIR"):
        claim_transactional_id(config(), host="h")


def test_a_slot_file_that_cannot_be_opened_is_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot file of another user, mode 0600 (or squatted): the next slot, not a failure."""
    squatted = tmp_path / f"streamproc-txn-{DIGEST_G}-0.lock"
    squatted.write_text("")
    real_open = os.open

    def refuse_slot_0(path: Any, flags: int, mode: int = 0o777) -> int:
        if Path(path) == squatted and not flags & os.O_CREAT:  # the create finds it (EEXIST)
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(identity.os, "open", refuse_slot_0)
    with structlog.testing.capture_logs() as logs:
        claim = claim_transactional_id(config(), tmp_path, "h")
    assert (claim.transactional_id, claim.slot) == ("g-h-1", 1)
    skipped = [e for e in logs if e["event"] == "transactional id slot skipped"]
    assert [(e["log_level"], e["lock"]) for e in skipped] == [("warning", str(squatted))]
    claim.release()


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_a_blank_instance_id_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("STREAMPROC_INSTANCE_ID", value)
    with pytest.raises(ConfigError, match="STREAMPROC_INSTANCE_ID"):
        claim_transactional_id(config(), tmp_path, "h")


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_transactional_id_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"kafka\.transactional_id"):
        config(transactional_id=value)
