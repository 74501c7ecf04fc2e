"""What both intakes share: the one thread that owns a consumer (a consumer group's
:class:`~streamproc.intake.source.Source` or a share group's
:class:`~streamproc.share.source.ShareSource`), its control queue, its liveness readings and
its lifecycle, and how a message that carries an error is judged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from streamproc.intake.source_control import SourceControl
from streamproc.kafka.protocols import MessageLike
from streamproc.logs import get_logger

log = get_logger(__name__)


def message_error(message: MessageLike) -> None:
    """Judge a message that carries an error instead of a record: the end of a partition is
    nothing, a fatal error stops the intake, any other is logged.

    Raises:
        KafkaException: the error is fatal.
    """
    err = message.error()
    assert err is not None
    if err.code() == KafkaError._PARTITION_EOF:
        return
    if err.fatal():
        raise KafkaException(err)
    log.warning("consumer error", error=str(err))


class SourceThread:
    """The thread that owns a consumer (named ``source``): subclasses build ``_consumer``
    and implement :meth:`subscribe`, :meth:`poll_until` and :meth:`_finish`.

    Args:
        clock: monotonic clock in seconds.
        on_fatal: called when the poll loop raises.
        control: its control queue (default: its own).
    """

    _consumer: Any

    def __init__(
        self,
        clock: Callable[[], float],
        on_fatal: Callable[[BaseException], None],
        control: SourceControl | None,
    ) -> None:
        self._clock = clock
        self._on_fatal = on_fatal
        self.control = control or SourceControl()
        self._control = self.control.queue
        self._stop = threading.Event()
        self._last_poll_s = clock()
        self._last_input_s = clock()
        self._thread = threading.Thread(target=self._run, name="source", daemon=True)

    # -- read from any thread (written by the source thread only) ------------------------
    @property
    def last_poll_s(self) -> float:
        """Monotonic seconds of the last turn of the poll loop (liveness)."""
        return self._last_poll_s

    @property
    def last_input_s(self) -> float:
        """Monotonic seconds when the last record was accepted into a ring."""
        return self._last_input_s

    # -- control from other threads --------------------------------------------------------
    def subscribe(self) -> None:
        """Join the group on the lanes' input topics."""
        raise NotImplementedError

    def start(self) -> None:
        """Subscribe and start the source thread."""
        self.subscribe()
        self._thread.start()

    def stop_fetching(self) -> None:
        """Take no further record (:meth:`SourceControl.stop_fetching`); the group membership
        and what was taken already go on."""
        self.control.stop_fetching()

    def close(self, timeout_s: float) -> None:
        """Stop the poll loop and join the thread (its :meth:`_finish` closes the consumer);
        a source never started just closes its consumer."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        else:  # never started
            with contextlib.suppress(Exception):
                self._consumer.close()

    # -- the source thread -----------------------------------------------------------------
    def poll_until(self, done: Callable[[], bool]) -> None:
        """The poll loop, until ``done()`` (the thread runs it until :meth:`close`; unit tests
        run it on their own thread with a fake consumer)."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self.poll_until(self._stop.is_set)
        except BaseException as exc:
            self._on_fatal(exc)
        finally:
            self._finish()

    def _finish(self) -> None:
        """The last steps on the source thread (each step's failure suppressed), ending with
        the consumer's close."""
        raise NotImplementedError
