"""Exactly-once: results, dead-letter records and input offsets in one Kafka transaction.

Used only with ``processing_guarantee: exactly_once``. The sink produces every record inside the
open transaction (beginning one on the first record); the source thread closes it every
``commit_interval_ms``, on revoke and on shutdown::

    send_offsets_to_transaction(watermarks, consumer group metadata) -> commit_transaction

Error handling follows the transactional producer's contract:

* retriable error (e.g. ``CONCURRENT_TRANSACTIONS``, ``COORDINATOR_LOAD_IN_PROGRESS``) from
  ``send_offsets_to_transaction`` or ``commit_transaction`` -> retry that call (bounded by
  ``max_attempts``);
* abortable error, a retriable one whose tries are spent (e.g. timeouts while brokers are down),
  or a record refused before sending for no fault of its own (:attr:`Transactions.must_abort`)
  -> ``abort_transaction`` (retried on a retriable error) and return False: the caller rewinds
  every assigned partition to its committed offset and drops work of the aborted generation;
* fatal error that says another instance owns the ``transactional.id`` (fenced: we are the
  zombie) or that it may not be used -> :class:`~streamproc.errors.FatalPipelineError`; this
  process stops, nobody else;
* any other fatal error (the producer's own state, e.g. ``INVALID_TXN_STATE`` when the
  transaction coordinator failed over during an abort), an abort that fails, or a call that
  never returns (wedged: still inside the client :data:`WEDGED_GRACE_S` after its own timeout)
  -> the producer is replaced by a fresh one with the same ``transactional.id``, whose
  ``init_transactions`` fences the old one and aborts its transaction; then as an abort.
  librdkafka 2.16 can wait forever for a group coordinator that is gone
  (``send_offsets_to_transaction``; confluentinc/librdkafka#5456 and #5511).

``transactional.id`` must be unique per process and stable across its restarts (e.g.
``<group>-<StatefulSet pod name>``, or a host slot: ``streamproc.offsets.identity``) so a
restarted instance fences its predecessor and aborts the predecessor's open transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import ProducerClient, ktp
from streamproc.logs import get_logger
from streamproc.offsets.outcomes import TransactionTally
from streamproc.records import TopicPartition

log = get_logger(__name__)

T = TypeVar("T")

# Seconds past a transactional call's own timeout after which it is judged wedged.
WEDGED_GRACE_S = 15.0
WEDGED = "wedged_call"  # the abort reason of a replaced producer (transaction_aborts_total)

# Fatal errors that say another instance owns the transactional.id (this one is the zombie) or
# that it may not be used: the pipeline stops. A fresh producer would fence the rightful owner.
_OWNERSHIP = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)


class WedgedCall(Exception):
    """A transactional call that did not return within its timeout plus the grace."""


def bounded(name: str, call: Callable[[], T], limit_s: float) -> T:
    """``call()`` on a daemon thread of its own; its result or exception.

    Raises:
        WedgedCall: ``call`` did not return within ``limit_s`` seconds (it goes on running;
            nothing waits for it, and the process can still exit).
    """
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        done.set()

    threading.Thread(target=run, name=f"txn-{name}", daemon=True).start()
    if not done.wait(limit_s):
        raise WedgedCall(f"{name} did not return in {limit_s:.0f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


class Transactions:
    """The transaction state of one transactional producer.

    Args:
        producer: a producer configured with ``transactional.id``.
        timeout_s: timeout of each transactional call, in seconds.
        max_attempts: tries of each transactional call on retriable errors.
        renew: replaces a wedged producer: returns a fresh one with the same settings (the
            caller keeps the wedged one alive: a thread is still inside it) and makes it the
            one that produces from now on. None: a wedged call stops the pipeline.
        grace_s: seconds past ``timeout_s`` after which a call is judged wedged.
    """

    def __init__(
        self,
        producer: ProducerClient,
        timeout_s: float = 30.0,
        max_attempts: int = 5,
        renew: Callable[[], ProducerClient] | None = None,
        grace_s: float = WEDGED_GRACE_S,
    ) -> None:
        self._producer = producer
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._renew = renew
        self._limit_s = timeout_s + grace_s
        self.renewals = 0
        # why the last abort replaced the producer, or the reason it was asked for
        self._reason: str | None = None
        # a fatal error the sink's poll raised (any thread sets it; the next commit acts)
        self.fatal_error: KafkaError | None = None
        self.lock = threading.RLock()
        self._ended = threading.Condition(self.lock)  # notified when a transaction ends
        self._open = False
        self.commits = 0
        self.aborts = 0
        self.abort_error: KafkaError | None = None  # why the last transaction aborted
        # records produced into transactions, by how each ended (the run's summary)
        self.tally = TransactionTally()
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

    @property
    def abort_reason(self) -> str:
        """Why the last transaction aborted: the error's name, :data:`WEDGED`, the reason given
        to :meth:`abandon`, or unknown."""
        if self._reason is not None:
            return self._reason
        return "unknown" if self.abort_error is None else self.abort_error.name()

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
            FatalPipelineError: fatal producer error (fenced zombie, unrecoverable state), or a
                wedged call whose producer could not be replaced.
        """
        with self.lock:
            fatal = self.fatal_error
            if fatal is not None:
                self._fatal(fatal)
                return False
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
            except WedgedCall as exc:
                self._replace(str(exc), WEDGED)
                return False
            self._open = False
            self.tally.ended(committed=True)
            self.commits += 1
            self._ended.notify_all()
            return True

    def wait_for_boundary(self, request_commit: Callable[[], None], timeout_s: float) -> bool:
        """Return once the transaction open now (if any) has ended, committed or aborted:
        what was produced before this call is in no transaction that later records join.
        ``request_commit`` asks the committer's thread to close it now rather than at its
        next interval.

        Returns:
            False when it was still open after ``timeout_s`` seconds.
        """
        with self.lock:
            if not self._open:
                return True
            seen = self.commits + self.aborts
        request_commit()
        with self._ended:
            return self._ended.wait_for(
                lambda: not self._open or self.commits + self.aborts > seen, timeout_s
            )

    def producer_error(self, err: KafkaError) -> None:
        """A fatal error the producer raised outside a transactional call (from ``poll``, on
        the sink's thread): nothing more is produced into the transaction, and the next
        :meth:`commit` replaces the producer (or stops, for an ownership error)."""
        self.failed = self.failed or err
        self.fatal_error = self.fatal_error or err

    def _retrying(self, name: str, call: Callable[[], None]) -> None:
        """``call()``, again on a retriable error, at most ``max_attempts`` times.

        Raises:
            WedgedCall: a try did not return in time (see :func:`bounded`).
        """
        for attempt in range(1, self._max_attempts + 1):
            try:
                bounded(name, call, self._limit_s)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or attempt == self._max_attempts:
                    raise
                log.warning(f"{name}: retriable error; retrying", attempt=attempt, error=err.str())

    def _handle(self, exc: KafkaException) -> bool:
        """A commit failed: replace a fatally failed producer, else abort (retries spent on a
        retriable error, e.g. a timeout while brokers are down, abort too)."""
        err = exc.args[0]
        if err.fatal():
            self._fatal(err)
        else:
            self._abort(err)
        return False

    def _fatal(self, err: KafkaError) -> None:
        """The producer failed fatally with ``err``: stop for an ownership error, else replace
        it (the caller holds the lock).

        Raises:
            FatalPipelineError: another instance fenced this one, or it may not use the id.
        """
        if err.code() in _OWNERSHIP:
            raise FatalPipelineError(
                f"transactional producer failed fatally ({err.str()}): another instance with "
                "the same transactional.id fenced this one, the broker aborted its transaction "
                "after transaction.timeout.ms (the process was stopped or stalled that long), "
                "or it may not use that id"
            ) from None
        self._replace(f"fatal producer error: {err.str()}", err.name())

    def _abort(self, err: KafkaError | None, reason: str | None = None) -> None:
        """Abort the open transaction because of ``err`` or, without one, ``reason`` (the
        caller holds the lock)."""
        why = reason if err is None else err.name()
        if err is not None:
            log.warning("aborting transaction", error=err.str(), code=err.name())
        try:
            self._retrying(
                "abort_transaction", lambda: self._producer.abort_transaction(self._timeout_s)
            )
        except WedgedCall as exc:
            self._replace(str(exc), WEDGED)
            return
        except KafkaException as exc:  # the abort failed: a fresh producer aborts for us
            failed = exc.args[0]
            if failed.fatal():
                self._fatal(failed)
            else:
                self._replace(f"abort failed: {failed.str()}", str(why))
            return
        self._open = False
        self.tally.ended(committed=False)
        self.failed = self.must_abort = None
        self.aborts += 1
        self._ended.notify_all()
        self.abort_error = err
        self._reason = reason

    def _replace(self, why: str, reason: str) -> None:
        """The producer cannot go on (``why``): take a fresh one whose ``init_transactions``
        fences the old one (its open transaction aborts); the transaction counts as aborted
        with ``reason`` (:attr:`abort_reason`). The caller holds the lock.

        Raises:
            FatalPipelineError: no ``renew`` was given, or the fresh producer failed too.
        """
        if self._renew is None:
            raise FatalPipelineError(f"transactional producer failed: {why}") from None
        log.error("replacing the transactional producer", error=why, renewals=self.renewals + 1)
        producer = self._renew()
        try:
            self._producer = producer
            self._retrying("init_transactions", lambda: producer.init_transactions(self._timeout_s))
        except (KafkaException, WedgedCall) as exc:
            raise FatalPipelineError(
                f"transactional producer failed ({why}) and its replacement failed: {exc}"
            ) from None
        self.renewals += 1
        self._open = False
        self.tally.ended(committed=False)
        self.failed = self.must_abort = self.fatal_error = None
        self.aborts += 1
        self._ended.notify_all()
        self.abort_error = None
        self._reason = reason

    def abandon(self, reason: str) -> bool:
        """Abort the open transaction on purpose (``reason``, e.g. its partitions were lost),
        as after a failed commit: retried, and a producer whose abort fails is replaced.

        Returns:
            False when no transaction was open.

        Raises:
            FatalPipelineError: the abort failed and the producer could not be replaced.
        """
        with self.lock:
            if not self._open:
                return False
            log.warning("aborting transaction", reason=reason)
            self._abort(None, reason)
            return True

    def abort(self) -> None:
        """Abort the open transaction, if any (the pipeline is stopping without a clean drain;
        a wedged abort is logged and left: the broker aborts the transaction at its timeout,
        or the next instance's ``init_transactions`` does)."""
        with self.lock:
            if not self._open:
                return
            producer = self._producer
            try:
                bounded(
                    "abort_transaction",
                    lambda: producer.abort_transaction(self._timeout_s),
                    self._limit_s,
                )
            except WedgedCall as exc:
                log.error("abort at stop never returned", error=str(exc))
            self._open = False
            self.tally.ended(committed=False)
            self.failed = self.must_abort = None
            self.aborts += 1
            self._ended.notify_all()
