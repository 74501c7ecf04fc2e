"""What one run did per pipeline, in numbers a user can check against the topics (the last
lines of ``streamproc run``, :attr:`streamproc.pipeline.RunSummary.outcomes`).

Reads and records that readers can see are counted apart from the work a rewind repeated:

* ``read``: records consumed, each read counted; ``read_again``: of those, records at an
  offset this process had read before (a transaction aborted and its partitions rewound, or
  a partition came back after a rebalance). ``read - read_again`` is the number of distinct
  input records this process read.
* ``results``, ``dead_lettered``: records readers can see. At-least-once: acknowledged by the
  broker. Exactly-once: produced in transactions that committed, what a read_committed reader
  of the output and dead-letter topics counts.
* ``uncommitted_results``, ``uncommitted_dead_letters`` (exactly-once): produced in
  transactions that aborted, or that were still open when the process stopped: in the topics'
  logs, never visible to read_committed readers.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from streamproc.metrics import Metrics

Kind = Literal["results", "dead_letters"]
"""What a record produced inside a transaction is: a result, or a dead-letter record."""


@dataclass(frozen=True)
class Produced:
    """Records produced for one pipeline's inputs (see the module docstring)."""

    results: int
    dead_lettered: int
    uncommitted_results: int = 0
    uncommitted_dead_letters: int = 0


@dataclass(frozen=True)
class RunCounts:
    """One pipeline's numbers for one run (see the module docstring)."""

    read: int
    read_again: int
    produced: Produced
    delivered_again: int = 0
    """Share groups: records acquired with a delivery count above 1 (delivered before to some
    member that did not acknowledge them; ``streamproc_share_redelivered_total``)."""

    def line(self, name: str, input_topic: str, output_topic: str, dlq_topic: str) -> str:
        """The summary line, e.g. ``p: 1000 consumed from in (800 again after a rewind), 198
        results to out, 2 dead-lettered to in.dlq (aborted transactions: 397 results, 0
        dead-lettered, invisible to read_committed readers)``."""
        produced = self.produced
        again = f" ({self.read_again} again after a rewind)" if self.read_again else ""
        if self.delivered_again:
            again += f" ({self.delivered_again} delivered again by the share group)"
        text = (
            f"{name}: {self.read} consumed from {input_topic}{again}, {produced.results} results "
            f"to {output_topic}, {produced.dead_lettered} dead-lettered to {dlq_topic}"
        )
        if produced.uncommitted_results or produced.uncommitted_dead_letters:
            text += (
                f" (aborted transactions: {produced.uncommitted_results} results, "
                f"{produced.uncommitted_dead_letters} dead-lettered, invisible to "
                "read_committed readers)"
            )
        return text


def dead_lettered(metrics: Metrics, input_topic: str) -> float:
    """Dead-letter records acknowledged for ``input_topic``'s inputs, every stage summed
    (``streamproc_messages_dead_lettered_total{topic=input_topic}``)."""
    (family,) = metrics.dead_lettered.collect()
    return sum(
        sample.value
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("topic") == input_topic
    )


class TransactionTally:
    """Records produced inside transactions, per input topic and :data:`Kind`, by how their
    transaction ended. Every method takes its own lock; :meth:`sent` and :meth:`ended` are
    called under the transaction lock (``offsets.transactions``), so a record counts in the
    transaction it joined."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[tuple[str, Kind]] = Counter()
        self._committed: Counter[tuple[str, Kind]] = Counter()
        self._uncommitted: Counter[tuple[str, Kind]] = Counter()

    def sent(self, input_topic: str, kind: Kind, count: int = 1) -> None:
        """``count`` records for inputs of ``input_topic`` joined the open transaction."""
        with self._lock:
            self._open[(input_topic, kind)] += count

    def ended(self, committed: bool) -> None:
        """The open transaction committed (True) or aborted (False)."""
        with self._lock:
            (self._committed if committed else self._uncommitted).update(self._open)
            self._open.clear()

    def produced(self, input_topic: str) -> Produced:
        """What was produced for ``input_topic``'s inputs; records of a transaction still open
        count as uncommitted."""
        with self._lock:
            committed, open_, aborted = self._committed, self._open, self._uncommitted
            return Produced(
                committed[(input_topic, "results")],
                committed[(input_topic, "dead_letters")],
                aborted[(input_topic, "results")] + open_[(input_topic, "results")],
                aborted[(input_topic, "dead_letters")] + open_[(input_topic, "dead_letters")],
            )
