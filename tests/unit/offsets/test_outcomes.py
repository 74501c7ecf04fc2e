"""The summary line of one pipeline: reads again and records of aborted transactions apart."""

from __future__ import annotations

from streamproc.offsets.outcomes import Produced, RunCounts, TransactionTally


def test_the_line_of_a_run_without_rewinds_is_as_before() -> None:
    outcome = RunCounts(2, 0, Produced(results=1, dead_lettered=1))
    assert outcome.line("p", "in", "out", "in.dlq") == (
        "p: 2 consumed from in, 1 results to out, 1 dead-lettered to in.dlq"
    )


def test_the_line_of_a_run_that_aborted_and_rewound_separates_what_readers_see() -> None:
    outcome = RunCounts(1000, 800, Produced(198, 2, uncommitted_results=397))
    assert outcome.line("p", "in", "out", "in.dlq") == (
        "p: 1000 consumed from in (800 again after a rewind), 198 results to out, "
        "2 dead-lettered to in.dlq (aborted transactions: 397 results, 0 dead-lettered, "
        "invisible to read_committed readers)"
    )


def test_the_line_of_a_share_member_counts_what_the_group_delivered_again() -> None:
    outcome = RunCounts(120, 0, Produced(120, 0), delivered_again=7)
    assert outcome.line("p", "in", "out", "in.dlq") == (
        "p: 120 consumed from in (7 delivered again by the share group), 120 results to out, "
        "0 dead-lettered to in.dlq"
    )


def test_a_tally_moves_the_open_transaction_by_how_it_ended() -> None:
    tally = TransactionTally()
    tally.sent("in", "results", 3)
    tally.sent("in", "dead_letters")
    tally.ended(committed=False)
    tally.sent("in", "results", 4)
    assert tally.produced("in") == Produced(0, 0, 7, 1)  # the open one is not visible yet
    tally.ended(committed=True)
    tally.ended(committed=False)  # nothing open: nothing moves
    assert tally.produced("in") == Produced(4, 0, 3, 1)
    assert tally.produced("other") == Produced(0, 0)
