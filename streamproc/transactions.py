"""Exactly-once: results, dead-letter records and input offsets in one Kafka transaction.

Used only with ``processing_guarantee: exactly_once``. The sink produces every record inside the
open transaction (beginning one on the first record); the source thread closes it every
``commit_interval_ms``, on revoke and on shutdown::

    send_offsets_to_transaction(watermarks, consumer group metadata) -> commit_transaction

Error handling follows the transactional producer's contract:

* retriable error (e.g. ``CONCURRENT_TRANSACTIONS``, ``COORDINATOR_LOAD_IN_PROGRESS``) from
  ``send_offsets_to_transaction`` or ``commit_transaction`` -> retry that call (bounded by
  ``max_attempts``);
* abortable error, or a record refused before sending for no fault of its own
  (:attr:`Transactions.must_abort`) -> ``abort_transaction`` (retried on a retriable error such
  as a timeout) and return False: the caller rewinds every assigned partition to its
  committed offset and drops work of the aborted generation;
* fatal error (e.g. fenced by a newer instance with the same ``transactional.id``: we are the
  zombie) -> :class:`~streamproc.errors.FatalPipelineError`; this process stops, nobody else.

``transactional.id`` must be stable per instance (e.g. ``<group>-<StatefulSet pod name>``) so a
restarted instance fences its predecessor and aborts the predecessor's open transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from streamproc.edges import ProducerClient, ktp
from streamproc.errors import FatalPipelineError
from streamproc.logs import get_logger
from streamproc.records import TopicPartition

log = get_logger(__name__)


class Transactions:
    """The transaction state of one transactional producer.

    Args:
        producer: a producer configured with ``transactional.id``.
        timeout_s: timeout of each transactional call, in seconds.
        max_attempts: tries of each transactional call on retriable errors.
    """

    def __init__(
        self, producer: ProducerClient, timeout_s: float = 30.0, max_attempts: int = 5
    ) -> None:
        self._producer = producer
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self.lock = threading.RLock()
        self._open = False
        self.commits = 0
        self.aborts = 0
        self.abort_error: KafkaError | None = None  # why the last transaction aborted
        # Set from delivery reports (any thread; one reference each, atomic under the GIL),
        # cleared when a transaction begins or aborts:
        # - failed: the first error that failed a delivery of the open transaction (librdkafka
        #   holds it in its abortable state and fails the commit); producing more into it is
        #   wasted, and records queued in it are not sent until the abort purges them;
        # - must_abort: a record the producer refused before sending for no fault of its own
        #   (librdkafka's transaction is fine): committing would leave a gap below results
        #   that commit, so the transaction is aborted instead.
        self.failed: KafkaError | None = None
        self.must_abort: KafkaError | None = None
        producer.init_transactions(timeout_s)  # fences older instances, aborts their txn

    def produce(self, produce: Callable[..., None], *args: Any) -> None:
        """Run ``produce`` inside the open transaction (beginning one if needed)."""
        with self.lock:
            self._begin()
            produce(*args)

    def produce_many(
        self, produce: Callable[[Sequence[int]], Sequence[int]], rows: Sequence[int]
    ) -> Sequence[int]:
        """Run ``produce(rows)`` inside the open transaction (beginning one if needed); return
        what it returns (the rows the producer refused)."""
        with self.lock:
            self._begin()
            return produce(rows)

    def _begin(self) -> None:
        """Begin a transaction unless one is open (the caller holds the lock)."""
        if not self._open:
            self._producer.begin_transaction()
            self._open = True
            self.failed = self.must_abort = None

    def commit(self, offsets: dict[TopicPartition, int], group_metadata: Any) -> bool:
        """Commit the open transaction with ``offsets``; False when it had to be aborted.

        Raises:
            FatalPipelineError: fatal producer error (fenced zombie, unrecoverable state).
        """
        with self.lock:
            if not self._open and not offsets:
                return True
            must_abort = self.must_abort
            if self._open and must_abort is not None:
                self._abort(must_abort)
                return False
            try:
                self._begin()
                if offsets:
                    positions = [ktp(tp, o) for tp, o in offsets.items()]
                    self._retrying(
                        "send_offsets_to_transaction",
                        lambda: self._producer.send_offsets_to_transaction(
                            positions, group_metadata, self._timeout_s
                        ),
                    )
                self._retrying(
                    "commit_transaction", lambda: self._producer.commit_transaction(self._timeout_s)
                )
            except KafkaException as exc:
                return self._handle(exc)
            self._open = False
            self.commits += 1
            return True

    def _retrying(self, name: str, call: Callable[[], None]) -> None:
        """``call()``, again on a retriable error, at most ``max_attempts`` times."""
        for attempt in range(1, self._max_attempts + 1):
            try:
                call()
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or attempt == self._max_attempts:
                    raise
                log.warning(f"{name}: retriable error; retrying", attempt=attempt, error=err.str())

    def _handle(self, exc: KafkaException) -> bool:
        err = exc.args[0]
        if err.fatal():
            raise FatalPipelineError(
                f"transactional producer failed fatally ({err.str()}); another instance with "
                "the same transactional.id may have fenced this one"
            ) from None
        if err.txn_requires_abort():
            self._abort(err)
            return False
        raise FatalPipelineError(f"transaction commit failed: {err.str()}") from None

    def _abort(self, err: KafkaError) -> None:
        """Abort the open transaction because of ``err`` (the caller holds the lock)."""
        log.warning("aborting transaction", error=err.str(), code=err.name())
        self._retrying(
            "abort_transaction", lambda: self._producer.abort_transaction(self._timeout_s)
        )
        self._open = False
        self.failed = self.must_abort = None
        self.aborts += 1
        self.abort_error = err

    def abort(self) -> None:
        """Abort the open transaction, if any (shutdown without a clean drain)."""
        with self.lock:
            if self._open:
                self._producer.abort_transaction(self._timeout_s)
                self._open = False
                self.failed = self.must_abort = None
                self.aborts += 1
