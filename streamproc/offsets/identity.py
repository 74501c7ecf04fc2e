"""The ``transactional.id`` of this process (exactly-once only), chosen once at start-up.

1. ``kafka.transactional_id`` set: that id, as given.
2. ``$STREAMPROC_INSTANCE_ID`` set (the chart's StatefulSet: the pod name): ``<group_id>-<id>``.
3. Otherwise a *slot* of this host: the lowest free slot number ``n`` (0, 1, ...) of the
   consumer group, held by binding the Linux abstract Unix domain socket
   ``\\0streamproc-txn-<hash of group_id>-<n>`` (:func:`slot_socket_name`) for as long as the
   process lives; the id is ``<group_id>-<host name>`` for slot 0 (the id of a single process,
   as before slots existed) and ``<group_id>-<host name>-<n>`` for the others.

An abstract socket name lives in the kernel, not in the filesystem: no tmp cleaner, ``TMPDIR``,
private ``/tmp``, umask or file permission can make two live processes hold one slot, and the
processes of every user of the host share the names. The names are scoped to the network
namespace: processes that share a host name but not a network namespace (containers in their
own network namespace given the same host name) do not see each other's slots and must set
``STREAMPROC_INSTANCE_ID``. Platforms without the abstract namespace (not Linux) fail at
start-up unless ``kafka.transactional_id`` or ``STREAMPROC_INSTANCE_ID`` is set.

A blank ``kafka.transactional_id`` or ``STREAMPROC_INSTANCE_ID`` is refused.
``STREAMPROC_INSTANCE_ID`` equal to the host name gives slot 0's id: on one host, the processes
of a group use either slots or instance ids, not both.

Why slots: processes started from one config on one host must not share an id (the newest
fences the others: ``_FENCED``, exit 1), yet a process restarted after ``kill -9`` must reuse
its dead predecessor's id, so that its ``init_transactions`` aborts the transaction the dead one
left open at once. A fresh id per process would leave that transaction open until
``transaction.timeout.ms`` expires (60 s by default in librdkafka), and read_committed readers
of the output cannot read past it meanwhile. The kernel frees a dead process's socket name, so
its slot (and id) is the lowest free one again. Zombies of a *different* slot (a process that
lost its partitions but still runs) are fenced by the consumer group's generation instead
(KIP-447: ``send_offsets_to_transaction`` carries the consumer group metadata). See
docs/guarantees.md ("Exactly-once").
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import sys
from dataclasses import dataclass, field

from streamproc.config import Config
from streamproc.errors import ConfigError
from streamproc.logs import get_logger

log = get_logger(__name__)

MAX_SLOTS = 1024
"""Slots tried per consumer group and host before start-up fails."""

_AVOID_SLOTS = (
    "set kafka.transactional_id or STREAMPROC_INSTANCE_ID (unique per process, stable across "
    "its restarts)"
)


@dataclass
class TransactionalIdentity:
    """The ``transactional.id`` this process uses, and the slot socket that reserves it.

    Attributes:
        transactional_id: the id (``transactional.id``).
        slot: the host slot held, or None when the id came from config or
            ``$STREAMPROC_INSTANCE_ID``.
        socket_name: the slot's abstract socket name (leading NUL byte included), or None.
    """

    transactional_id: str
    slot: int | None = None
    socket_name: str | None = None
    _sock: socket.socket | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slot back (idempotent): call after the producer that uses the id is closed.
        A process that dies releases it too (the kernel frees its socket name)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def slot_socket_name(group_id: str, slot: int) -> str:
    """The abstract socket name of ``slot`` of consumer group ``group_id`` (a leading NUL byte,
    then ``streamproc-txn-<first 16 hex digits of sha256(group_id)>-<slot>``)."""
    digest = hashlib.sha256(group_id.encode()).hexdigest()[:16]
    return f"\0streamproc-txn-{digest}-{slot}"


def claim_transactional_id(config: Config, host: str | None = None) -> TransactionalIdentity:
    """Choose this process's ``transactional.id`` (see the module docstring).

    Args:
        config: the validated config (``kafka.transactional_id``, ``kafka.group_id``).
        host: the host name (default: :func:`socket.gethostname`).

    Raises:
        ConfigError: ``STREAMPROC_INSTANCE_ID`` set but blank; or a slot is needed and the
            platform has no abstract Unix sockets (not Linux), a slot socket cannot be bound
            for another reason than being held, or :data:`MAX_SLOTS` slots of the group are
            held; the message names ``kafka.transactional_id`` and ``STREAMPROC_INSTANCE_ID``,
            which avoid slots.
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
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"kafka.transactional_id: host slots need Linux abstract Unix sockets, which "
            f"{sys.platform!r} does not have; {_AVOID_SLOTS}"
        )
    host = host or socket.gethostname()
    for slot in range(MAX_SLOTS):
        name = slot_socket_name(group, slot)
        sock = _bind(name)
        if sock is None:
            continue
        suffix = "" if slot == 0 else f"-{slot}"
        identity = TransactionalIdentity(f"{group}-{host}{suffix}", slot, name, sock)
        log.info(
            "transactional id chosen",
            transactional_id=identity.transactional_id,
            slot=slot,
            socket="@" + name[1:],  # as ss -x and /proc/net/unix show an abstract name
        )
        return identity
    raise ConfigError(
        f"kafka.transactional_id: all {MAX_SLOTS} transactional id slots of group {group!r} on "
        f"this host are held; {_AVOID_SLOTS}"
    )


def _bind(name: str) -> socket.socket | None:
    """A datagram socket bound to the abstract ``name`` (not inherited by child processes), or
    None when another socket holds the name (EADDRINUSE).

    Raises:
        ConfigError: the socket cannot be made or bound for another reason.
    """
    sock: socket.socket | None = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(name)
    except OSError as exc:
        if sock is not None:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise ConfigError(
            f"kafka.transactional_id: the transactional id slot socket @{name[1:]} cannot be "
            f"bound ({exc.strerror or exc}); {_AVOID_SLOTS}"
        ) from exc
    return sock
