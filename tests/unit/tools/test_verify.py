"""The verifier's at-least-once check: duplicates stay within the work since the last commit."""

from __future__ import annotations

from streamproc.output.headers import H_OFFSET, H_PARTITION, H_TOPIC
from streamproc.tools.verify import CommitSample, TopicDump, replayed_after_commit

TOPIC = "in"


def outputs(*copies: tuple[int, int, int]) -> TopicDump:
    """An output topic of one partition holding a result per (source partition, source
    offset, CreateTime ms), in the order given."""
    records = {
        (0, position): (
            None,
            b"r",
            {
                H_TOPIC: TOPIC.encode(),
                H_PARTITION: str(partition).encode(),
                H_OFFSET: str(offset).encode(),
            },
            ts,
        )
        for position, (partition, offset, ts) in enumerate(copies)
    }
    return TopicDump(records, {0: len(copies)})


COMMITS: list[CommitSample] = [(1_000.0, {0: 0, 1: 0}), (5_000.0, {0: 3, 1: 2})]


def test_a_rewind_to_the_last_commit_repeats_only_uncommitted_work() -> None:
    # offsets 0-4 of partition 0 produced, 3 committed at 5 s, then a rewind to 3 at 9 s
    dump = outputs(
        (0, 0, 2_000), (0, 1, 2_000), (0, 2, 3_000), (0, 3, 4_000), (0, 4, 4_000),
        (0, 3, 9_000), (0, 4, 9_000),
    )  # fmt: skip
    assert replayed_after_commit(dump, TOPIC, COMMITS) == []


def test_a_result_produced_again_after_its_offset_was_committed_is_reported() -> None:
    # offset 1 of partition 0 was committed (3 at 5 s) and produced again at 9 s: a rewind
    # beyond the last commit; partition 1's offset 1 was below its commit (2) as well
    dump = outputs((0, 1, 2_000), (1, 1, 2_000), (0, 1, 9_000), (1, 1, 9_000))
    assert replayed_after_commit(dump, TOPIC, COMMITS) == [(TOPIC, 0, 1), (TOPIC, 1, 1)]


def test_a_copy_is_judged_against_commits_older_than_the_margin() -> None:
    # the copy at 5.5 s is within 1 s of the sample at 5 s: judged against the one at 1 s
    dump = outputs((0, 1, 2_000), (0, 1, 5_500))
    assert replayed_after_commit(dump, TOPIC, COMMITS) == []
    assert replayed_after_commit(dump, TOPIC, COMMITS, margin_ms=100.0) == [(TOPIC, 0, 1)]


def test_other_topics_and_single_copies_are_not_duplicates() -> None:
    dump = outputs((0, 1, 2_000), (0, 2, 9_000))
    assert replayed_after_commit(dump, TOPIC, COMMITS) == []
    assert replayed_after_commit(dump, "other", COMMITS) == []
