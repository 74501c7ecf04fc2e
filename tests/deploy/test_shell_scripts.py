"""The deploy scripts: one shellcheck list, one shared library (deploy/lib.sh) and its helpers.

The library's functions run in a bash subprocess; no Docker, no cluster, no network.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT

LIB = ROOT / "deploy" / "lib.sh"
SHELLCHECK_LIST = ROOT / "deploy" / "shellcheck.sh"
LIB_FUNCTIONS = ("log", "die", "die_as", "quiet", "poll", "wait_until", "at_exit", "temp_dir")
# Scripts that run inside an image or a container, where deploy/lib.sh is not present.
IMAGE_SIDE = (
    "deploy/images/kafka/bin/",
    "deploy/images/registry/",
    "deploy/images/debian/",
    "deploy/compose/create-topics.sh",
)


@functools.cache
def listed_scripts() -> list[str]:
    result = subprocess.run(
        [str(SHELLCHECK_LIST), "--list"], capture_output=True, text=True, check=True
    )
    return result.stdout.split()


def first_line(path: Path) -> str:
    return path.read_bytes()[:200].decode(errors="replace").partition("\n")[0]


def bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run SCRIPT in bash (set -euo pipefail, LOG_PREFIX '[t]', deploy/lib.sh sourced)."""
    prelude = f"set -euo pipefail\nLOG_PREFIX='[t]'\nsource {LIB}\n"
    return subprocess.run(
        ["bash", "-c", prelude + script],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_every_shell_script_passes_shellcheck(tools: dict[str, str]) -> None:
    result = subprocess.run(
        [str(SHELLCHECK_LIST)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SHELLCHECK": tools["SHELLCHECK"]},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_one_shellcheck_list_covers_every_script() -> None:
    listed = set(listed_scripts())
    files = [
        p
        for folder in ("deploy", "benchmarks", "scripts")
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "wheels" not in p.relative_to(ROOT).parts
    ]
    shebang = re.compile(r"#!(/usr/bin/env )?(/bin/|/usr/bin/)?(ba)?sh( |$)")
    expected = {
        str(p.relative_to(ROOT)) for p in files if p.suffix == ".sh" or shebang.match(first_line(p))
    }
    assert listed == expected | {".ci/run"}
    assert {"benchmarks/gpu_check.sh", "benchmarks/gpu_dry_run.sh"} <= listed
    assert {"deploy/lib.sh", "deploy/images/kafka/bin/kafka-docker-run"} <= listed
    assert {"deploy/images/registry/registry-run", "scripts/generate_protos.sh"} <= listed


def test_every_check_uses_the_one_list() -> None:
    lint = (ROOT / "deploy" / "lint.sh").read_text()
    makefile = (ROOT / "Makefile").read_text()
    lint_lines = [line for line in lint.splitlines() if "SHELLCHECK" in line]
    assert lint_lines == ['SHELLCHECK="$SHELLCHECK" run deploy/shellcheck.sh']
    assert re.search(r"^shellcheck: tools\n\t.*deploy/shellcheck\.sh$", makefile, re.M)


@pytest.mark.parametrize("script", listed_scripts())
def test_script_parses(script: str) -> None:
    shell = "sh" if (ROOT / script).read_text().startswith("#!/bin/sh") else "bash"
    result = subprocess.run([shell, "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_deploy_scripts_share_the_library_instead_of_repeating_helpers() -> None:
    defines = re.compile(rf"^\s*(?:{'|'.join(LIB_FUNCTIONS)}|fail)\s*\(\)", re.M)
    for script in listed_scripts():
        if script == "deploy/lib.sh" or script.startswith(IMAGE_SIDE):
            continue
        text = (ROOT / script).read_text()
        assert not defines.search(text), f"{script} defines a helper of deploy/lib.sh again"
        if re.search(r"^\s*(log|die|die_as) ", text, re.M):
            assert re.search(r"^source .*lib\.sh\"?$", text, re.M), f"{script} lacks lib.sh"


def test_log_writes_the_prefix_to_stderr() -> None:
    result = bash('log "hello" world')
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "[t] hello world\n")


def test_die_and_die_as_exit_1_with_a_labelled_message() -> None:
    result = bash('die "no engine"; echo after')
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "[t] FAIL: no engine\n")
    result = bash('die_as MISSING "the compose plugin"')
    assert (result.returncode, result.stderr) == (1, "[t] MISSING: the compose plugin\n")


def test_quiet_discards_both_outputs_and_keeps_the_status() -> None:
    result = bash("quiet sh -c 'echo out; echo err >&2; exit 3' || echo status=$?")
    assert (result.stdout, result.stderr) == ("status=3\n", "")


def test_poll_retries_until_the_command_succeeds() -> None:
    script = """
    tries=0
    third() { tries=$((tries + 1)); echo "try $tries"; echo "stderr $tries" >&2; ((tries >= 3)); }
    WAIT_INTERVAL_S=0.01 poll 10 third
    echo "tries=$tries"
    """
    result = bash(script)
    assert result.returncode == 0, result.stderr
    # the command's stdout is discarded, its stderr kept
    assert (result.stdout, result.stderr) == ("tries=3\n", "stderr 1\nstderr 2\nstderr 3\n")


def test_poll_returns_1_at_the_timeout_without_exiting() -> None:
    result = bash("poll 0 false || echo timed-out")
    assert (result.returncode, result.stdout) == (0, "timed-out\n")


def test_wait_until_dies_naming_what_it_waited_for() -> None:
    result = bash('wait_until "the API server" 0 false; echo after')
    assert result.returncode == 1
    assert (result.stdout, result.stderr) == (
        "",
        "[t] FAIL: timed out after 0s waiting for the API server\n",
    )
    assert bash("wait_until ready 5 true; echo after").stdout == "after\n"


@pytest.mark.parametrize(
    ("ending", "status"), [("", 0), ("exit 4", 4), ("false", 1), ('die "boom"', 1)]
)
def test_at_exit_runs_the_actions_last_first_and_keeps_the_status(ending: str, status: int) -> None:
    result = bash(f'at_exit echo "first one"\nat_exit printf "%s\\n" second\n{ending}\necho end')
    assert result.returncode == status
    expected = ("end\n" if status == 0 else "") + "second\nfirst one\n"
    assert result.stdout == expected


def test_an_exit_action_may_change_the_status_and_runs_without_errexit() -> None:
    script = """
    cleanup() { false; echo "saw $EXIT_STATUS"; EXIT_STATUS=7; }
    at_exit cleanup
    exit 3
    """
    result = bash(script)
    assert (result.returncode, result.stdout) == (7, "saw 3\n")


def test_temp_dir_is_removed_at_exit(tmp_path: Path) -> None:
    result = bash(f'temp_dir d "{tmp_path}/x.XXXXXX"; touch "$d/file"; echo "$d"; test -d "$d"')
    created = Path(result.stdout.strip())
    assert result.returncode == 0 and created.parent == tmp_path
    assert not created.exists()


def test_go_caches_exports_the_go_settings() -> None:
    names = "GOMODCACHE|GOCACHE|GOFLAGS|GOTOOLCHAIN|CGO_ENABLED"
    result = bash(f'go_caches /c/go; env | grep -E "^({names})=" | sort')
    assert result.stdout.splitlines() == [
        "CGO_ENABLED=0",
        "GOCACHE=/c/go/build",
        "GOFLAGS=-modcacherw -buildvcs=false",
        "GOMODCACHE=/c/go/mod",
        "GOTOOLCHAIN=local",
    ]
