"""The share source's ledger (pure): which records of the poll are outstanding, how each ends,
and the order suspects run in."""

from __future__ import annotations

from streamproc.records import Record, TopicPartition
from streamproc.share.ledger import PollLedger

TP = TopicPartition("in", 0)


def _record(offset: int, generation: int = 1) -> Record:
    return Record(TP, offset, None, b"v", (), 0, 0.0, generation)


def _run_all_alone(ledger: PollLedger) -> list[int]:
    ran = []
    while (record := ledger.next_alone()) is not None:
        alone = _record(record.offset, generation=100 + record.offset)
        ledger.started(alone)
        assert ledger.next_alone() is None  # one at a time
        assert ledger.done(alone) == "accept"
        ran.append(alone.offset)
    return ran


def test_suspects_alternate_their_order_with_the_delivery_count() -> None:
    # the records behind a poison record in one round run before it in the next
    even, odd = PollLedger(), PollLedger()
    even.wait_alone([(_record(o), 2) for o in (5, 3, 4)])
    odd.wait_alone([(_record(o), 3) for o in (5, 3, 4)])
    assert _run_all_alone(even) == [3, 4, 5]
    assert _run_all_alone(odd) == [5, 4, 3]
    assert not even and not odd


def test_a_valid_record_behind_a_poison_one_finishes_within_two_rounds() -> None:
    """Rounds of one poll of records 0-9 where 6 kills its member: each round runs the
    suspects alone in the ledger's order until the crash; what is left comes back with its
    delivery count one higher."""
    left, count, rounds = list(range(10)), 2, 0
    while left != [6]:
        ledger = PollLedger()
        ledger.wait_alone([(_record(o), count) for o in left])
        done = []
        while (record := ledger.next_alone()) is not None and record.offset != 6:
            ledger.started(record)
            assert ledger.done(record) == "accept"
            done.append(record.offset)
        left = [o for o in left if o not in done]
        count += 1
        rounds += 1
    assert rounds == 2 and count == 4  # valid records done by delivery 3; below the limit (>= 4)


def test_the_other_records_of_the_poll_come_before_any_suspect() -> None:
    ledger = PollLedger()
    ledger.add([_record(0), _record(1)])
    ledger.wait_alone([(_record(7), 2)])
    assert ledger.next_alone() is None
    assert ledger.done(_record(0)) == "accept" and ledger.next_alone() is None
    assert ledger.done(_record(1)) == "accept"
    assert ledger.next_alone() is not None


def test_an_ending_is_given_once_and_only_for_the_generation_that_runs() -> None:
    ledger = PollLedger()
    poison = _record(3)
    ledger.add([_record(1)])
    ledger.add_rejected(poison)
    assert ledger.done(_record(1, generation=2)) is None  # an earlier poll's record
    assert ledger.done(_record(1)) == "accept"
    assert ledger.done(_record(1)) is None  # reported twice
    assert ledger.done(poison) == "reject"
    assert len(ledger) == 0


def test_release_all_hands_back_every_outstanding_record_in_offset_order() -> None:
    ledger = PollLedger()
    ledger.add([_record(4), _record(2)])
    ledger.wait_alone([(_record(9), 2), (_record(1), 2)])
    assert ledger.release_all() == {TP: [1, 2, 4, 9]}
    assert not ledger and ledger.next_alone() is None
