"""One fault scenario under load: a paced replay into the cluster, ``streamproc run`` as a real
process consuming it, faults injected and healed while both run, then the verdict from the
broker (``streamproc.tools.verify``) and the recovery times.

Recovery times, measured from the moment a fault is healed:

* ``first_result_s``: until the output topic grows again (the first new result);
* ``caught_up_s``: until the group's committed offsets equal the input's end offsets (after the
  replay has finished).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from streamproc.kafka.admin import ensure_topics
from streamproc.kafka.transient import read_committed
from streamproc.logs import kafka_logger
from streamproc.output.headers import H_OFFSET, H_PARTITION
from streamproc.tools.kafka_local import LocalCluster
from streamproc.tools.replay import produce
from streamproc.tools.verify import (
    CommitSample,
    TopicDump,
    Verdict,
    committed_offsets,
    read_topic,
    replayed_after_commit,
    verify,
)
from tests.integration.conftest import Topics, end_offset_total, start_consumer, write_config

PARTITIONS = 6
CAUGHT_UP_TIMEOUT_S = 420.0
COMMIT_SAMPLE_S = 0.5  # how often the group's committed offsets are sampled
LOAD_AFTER_HEAL_S = 15.0  # the replay goes on this long after the last heal
RESULTS: list[str] = []  # one line per scenario, printed at the end of the session


@dataclass
class Recovery:
    """Recovery after one healed fault (seconds; None: not observed)."""

    fault: str
    first_result_s: float | None = None


@dataclass
class Outcome:
    name: str
    guarantee: str
    verdict: Verdict
    out_of_order: list[str]
    exit_codes: list[int]
    recoveries: list[Recovery]
    caught_up_s: float | None
    elapsed_s: float
    beyond_commit: list[tuple[str, int, int]]  # results produced again after their commit
    aborts: int = 0  # transactions aborted (exactly-once), from the consumers' logs
    renewals: int = 0  # transactional producers replaced, from the consumers' logs

    def line(self) -> str:
        firsts = [r.first_result_s for r in self.recoveries if r.first_result_s is not None]
        first = f"{max(firsts):.1f}" if firsts else "n/a"
        caught = f"{self.caught_up_s:.1f}" if self.caught_up_s is not None else "n/a"
        v = self.verdict
        return (
            f"[{self.name} {self.guarantee}] inputs={v.inputs} results={v.results} "
            f"dead={v.dead_lettered} missing={len(v.missing)} duplicates={v.duplicates} "
            f"duplicates_after_commit={len(self.beyond_commit)} "
            f"committed==end={v.committed_equals_end} stable={v.output_stable} "
            f"out_of_order={len(self.out_of_order)} exit={self.exit_codes} "
            f"heal->first_result_s={first} heal->committed==end_s={caught} "
            f"faults={len(self.recoveries)} aborts={self.aborts} renewals={self.renewals} "
            f"elapsed_s={self.elapsed_s:.0f}"
        )


@dataclass
class Scenario:
    """Topics, replay and consumers of one scenario on ``cluster``.

    Args:
        records: the most messages the replay sends (trades), ``rate`` per second; it runs
            through the faults and ends :data:`LOAD_AFTER_HEAL_S` after the last heal
            (:meth:`end_load`).
    """

    cluster: LocalCluster
    tmp_path: Path
    name: str
    guarantee: str
    records: int
    rate: float
    topics: Topics = field(init=False)
    consumers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    _replay: threading.Thread | None = None
    _replay_error: list[BaseException] = field(default_factory=list)
    _stop_replay: threading.Event = field(default_factory=threading.Event)
    _stop_sampling: threading.Event = field(default_factory=threading.Event)
    _started_s: float = 0.0
    _last_heal_s: float | None = None
    _commits: list[CommitSample] = field(default_factory=list)
    _sampler: threading.Thread | None = None

    def __post_init__(self) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.topics = Topics(f"in.{suffix}", f"out.{suffix}", f"in.{suffix}.dlq", f"g-{suffix}")

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers

    def transactional_id(self, instance: str = "a") -> str:
        """The transactional id of consumer ``instance`` (``<group>-<instance>``)."""
        return f"{self.topics.group}-{instance}"

    # -- load ------------------------------------------------------------------------------
    def start(self, warmup: int = 100) -> None:
        """Create the topics (replication factor 3), start one consumer, replay ``warmup``
        messages at once and wait for their results (the consumer is up), then start the paced
        replay of the rest in the background."""
        self._started_s = time.monotonic()
        t = self.topics
        ensure_topics(self.bootstrap, {t.input: PARTITIONS, t.output: PARTITIONS, t.dlq: 1})
        self._sampler = threading.Thread(target=self._sample_commits, name="commits", daemon=True)
        self._sampler.start()
        self.add_consumer("a")
        produce("trades", t.input, self.bootstrap, PARTITIONS, limit=warmup, progress=False)
        self.wait_results(warmup)
        self._replay = threading.Thread(
            target=self._run_replay, args=(self.records - warmup,), name="replay", daemon=True
        )
        self._replay.start()
        self._wait_replay_running(warmup)

    def _wait_replay_running(self, warmup: int, timeout_s: float = 120.0) -> None:
        """Wait until the paced replay wrote past the warm-up: its set-up (metadata, topic
        check) is done before any fault can hit it (a schedule's first fault came while the
        replay's metadata request was in flight, and the replay gave up after 30 s)."""
        deadline_s = time.monotonic() + timeout_s
        while end_offset_total(self.bootstrap, self.topics.input) <= warmup:
            assert not self._replay_error, f"{self.name}: replay failed: {self._replay_error[0]}"
            assert self._replay is not None and self._replay.is_alive(), (
                f"{self.name}: the replay ended before it sent anything"
            )
            assert time.monotonic() < deadline_s, f"{self.name}: the replay did not start"
            time.sleep(0.2)

    def _run_replay(self, count: int) -> None:
        try:
            produce(
                "trades",
                self.topics.input,
                self.bootstrap,
                PARTITIONS,
                limit=count,
                rate=self.rate,
                progress=False,
                flush_timeout_s=CAUGHT_UP_TIMEOUT_S,
                stop=self._stop_replay,
            )
        except BaseException as exc:  # reported by finish()
            self._replay_error.append(exc)

    def add_consumer(self, instance: str) -> None:
        """Start ``streamproc run`` (instance id ``instance``) on the scenario's topics."""
        config = write_config(
            self.tmp_path / f"{instance}.yaml",
            self.bootstrap,
            self.topics,
            processing_guarantee=self.guarantee,
        )
        log = self.tmp_path / f"consumer-{instance}.log"
        self.consumers.append(
            start_consumer(config, log, idle_s=None, env={"STREAMPROC_INSTANCE_ID": instance})
        )

    def results(self) -> int | None:
        """Records in the output topic now (None when the cluster did not answer)."""
        with contextlib.suppress(Exception):
            return end_offset_total(self.bootstrap, self.topics.output)
        return None

    def wait_results(self, count: int, timeout_s: float = 240.0) -> None:
        """Wait until the output holds ``count`` records (the fault then hits a running job)."""
        deadline_s = time.monotonic() + timeout_s
        while (self.results() or 0) < count:
            self._check_consumers()
            if time.monotonic() > deadline_s:
                raise AssertionError(f"{self.name}: {count} results not reached in {timeout_s} s")
            time.sleep(0.5)

    def _check_consumers(self) -> None:
        for consumer in self.consumers:
            code = consumer.poll()
            assert code is None, f"{self.name}: streamproc exited with {code} during the run"

    def _sample_commits(self) -> None:
        """Record the group's committed offsets every :data:`COMMIT_SAMPLE_S` seconds until
        the load ends (a sample the cluster does not answer is skipped); the at-least-once
        check (:func:`replayed_after_commit`) judges every duplicate against them."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": self.topics.group,
                "enable.auto.commit": False,
                "logger": kafka_logger(),
            }
        )
        wanted = [TopicPartition(self.topics.input, p) for p in range(PARTITIONS)]
        try:
            while not self._stop_sampling.wait(COMMIT_SAMPLE_S):
                with contextlib.suppress(KafkaException):
                    got = read_committed(consumer, wanted, 5)
                    offsets = {tp.partition: tp.offset for tp in got}
                    self._commits.append((time.time() * 1000.0, offsets))
        finally:
            consumer.close()

    def _end_sampling(self) -> None:
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join(60)

    # -- recovery --------------------------------------------------------------------------
    def healed(self, fault: str, window_s: float = 120.0) -> Recovery:
        """Call right after healing ``fault``: measure the time to the first new result (at
        most ``window_s`` seconds; None when no input was left to process)."""
        healed_s = time.monotonic()
        self._last_heal_s = healed_s
        recovery = Recovery(fault)
        self.recoveries.append(recovery)
        base = self.results()
        while time.monotonic() - healed_s < window_s:
            now = self.results()
            if base is None:
                base = now
            elif now is not None and now > base:
                recovery.first_result_s = time.monotonic() - healed_s
                break
            if self._all_done():
                break
            self._check_consumers()
            time.sleep(0.2)
        print(
            f"[{self.name} {self.guarantee}] healed {fault}: first new result after "
            f"{recovery.first_result_s} s",
            flush=True,
        )
        return recovery

    def _all_done(self) -> bool:
        """The replay is over and every input is committed."""
        if self._replay is not None and self._replay.is_alive():
            return False
        with contextlib.suppress(Exception):
            ends = self._input_ends()
            committed = committed_offsets(
                self.bootstrap, self.topics.group, self.topics.input, sorted(ends)
            )
            return all(committed.get(p, -1) == end for p, end in ends.items() if end > 0)
        return False

    def _input_ends(self) -> dict[int, int]:
        dump_ends: dict[int, int] = {}
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "probe"})
        try:
            for p in range(PARTITIONS):
                tp = TopicPartition(self.topics.input, p)
                dump_ends[p] = consumer.get_watermark_offsets(tp, timeout=10)[1]
        finally:
            consumer.close()
        return dump_ends

    def end_load(self) -> None:
        """End the replay :data:`LOAD_AFTER_HEAL_S` seconds after the last heal."""
        if self._last_heal_s is not None:
            rest_s = self._last_heal_s + LOAD_AFTER_HEAL_S - time.monotonic()
            if rest_s > 0:
                time.sleep(rest_s)  # load after the fault, not synchronisation
        self._stop_replay.set()

    # -- verdict ---------------------------------------------------------------------------
    def finish(self) -> Outcome:
        """Wait for the replay and for committed == end, stop the consumers (SIGTERM), verify
        from the broker and check the order of results per source partition."""
        assert self._replay is not None
        self.end_load()
        self._replay.join(CAUGHT_UP_TIMEOUT_S)
        assert not self._replay.is_alive(), f"{self.name}: the replay did not finish"
        assert not self._replay_error, f"{self.name}: replay failed: {self._replay_error[0]}"
        deadline_s = time.monotonic() + CAUGHT_UP_TIMEOUT_S
        while not self._all_done():
            self._check_consumers()
            assert time.monotonic() < deadline_s, f"{self.name}: committed != end in time"
            time.sleep(0.5)
        caught_up = time.monotonic() - self._last_heal_s if self._last_heal_s else None
        codes = []
        for consumer in self.consumers:
            consumer.send_signal(signal.SIGTERM)
        for consumer in self.consumers:
            try:
                codes.append(consumer.wait(120))
            except subprocess.TimeoutExpired:
                # it did not stop: its threads' stacks to its log (faulthandler), then kill it
                consumer.send_signal(signal.SIGUSR1)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    consumer.wait(5)
                consumer.kill()
                codes.append(consumer.wait())
        self._end_sampling()
        t = self.topics
        outputs = read_topic(self.bootstrap, t.output)
        verdict = verify(self.bootstrap, t.input, t.output, t.dlq, t.group, outputs=outputs)
        outcome = Outcome(
            self.name,
            self.guarantee,
            verdict,
            out_of_order(outputs, t.output),
            codes,
            self.recoveries,
            caught_up,
            time.monotonic() - self._started_s,
            replayed_after_commit(outputs, t.input, self._commits),
            *self._log_counts(),
        )
        RESULTS.append(outcome.line())
        print("\n" + outcome.line(), flush=True)
        return outcome

    def _log_counts(self) -> tuple[int, int]:
        """Aborted transactions and replaced producers, counted in the consumers' logs."""
        aborts = renewals = 0
        for log in self.tmp_path.glob("consumer-*.log"):
            text = log.read_text(errors="replace")
            aborts += text.count('"event": "aborting transaction"')
            renewals += text.count('"event": "replacing the transactional producer"')
        return aborts, renewals

    def stop(self) -> None:
        """Kill whatever consumer still runs (teardown after a failure) and wait for it."""
        for consumer in self.consumers:
            if consumer.poll() is None:
                consumer.kill()
            consumer.wait(60)
        self._stop_replay.set()
        self._end_sampling()
        if self._replay is not None:
            self._replay.join(CAUGHT_UP_TIMEOUT_S)


def out_of_order(dump: TopicDump, output_topic: str) -> list[str]:
    """Results whose source offset is not above every earlier new source offset of the same
    source partition in the same output partition (a result delivered again after a rewind is
    not new and does not count). Empty when every partition's results are in offset order."""
    highest: dict[tuple[int, int], int] = defaultdict(lambda: -1)
    seen: set[tuple[int, int]] = set()
    wrong: list[str] = []
    for (out_partition, out_offset), (_, _, headers, _) in sorted(dump.records.items()):
        source = (int(headers[H_PARTITION]), int(headers[H_OFFSET]))
        if source in seen:
            continue
        seen.add(source)
        key = (out_partition, source[0])
        if source[1] < highest[key]:
            wrong.append(f"{output_topic}[{out_partition}]@{out_offset}: source {source}")
        highest[key] = max(highest[key], source[1])
    return wrong


def check(outcome: Outcome) -> None:
    """The guarantees every scenario keeps (see docs/guarantees.md, "Faults")."""
    v = outcome.verdict
    name = f"{outcome.name} {outcome.guarantee}"
    assert outcome.exit_codes and all(c == 0 for c in outcome.exit_codes), (
        f"{name}: streamproc exited {outcome.exit_codes}"
    )
    assert not v.missing, f"{name}: {len(v.missing)} missing, e.g. {v.missing[:3]}"
    assert v.dead_lettered == 0, f"{name}: {v.dead_lettered} valid records dead-lettered"
    assert v.committed_equals_end, f"{name}: committed {v.committed} != end {v.end_offsets}"
    assert not outcome.out_of_order, f"{name}: out of order: {outcome.out_of_order[:3]}"
    # at-least-once duplicates are work a rewind to the last commit repeats, never more
    assert not outcome.beyond_commit, (
        f"{name}: {len(outcome.beyond_commit)} results produced again after their offset was "
        f"committed, e.g. {outcome.beyond_commit[:3]}"
    )
    if outcome.guarantee == "exactly_once":
        assert v.output_stable, f"{name}: a transaction was left open"
        assert v.duplicates == 0, f"{name}: {v.duplicates} duplicates under exactly-once"
