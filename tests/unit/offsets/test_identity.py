"""The transactional id of a process: explicit, per StatefulSet instance, or a host slot held
by binding a Linux abstract Unix socket, a name the kernel frees when its process dies (so a
restart takes the same id back) and that nothing on disk can take away."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError
from streamproc.offsets import identity
from streamproc.offsets.identity import claim_transactional_id, slot_socket_name

PIPELINE = {"name": "p", "input_topic": "in", "output_topic": "out", "workload": "trades"}

HOLDER = """
import sys
from streamproc.config import load_config
from streamproc.offsets.identity import claim_transactional_id
cfg = load_config(overrides={"pipelines": [PIPELINE], "processing_guarantee": "exactly_once",
                             "kafka": {"group_id": GROUP}})
claim = claim_transactional_id(cfg, host="h")
print("id=" + claim.transactional_id, flush=True)
sys.stdin.read()
"""


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


@pytest.fixture
def group() -> str:
    """A group of this test alone: slot names are host-wide, shared with every test run (and
    every ``streamproc run``) of the host."""
    return f"g-{uuid.uuid4().hex}"


def start_holder(
    group: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """A separate process that claims a slot of ``group`` (host ``h``) and holds it until its
    stdin closes; returns it and the id it took (read from its stdout once claimed: no sleeps)."""
    script = f"PIPELINE = {PIPELINE!r}\nGROUP = {group!r}\n" + HOLDER
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith("id="):  # the log line before it
        line = proc.stdout.readline()
    return proc, line.strip().removeprefix("id=")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()  # reaped, its pipes closed


def bound_abstract_names() -> set[str]:
    """The abstract Unix socket names bound in this network namespace, as ``@name``."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) > 7}


def test_an_explicit_id_or_an_instance_id_is_used_as_today(
    monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    explicit = claim_transactional_id(config(group_id=group, transactional_id="mine"), "h")
    assert (explicit.transactional_id, explicit.slot, explicit.socket_name) == ("mine", None, None)
    monkeypatch.setenv("STREAMPROC_INSTANCE_ID", "streamproc-2")
    instance = claim_transactional_id(config(group_id=group), "h")
    assert (instance.transactional_id, instance.slot) == (f"{group}-streamproc-2", None)
    monkeypatch.delenv("STREAMPROC_INSTANCE_ID")
    slot = claim_transactional_id(config(group_id=group), "h")
    assert slot.slot == 0  # neither took a slot
    slot.release()


def test_processes_of_one_host_get_a_slot_each_and_a_released_slot_is_reused(group: str) -> None:
    cfg = config(group_id=group)
    first = claim_transactional_id(cfg, "h")
    second = claim_transactional_id(cfg, "h")
    third = claim_transactional_id(cfg, "h")
    ids = [c.transactional_id for c in (first, second, third)]
    assert ids == [f"{group}-h", f"{group}-h-1", f"{group}-h-2"]
    first.release()
    first.release()  # idempotent
    again = claim_transactional_id(cfg, "h")
    assert (again.transactional_id, again.slot) == (f"{group}-h", 0)
    other_group = claim_transactional_id(config(group_id=group + "-other"), "h")
    assert other_group.transactional_id == f"{group}-other-h"  # slots are per consumer group
    for claim in (second, third, again, other_group):
        claim.release()


def test_a_slot_is_an_abstract_socket_named_in_the_log_and_nothing_on_disk(group: str) -> None:
    digest = hashlib.sha256(group.encode()).hexdigest()[:16]
    with structlog.testing.capture_logs() as logs:
        claim = claim_transactional_id(config(group_id=group), "h")
    try:
        assert claim.socket_name == slot_socket_name(group, 0) == f"\0streamproc-txn-{digest}-0"
        assert f"@streamproc-txn-{digest}-0" in bound_abstract_names()  # held in the kernel
        chosen = [e for e in logs if e["event"] == "transactional id chosen"]
        assert [(e["transactional_id"], e["slot"], e["socket"]) for e in chosen] == [
            (f"{group}-h", 0, f"@streamproc-txn-{digest}-0")
        ]
    finally:
        claim.release()
    assert f"@streamproc-txn-{digest}-0" not in bound_abstract_names()  # released: name freed


def test_a_held_slot_stays_held_whatever_is_deleted_on_disk(tmp_path: Path, group: str) -> None:
    """The defect: process A held slot 0 by a flock on a lock file; a tmp cleaner (or another
    user) removed the file, process B took slot 0 too, and A died _FENCED. Whatever a holder
    leaves on disk is deleted here; the next claim must still find slot 0 held."""
    digest = hashlib.sha256(group.encode()).hexdigest()[:16]
    proc, taken = start_holder(group, {"TMPDIR": str(tmp_path)})
    try:
        assert taken == f"{group}-h"
        # what the old code left: /tmp/streamproc-locks/streamproc-txn-<digest>-0.lock
        for folder in (Path("/tmp/streamproc-locks"), Path("/tmp"), tmp_path):
            for leftover in folder.glob(f"streamproc-txn-{digest}-*"):
                leftover.unlink()
        second = claim_transactional_id(config(group_id=group), host="h")
        try:
            assert (second.transactional_id, second.slot) == (f"{group}-h-1", 1)
        finally:
            second.release()
    finally:
        stop(proc)


def test_a_slot_of_a_process_killed_minus_9_is_free_again(group: str) -> None:
    proc, taken = start_holder(group)
    try:
        assert taken == f"{group}-h"
        busy = claim_transactional_id(config(group_id=group), "h")
        assert busy.transactional_id == f"{group}-h-1"  # slot 0 is held
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL  # dead and reaped: the kernel freed its name
        restarted = claim_transactional_id(config(group_id=group), "h")
        assert (restarted.transactional_id, restarted.slot) == (f"{group}-h", 0)  # back at once
        busy.release()
        restarted.release()
    finally:
        stop(proc)


def test_processes_whose_tmpdir_differs_see_each_others_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    """A systemd unit's environment and a shell's differ in TMPDIR: still one slot each."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc, taken = start_holder(group, {"TMPDIR": str(tmp_path / "a")})
    try:
        assert taken == f"{group}-h"
        monkeypatch.setenv("TMPDIR", str(tmp_path / "b"))
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads $TMPDIR again
        claim = claim_transactional_id(config(group_id=group), "h")
        assert (claim.transactional_id, claim.slot) == (f"{group}-h-1", 1)
        claim.release()
    finally:
        stop(proc)


def test_all_slots_held_fails_at_start_up_naming_the_keys(
    monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    monkeypatch.setattr(identity, "MAX_SLOTS", 3)
    held = [claim_transactional_id(config(group_id=group), "h") for _ in range(3)]
    assert [c.slot for c in held] == [0, 1, 2]
    with pytest.raises(
        ConfigError, match=r"kafka\.transactional_id: all 3 .*slots.*held.*STREAMPROC_INSTANCE_ID"
    ):
        claim_transactional_id(config(group_id=group), "h")
    for claim in held:
        claim.release()


def test_no_abstract_sockets_fails_at_start_up_naming_the_settings(
    monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    monkeypatch.setattr(identity.sys, "platform", "darwin")
    with pytest.raises(ConfigError, match=r"darwin.*kafka\.transactional_id.*INSTANCE_ID"):
        claim_transactional_id(config(group_id=group), "h")
    monkeypatch.setenv("STREAMPROC_INSTANCE_ID", "a")  # ids that need no slot still work
    assert claim_transactional_id(config(group_id=group), "h").transactional_id == f"{group}-a"


def test_a_socket_that_cannot_be_bound_fails_naming_the_settings(
    monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    closed: list[str] = []

    class Refused:
        """A socket whose bind fails for another reason than a held name."""

        def __init__(self, *args: Any) -> None:
            pass

        def bind(self, name: str) -> None:
            raise OSError(errno.EACCES, "Permission denied")

        def close(self) -> None:
            closed.append("closed")

    monkeypatch.setattr(identity.socket, "socket", Refused)
    with pytest.raises(ConfigError, match=r"cannot be bound \(Permission denied\).*INSTANCE_ID"):
        claim_transactional_id(config(group_id=group), "h")
    assert closed == ["closed"]  # no descriptor leaked


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_a_blank_instance_id_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("STREAMPROC_INSTANCE_ID", value)
    with pytest.raises(ConfigError, match="STREAMPROC_INSTANCE_ID"):
        claim_transactional_id(config(), "h")


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_transactional_id_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"kafka\.transactional_id"):
        config(transactional_id=value)
