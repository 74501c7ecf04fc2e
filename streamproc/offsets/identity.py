"""The ``transactional.id`` of this process (exactly-once only), chosen once at start-up.

1. ``kafka.transactional_id`` set: that id, as given.
2. ``$STREAMPROC_INSTANCE_ID`` set (the chart's StatefulSet: the pod name): ``<group_id>-<id>``.
3. Otherwise a *slot* of this host: the lowest free slot number ``n`` (0, 1, ...) of the
   consumer group, held by an exclusive ``flock`` on the lock file
   ``<lock folder>/streamproc-txn-<hash of group_id>-<n>.lock`` for as long as the process
   lives; the id is ``<group_id>-<host name>`` for slot 0 (the id of a single process, as
   before slots existed) and ``<group_id>-<host name>-<n>`` for the others.

The lock folder is ``$STREAMPROC_LOCK_DIR``, else :data:`DEFAULT_LOCK_DIR`
(``/tmp/streamproc-locks``), never ``$TMPDIR``: processes of one group whose ``TMPDIR`` differs
must still see each other's slots. A blank ``kafka.transactional_id`` or
``STREAMPROC_INSTANCE_ID`` is refused. ``STREAMPROC_INSTANCE_ID`` equal to the host name gives
slot 0's id: on one host, the processes of a group use either slots or instance ids, not both.

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
from dataclasses import dataclass, field
from pathlib import Path

from streamproc.config import Config
from streamproc.errors import ConfigError
from streamproc.logs import get_logger

log = get_logger(__name__)

MAX_SLOTS = 1024
"""Slots tried per consumer group and host before start-up fails."""

LOCK_DIR_ENV = "STREAMPROC_LOCK_DIR"
"""The environment variable that names the slot lock folder."""

DEFAULT_LOCK_DIR = Path("/tmp/streamproc-locks")
"""The slot lock folder when ``$STREAMPROC_LOCK_DIR`` is unset: one fixed path (not
``$TMPDIR``, which differs between processes; not ``/run/lock``, which is root-only on some
hosts and missing in minimal containers, so a fallback would again split the processes of one
host between two folders). Created, if missing, mode 1777 (sticky, like ``/tmp``) so processes
of every user share it."""

SLOT_FILE_MODE = 0o644
"""A slot file's mode, set with ``fchmod`` (not masked by the umask): any user can open it
read-only, which is all ``flock`` needs."""


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
        lock_dir: where the slot lock files live (default: :func:`lock_folder`:
            ``$STREAMPROC_LOCK_DIR``, else :data:`DEFAULT_LOCK_DIR`); every process of the host
            that may share the group must use the same.
        host: the host name (default: :func:`socket.gethostname`).

    Raises:
        ConfigError: ``STREAMPROC_INSTANCE_ID`` set but blank; or no slot could be taken (the
            lock folder is unusable: the message names ``STREAMPROC_LOCK_DIR``; or
            :data:`MAX_SLOTS` slots of the group are held or cannot be opened); the message
            names ``kafka.transactional_id`` and ``STREAMPROC_INSTANCE_ID``, which avoid slots.
    """
    group = config.kafka.group_id
    if config.kafka.transactional_id is not None:  # blank refused by the config
        return TransactionalIdentity(config.kafka.transactional_id)
    instance = os.environ.get("STREAMPROC_INSTANCE_ID")
    if instance is not None:
        if not instance.strip():
            raise ConfigError(
                f"environment variable STREAMPROC_INSTANCE_ID: blank ({instance!r}); set it to "
                "a name unique per process and stable across its restarts (the StatefulSet pod "
                "name, a systemd template unit's %i), or unset it to take a host slot"
            )
        return TransactionalIdentity(f"{group}-{instance}")
    host = host or socket.gethostname()
    folder = _usable_folder(lock_dir or lock_folder())
    digest = hashlib.sha256(group.encode()).hexdigest()[:16]
    for slot in range(MAX_SLOTS):
        path = folder / f"streamproc-txn-{digest}-{slot}.lock"
        fd = _open_lock(path)
        if fd is None:
            continue
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
        f"kafka.transactional_id: {MAX_SLOTS} transactional id slots of group {group!r} on "
        f"this host are held or cannot be opened ({folder}); set kafka.transactional_id or "
        "STREAMPROC_INSTANCE_ID (unique per process, stable across its restarts), or "
        f"{LOCK_DIR_ENV} to a folder only the group's processes can write"
    )


def lock_folder() -> Path:
    """The slot lock folder: ``$STREAMPROC_LOCK_DIR``, else :data:`DEFAULT_LOCK_DIR`.

    Raises:
        ConfigError: ``STREAMPROC_LOCK_DIR`` is set but blank.
    """
    value = os.environ.get(LOCK_DIR_ENV)
    if value is None:
        return DEFAULT_LOCK_DIR
    if not value.strip():
        raise ConfigError(
            f"environment variable {LOCK_DIR_ENV}: blank ({value!r}); set it to a folder "
            f"shared by the host's processes of the group (default {DEFAULT_LOCK_DIR}), or "
            "unset it"
        )
    return Path(value)


def _unusable(folder: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{LOCK_DIR_ENV}: the transactional id slot folder {folder} is unusable ({why}); set "
        f"{LOCK_DIR_ENV} to a writable folder shared by the host's processes of the group "
        f"(default {DEFAULT_LOCK_DIR}), or set kafka.transactional_id or "
        "STREAMPROC_INSTANCE_ID (unique per process, stable across its restarts)"
    )


def _usable_folder(folder: Path) -> Path:
    """``folder``, created if missing (its parent must exist) with mode 1777 so processes of
    every user share it.

    Raises:
        ConfigError: it cannot be created, or is not a folder (names ``STREAMPROC_LOCK_DIR``).
    """
    try:
        os.mkdir(folder, 0o1777)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _unusable(folder, exc.strerror or str(exc)) from exc
    else:
        try:
            os.chmod(folder, 0o1777)  # the umask masked the mode mkdir was given
        except OSError as exc:
            raise _unusable(folder, exc.strerror or str(exc)) from exc
    if not folder.is_dir():
        raise _unusable(folder, "not a folder")
    return folder


def _open_lock(path: Path) -> int | None:
    """A read-only descriptor of ``path``, created mode :data:`SLOT_FILE_MODE` if missing
    (``flock`` needs no write access, so processes of other users of the host share the slots);
    None, with a warning, when the file exists but cannot be opened (another user's file of
    mode 0600, or one squatted): the caller tries the next slot.

    Raises:
        ConfigError: the file is missing and cannot be created (the folder is unusable: names
            ``STREAMPROC_LOCK_DIR``).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, SLOT_FILE_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _unusable(path.parent, f"{path.name} cannot be created: {exc.strerror}") from exc
    else:
        try:
            os.fchmod(fd, SLOT_FILE_MODE)  # the umask masked the mode open was given
        except OSError as exc:
            os.close(fd)
            raise _unusable(path.parent, f"{path.name}: {exc.strerror}") from exc
        return fd
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning(
            "transactional id slot skipped",
            lock=str(path),
            error=exc.strerror or str(exc),
            why=f"the slot file cannot be opened; the next slot is tried ({LOCK_DIR_ENV})",
        )
        return None
