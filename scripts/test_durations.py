"""Where the test time goes: a pytest junit XML as two Markdown tables (stdlib only).

Usage::

    python scripts/test_durations.py .streamproc/junit.xml [--slowest 30] [--depth 2]

Prints (a) the ``--slowest`` N slowest tests (seconds, outcome, test id) and (b) the time per
folder (``--depth`` 2: ``tests/integration``) and per module (``tests/integration/test_x.py``),
each with its test count and share of the total, slowest first. A test's time is the junit
``time`` attribute: setup + call + teardown in seconds, so a module-scoped fixture's start-up is
counted in the first test that uses it. Exit status 2 when the file is missing or holds no test
case.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One test case of the junit XML: ``module`` a path like ``tests/unit/test_cli.py``."""

    module: str
    name: str
    time_s: float
    outcome: str  # passed | failed | error | skipped


def read_cases(path: Path) -> list[Case]:
    """Every ``testcase`` element of the junit XML at ``path``; raises ``ET.ParseError`` on a
    file that is not XML."""
    cases = []
    for element in ET.parse(path).getroot().iter("testcase"):
        classname = element.get("classname", "")
        # pytest writes classname "tests.unit.test_cli" (or "tests.unit.test_cli.TestClass")
        parts = classname.split(".")
        module_parts = parts
        for i in range(len(parts), 0, -1):
            if parts[i - 1].startswith("test_") or i == 1:
                module_parts = parts[:i]
                break
        module = "/".join(module_parts) + ".py"
        test_name = ".".join([*parts[len(module_parts) :], element.get("name", "")])
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if element.find(tag) is not None:
                outcome = "failed" if tag == "failure" else tag
        cases.append(Case(module, test_name, float(element.get("time", "0") or 0.0), outcome))
    return cases


def slowest_table(cases: list[Case], count: int) -> str:
    """A Markdown table of the ``count`` slowest cases, slowest first."""
    rows = ["| # | s | outcome | test |", "|---:|---:|---|---|"]
    ranked = sorted(cases, key=lambda c: c.time_s, reverse=True)[:count]
    for rank, case in enumerate(ranked, 1):
        rows.append(
            f"| {rank} | {case.time_s:,.1f} | {case.outcome} | `{case.module}::{case.name}` |"
        )
    return "\n".join(rows)


def grouped_table(cases: list[Case], key: str, depth: int) -> str:
    """A Markdown table of the time per folder (``key`` "folder", the first ``depth`` parts of
    the path) or per module (``key`` "module"), slowest first, with a total row."""
    total_s = sum(c.time_s for c in cases) or 1.0
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in cases:
        group = case.module if key == "module" else "/".join(case.module.split("/")[:depth])
        times[group] += case.time_s
        counts[group] += 1
    rows = [f"| {key} | tests | s | share |", "|---|---:|---:|---:|"]
    for group, time_s in sorted(times.items(), key=lambda kv: kv[1], reverse=True):
        rows.append(f"| `{group}` | {counts[group]} | {time_s:,.1f} | {time_s / total_s:.0%} |")
    rows.append(f"| total | {len(cases)} | {sum(times.values()):,.1f} | 100% |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--slowest", type=int, default=30, help="how many slowest tests (30)")
    parser.add_argument("--depth", type=int, default=2, help="folder depth of the per-folder table")
    parser.add_argument(
        "--modules", action="store_true", help="add the per-module table (per folder only else)"
    )
    args = parser.parse_args(argv)
    if not args.junit_xml.is_file():  # pytest stopped before writing it (a collection error)
        print(f"{args.junit_xml}: no such file", file=sys.stderr)
        return 2
    cases = read_cases(args.junit_xml)
    if not cases:
        print(f"{args.junit_xml}: no test case", file=sys.stderr)
        return 2
    print(f"### The {min(args.slowest, len(cases))} slowest tests\n")
    print(slowest_table(cases, args.slowest))
    print("\n### Time per folder\n")
    print(grouped_table(cases, "folder", args.depth))
    if args.modules:
        print("\n### Time per module\n")
        print(grouped_table(cases, "module", args.depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
