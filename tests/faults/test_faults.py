"""Faults of a replicated cluster under load, for both guarantees (`make test-faults`).

Every scenario: a paced replay of trades into 6 partitions (replication factor 3,
``min.insync.replicas`` 2), ``streamproc run`` consuming it as a real process, the fault injected
once results flow and healed while the replay still runs; then, from the broker: 0 missing,
nothing dead-lettered, committed == end, results in offset order per source partition, exit 0,
and under exactly-once (read_committed) 0 duplicates. At-least-once duplicates and the recovery
times are printed (``-s``) and summed up at the end of the session.

``FAULTS_SEED`` replays a random schedule; ``FAULTS_SCHEDULE_S`` sets its
length (default 600 s, a fault every 20-40 s).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamproc.tools.kafka_local import LocalCluster
from streamproc.tools.nemesis import Nemesis
from tests.faults.scenario import Scenario, check

# A scenario takes minutes on a loaded machine (start-up, the fault, recovery, the verdict).
pytestmark = [pytest.mark.faults, pytest.mark.timeout(1500)]

GUARANTEES = ("at_least_once", "exactly_once")
RATE = 40.0  # messages per second of the replay
SCHEDULE_RATE = 10.0  # the random schedule's replay (thousands of messages over its length)
WARMUP = 100  # results before the paced replay starts (the consumer is up)
LEAD_S = 5.0  # seconds of paced load before the fault


def scenario_for(
    cluster: LocalCluster,
    tmp_path: Path,
    name: str,
    guarantee: str,
    fault_s: float,
    rate: float = RATE,
) -> Scenario:
    """A scenario whose paced replay starts ``LEAD_S`` before a fault of ``fault_s`` seconds
    and lasts until :data:`LOAD_AFTER_HEAL_S` after the heal (at most ``records``: time enough
    for the slowest restart)."""
    records = WARMUP + int(rate * (LEAD_S + fault_s + 300))
    return Scenario(cluster, tmp_path, name, guarantee, records, rate)


@pytest.fixture
def scenarios() -> Iterator[list[Scenario]]:
    """Scenarios of the test; their consumers are stopped and waited for at teardown."""
    made: list[Scenario] = []
    yield made
    for scenario in made:
        scenario.stop()


def run_fault(
    cluster: LocalCluster,
    nemesis: Nemesis,
    scenarios: list[Scenario],
    tmp_path: Path,
    name: str,
    guarantee: str,
    fault: str,
    fault_s: float,
    victims: Callable[[Scenario, Nemesis], list[int]],
    before: Callable[[Scenario], None] | None = None,
) -> None:
    """Start the load, inject ``fault`` into ``victims`` for ``fault_s`` seconds, heal, check."""
    scenario = scenario_for(cluster, tmp_path, name, guarantee, fault_s)
    scenarios.append(scenario)
    scenario.start(WARMUP)
    scenario.wait_results(WARMUP + int(RATE * LEAD_S / 2))
    nodes = victims(scenario, nemesis)
    if before is not None:
        before(scenario)
    print(f"\n[{name} {guarantee}] {fault} node(s) {nodes} for {fault_s:.0f} s", flush=True)
    with nemesis.fault(fault, *nodes):
        time.sleep(fault_s)  # the fault's length, not synchronisation
    scenario.healed(f"{fault} {nodes}")
    check(scenario.finish())


def _two_down(s: Scenario, n: Nemesis) -> list[int]:
    leader = n.leader_of(s.topics.output, 0)
    return [leader, next(i for i in (1, 2, 3) if i != leader)]


@dataclass(frozen=True)
class Fault:
    """One scenario: ``fault`` injected into ``victims`` for ``fault_s`` seconds."""

    name: str
    fault: str
    fault_s: float
    victims: Callable[[Scenario, Nemesis], list[int]]
    before: Callable[[Scenario], None] | None = None
    guarantees: tuple[str, ...] = GUARANTEES


FAULTS = (
    Fault("input leader killed", "kill", 20, lambda s, n: [n.leader_of(s.topics.input, 0)]),
    Fault("output leader killed", "kill", 20, lambda s, n: [n.leader_of(s.topics.output, 0)]),
    Fault("output leader stalled", "pause", 30, lambda s, n: [n.leader_of(s.topics.output, 0)]),
    Fault("two brokers down", "kill", 60, _two_down),
    Fault("controller killed", "kill", 20, lambda s, n: [n.controller()]),
    # exactly-once only: at-least-once has no transaction (transactions are open all the time
    # while results flow: commit_interval_ms 200)
    Fault(
        "transaction coordinator killed",
        "kill",
        20,
        lambda s, n: [n.transaction_coordinator(s.transactional_id())],
        guarantees=("exactly_once",),
    ),
    # a second consumer joins (a rebalance) as the group's coordinator is killed
    Fault(
        "group coordinator killed",
        "kill",
        20,
        lambda s, n: [n.group_coordinator(s.topics.group)],
        before=lambda s: s.add_consumer("b"),
    ),
    # clients lose their route to the leader of an output partition; the brokers still reach
    # each other (replication has its own listener), so the leader stays leader
    Fault("cut off from leader", "cut", 30, lambda s, n: [n.leader_of(s.topics.output, 0)]),
)


@pytest.mark.parametrize(
    ("fault", "guarantee"),
    [
        pytest.param(f, g, id=f"{f.name.replace(' ', '_')}-{g}")
        for f in FAULTS
        for g in f.guarantees
    ],
)
def test_fault(
    cluster: LocalCluster,
    nemesis: Nemesis,
    scenarios: list[Scenario],
    tmp_path: Path,
    fault: Fault,
    guarantee: str,
) -> None:
    run_fault(
        cluster,
        nemesis,
        scenarios,
        tmp_path,
        fault.name,
        guarantee,
        fault.fault,
        fault.fault_s,
        fault.victims,
        fault.before,
    )


SCHEDULE_FAULTS = ("kill leader", "kill controller", "kill coordinator", "pause", "cut", "two down")


@pytest.mark.timeout(float(os.environ.get("FAULTS_SCHEDULE_S", "600")) + 1500)
@pytest.mark.parametrize("guarantee", GUARANTEES)
def test_random_schedule(
    cluster: LocalCluster,
    nemesis: Nemesis,
    scenarios: list[Scenario],
    tmp_path: Path,
    guarantee: str,
) -> None:
    """A seeded random fault every 20-40 s (lasting 5-15 s) for the schedule's length."""
    seed = int(os.environ.get("FAULTS_SEED") or random.randrange(1 << 31))
    length_s = float(os.environ.get("FAULTS_SCHEDULE_S", "600"))
    print(
        f"\n[random schedule {guarantee}] FAULTS_SEED={seed} FAULTS_SCHEDULE_S={length_s:.0f}",
        flush=True,
    )
    rng = random.Random(seed)
    scenario = scenario_for(
        cluster, tmp_path, "random schedule", guarantee, length_s, SCHEDULE_RATE
    )
    scenarios.append(scenario)
    scenario.start(WARMUP)
    end_s = time.monotonic() + length_s
    while time.monotonic() < end_s:
        interval_s, fault_s = rng.uniform(20, 40), rng.uniform(5, 15)
        kind = rng.choice(SCHEDULE_FAULTS)
        started_s = time.monotonic()
        fault, nodes = _schedule_fault(kind, scenario, nemesis, rng)
        print(
            f"[random schedule {guarantee}] {kind}: {fault} {nodes} for {fault_s:.0f} s", flush=True
        )
        with nemesis.fault(fault, *nodes):
            time.sleep(fault_s)  # the fault's length
        scenario.healed(f"{kind} {nodes}", window_s=max(1.0, interval_s - fault_s))
        rest_s = started_s + interval_s - time.monotonic()
        if rest_s > 0:
            time.sleep(rest_s)  # the schedule's pace
    check(scenario.finish())


def _schedule_fault(
    kind: str, scenario: Scenario, nemesis: Nemesis, rng: random.Random
) -> tuple[str, list[int]]:
    topic = rng.choice([scenario.topics.input, scenario.topics.output])
    leader = nemesis.leader_of(topic, rng.randrange(6))
    if kind == "kill leader":
        return "kill", [leader]
    if kind == "kill controller":
        return "kill", [nemesis.controller()]
    if kind == "kill coordinator":
        if scenario.guarantee == "exactly_once" and rng.random() < 0.5:
            return "kill", [nemesis.transaction_coordinator(scenario.transactional_id())]
        return "kill", [nemesis.group_coordinator(scenario.topics.group)]
    if kind == "two down":
        return "kill", [leader, rng.choice([i for i in (1, 2, 3) if i != leader])]
    return kind, [leader]
