"""The ``transactional.id`` of this process (exactly-once only), chosen once at start-up.

1. ``kafka.transactional_id`` set: that id, as given.
2. ``$STREAMPROC_INSTANCE_ID`` set (the chart's StatefulSet: the pod name): ``<group_id>-<id>``.
3. Otherwise a *slot* of this host: the lowest free slot number ``n`` (0, 1, ...) of the
   consumer group, held by an exclusive ``flock`` on the lock file
   ``<tmpdir>/streamproc-txn-<hash of group_id>-<n>.lock`` for as long as the process lives;
   the id is ``<group_id>-<host name>`` for slot 0 (the id of a single process, as before
   slots existed) and ``<group_id>-<host name>-<n>`` for the others.

Why slots: processes started from one config on one host must not share an id (the newest
fences the others: ``_FENCED``, exit 1), yet a process restarted after ``kill -9`` must reuse
its dead predecessor's id, so that its ``init_transactions`` aborts the transaction the dead one
left open at once. A fresh id per process would leave that transaction open until
``transaction.timeout.ms`` expires (60 s by default in librdkafka), and read_committed readers
of the output cannot read past it meanwhile. The kernel releases a dead process's ``flock``, so
its slot (and id) is the lowest free one again. Zombies of a *different* slot (a process that
lost its partitions but still runs) are fenced by the consumer group's generation instead
(KIP-447: ``send_offsets_to_transaction`` carries the consumer group metadata). See
docs/guarantees.md ("Exactly-once").
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from streamproc.config import Config
from streamproc.errors import ConfigError
from streamproc.logs import get_logger

log = get_logger(__name__)

MAX_SLOTS = 1024
"""Slots tried per consumer group and host before start-up fails."""


@dataclass
class TransactionalIdentity:
    """The ``transactional.id`` this process uses, and the slot lock that reserves it.

    Attributes:
        transactional_id: the id (``transactional.id``).
        slot: the host slot held, or None when the id came from config or
            ``$STREAMPROC_INSTANCE_ID``.
        lock_path: the slot's lock file, or None.
    """

    transactional_id: str
    slot: int | None = None
    lock_path: Path | None = None
    _fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slot back (idempotent): call after the producer that uses the id is closed.
        A process that dies releases it too (the kernel drops its ``flock``)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def claim_transactional_id(
    config: Config, lock_dir: Path | None = None, host: str | None = None
) -> TransactionalIdentity:
    """Choose this process's ``transactional.id`` (see the module docstring).

    Args:
        config: the validated config (``kafka.transactional_id``, ``kafka.group_id``).
        lock_dir: where the slot lock files live (default: :func:`tempfile.gettempdir`, so
            ``$TMPDIR``); every process of the host that may share the group must use the same.
        host: the host name (default: :func:`socket.gethostname`).

    Raises:
        ConfigError: no slot could be taken (the lock directory is not writable, or
            :data:`MAX_SLOTS` processes of the group hold one); the message names
            ``kafka.transactional_id`` and ``STREAMPROC_INSTANCE_ID``, which avoid slots.
    """
    group = config.kafka.group_id
    if config.kafka.transactional_id:
        return TransactionalIdentity(config.kafka.transactional_id)
    instance = os.environ.get("STREAMPROC_INSTANCE_ID")
    if instance:
        return TransactionalIdentity(f"{group}-{instance}")
    host = host or socket.gethostname()
    folder = lock_dir or Path(tempfile.gettempdir())
    digest = hashlib.sha256(group.encode()).hexdigest()[:16]
    for slot in range(MAX_SLOTS):
        path = folder / f"streamproc-txn-{digest}-{slot}.lock"
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        suffix = "" if slot == 0 else f"-{slot}"
        identity = TransactionalIdentity(f"{group}-{host}{suffix}", slot, path, fd)
        log.info(
            "transactional id chosen",
            transactional_id=identity.transactional_id,
            slot=slot,
            lock=str(path),
        )
        return identity
    raise ConfigError(
        f"kafka.transactional_id: {MAX_SLOTS} processes of group {group!r} on this host hold "
        f"a transactional id slot ({folder}); set kafka.transactional_id or "
        "STREAMPROC_INSTANCE_ID (unique per process, stable across its restarts)"
    )


def _open_lock(path: Path) -> int:
    """A read-only descriptor of ``path``, created (mode 0644) if missing (``flock`` needs no
    write access, so processes of other users of the host share the slots).

    Raises:
        ConfigError: the file can be neither opened nor created.
    """
    try:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"kafka.transactional_id: not set, and the transactional id slot lock {path} "
            f"cannot be opened ({exc.strerror}); set kafka.transactional_id or "
            "STREAMPROC_INSTANCE_ID (unique per process, stable across its restarts), or "
            "TMPDIR to a writable directory shared by the host's processes"
        ) from exc
