"""One ``streamproc run`` consumer process for a benchmark: started from a checkout with a config
written as JSON (YAML's superset), ready when its ``/readyz`` answers 200, stopped by SIGTERM (it
drains what is in flight). Shared by benchmarks/priority_isolation.py and benchmarks/overload.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def load_average() -> float:
    """The machine's 1-minute load average (the noise of a shared machine, printed per run)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Return once ``http://127.0.0.1:<port>/readyz`` answers 200.

    Raises:
        RuntimeError: the process exited first, or ``timeout_s`` seconds passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"consumer exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling an HTTP probe, not synchronisation between our threads
    raise RuntimeError(f"consumer not ready within {timeout_s:.0f} s")


@contextmanager
def consumer(
    config: dict[str, Any],
    checkout: Path,
    work: Path,
    name: str,
    ready_timeout_s: float = 300.0,
    stop_timeout_s: float = 120.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m streamproc run`` of ``checkout`` (``PYTHONPATH`` set to it) on ``config``
    (``metrics.port`` must be set: readiness is read there) for the ``with`` block, its output
    in ``work/<name>.log``; SIGTERM at the end (kill after ``stop_timeout_s`` seconds).

    Raises:
        RuntimeError: not ready within ``ready_timeout_s`` seconds (the log names why)."""
    config_path = work / f"{name}.json"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamproc", "run", "--config", str(config_path)],
            cwd=checkout,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_ready(int(config["metrics"]["port"]), proc, ready_timeout_s)
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
