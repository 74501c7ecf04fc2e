"""A local MLflow tracking server with a model registry, for tests, the demo and development.

The server is a tool, not a product dependency: ``mlflow==MLFLOW_VERSION`` (the full package,
with its SQL store and server) is installed once into its own virtual environment under the
cache folder (``mlflow-server-<version>-py3.11``); the product itself only needs the client,
``mlflow-skinny`` of the same version. The server keeps its runs and registered models in SQLite
(``<dir>/mlflow.db``) and its artifacts under ``<dir>/artifacts``, which it serves itself
(clients upload and download through the server: ``mlflow-artifacts:/``), and listens on
127.0.0.1 only. Telemetry and the job runner are off (:data:`SERVER_ENV`).

Lifecycle of one :class:`LocalMlflow`::

    env = ensure_mlflow_server()          # venv + pip install mlflow, cached
    server = LocalMlflow(run_dir, env)
    server.start()                        # spawn `mlflow server` on 127.0.0.1, wait for /health
    server.tracking_uri                   # "http://127.0.0.1:PORT"
    server.stop()                         # SIGTERM to the group, SIGKILL after a deadline

As with the local registry, ``own_lifetime=True`` (tests, demo) kills the server with the
thread that started it; ``streamproc mlflow start`` passes ``own_lifetime=False`` and records
the pid in ``<dir>/mlflow.pid`` for ``streamproc mlflow stop``. The database and artifacts
survive a stop: a server started again on the same folder serves the same models.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import (
    _die_with_parent,
    cache_dir,
    free_port,
    read_pid,
    terminate_pid,
)

MLFLOW_VERSION = "3.17.2"
MARKER = ".streamproc-mlflow"
PYTHON = "python3.11"
# The server's environment: no usage telemetry (no traffic beyond loopback), and no job runner
# (a huey consumer per job queue, ~300 MB, for GenAI jobs a model registry never starts).
SERVER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


def ensure_mlflow_server(root: Path | None = None) -> Path:
    """Install ``mlflow==MLFLOW_VERSION`` into its own virtual environment once; return it.

    Built in ``<name>.partial`` and renamed when complete, so an interrupted install is never
    used. The server is always run as ``<env>/bin/python -m mlflow`` (the scripts in ``bin/``
    keep the ``.partial`` path in their first line).

    Raises:
        BrokerError: ``python3.11`` is missing, or the install failed (pip's output included).
    """
    env = (root or cache_dir()) / f"mlflow-server-{MLFLOW_VERSION}-py3.11"
    marker = env / ".complete"
    if marker.exists():
        return env
    python = sys.executable if sys.version_info[:2] == (3, 11) else shutil.which(PYTHON)
    if python is None:
        raise BrokerError(f"`{PYTHON}` not found on PATH: the local MLflow server needs it")
    staging = env.parent / f"{env.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    for step in (
        [python, "-m", "venv", str(staging)],
        [str(staging / "bin" / "python"), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", f"mlflow=={MLFLOW_VERSION}"],
    ):  # fmt: skip
        proc = subprocess.run(step, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BrokerError(
                f"could not install mlflow=={MLFLOW_VERSION} into {staging} "
                f"(`{' '.join(step[:4])}` exit {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
    shutil.rmtree(env, ignore_errors=True)
    staging.rename(env)
    marker.write_text(f"mlflow=={MLFLOW_VERSION}\n")
    return env


@dataclass
class LocalMlflow:
    """One MLflow tracking server on 127.0.0.1: SQLite backend store, proxied artifacts.

    Args:
        run_dir: folder for the database (``mlflow.db``), the artifacts (``artifacts/``), the log
            (``mlflow.log``) and the pid file; a non-empty folder that streamproc did not create
            is refused (BrokerError), so user files are never touched.
        env: the virtual environment from :func:`ensure_mlflow_server`.
        own_lifetime: kill the server when the starting thread dies (tests, demo).
    """

    run_dir: Path
    env: Path
    own_lifetime: bool = True
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def tracking_uri(self) -> str:
        """``http://127.0.0.1:PORT``: what ``MLFLOW_TRACKING_URI`` takes."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while this object started it, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "mlflow.pid"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "mlflow.log"

    @property
    def running(self) -> bool:
        """True while the server process started by this object runs."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the server on a free loopback port and wait until ``/health`` answers.

        Returns:
            :attr:`tracking_uri`.

        Raises:
            BrokerError: the process exited, or did not answer within ``timeout_s`` seconds
                (the message holds the end of the log).
        """
        self._claim_run_dir()
        self.port = self.port or free_port()
        self.spawn()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.tracking_uri

    def spawn(self) -> None:
        """Start ``mlflow server`` (does not wait)."""
        store = self.run_dir / "mlflow.db"
        args = [
            str(self.env / "bin" / "python"), "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{store}",
            "--artifacts-destination", str(self.run_dir / "artifacts"),
            "--serve-artifacts",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--allowed-hosts", f"127.0.0.1:{self.port},localhost:{self.port}",
            "--workers", "1",
        ]  # fmt: skip
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            args,
            cwd=self.run_dir,
            env={**os.environ, **SERVER_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.own_lifetime else None,
        )
        log.close()
        self.pid_path.write_text(str(self._proc.pid))

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            BrokerError: the process exited, or no answer within ``timeout_s`` seconds.
        """
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerError(
                    f"the MLflow server exited with code {self._proc.returncode}; "
                    f"{self.log_path} ends with:\n{self._log_tail()}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise BrokerError(
            f"the MLflow server did not answer on {self.tracking_uri}/health within "
            f"{timeout_s:.0f} s; {self.log_path} ends with:\n{self._log_tail()}"
        )

    def ready(self) -> bool:
        """True when ``/health`` answers 200 now."""
        url = self.tracking_uri + "/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
        return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and its workers (SIGTERM to the process group, SIGKILL after
        ``timeout_s`` seconds); idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            terminate_pid(pid, timeout_s, self._proc)
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self.pid_path.unlink(missing_ok=True)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _claim_run_dir(self) -> None:
        marker = self.run_dir / MARKER
        if self.run_dir.exists() and any(self.run_dir.iterdir()) and not marker.exists():
            raise BrokerError(
                f"{self.run_dir} is not empty and was not created by streamproc; "
                "choose a new folder for the MLflow server"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text("state folder of a local MLflow server started by streamproc\n")
