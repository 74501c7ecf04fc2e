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

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import cache_dir, install_once
from streamproc.tools.local_service import LocalService

MLFLOW_VERSION = "3.17.2"
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
    install_once(env / ".complete", lambda: _install_mlflow(env))
    return env


def _install_mlflow(env: Path) -> None:
    """Install the server into ``env`` (staged, renamed when complete); mark it complete."""
    marker = env / ".complete"
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


@dataclass
class LocalMlflow(LocalService):
    """One MLflow tracking server on 127.0.0.1: SQLite backend store, proxied artifacts.

    Args:
        run_dir: folder for the database (``mlflow.db``), the artifacts (``artifacts/``), the log
            (``mlflow.log``) and the pid file; a non-empty folder that streamproc did not create
            is refused (BrokerError), so user files are never touched.
        env: the virtual environment from :func:`ensure_mlflow_server`.
        own_lifetime: kill the server when the starting thread dies (tests, demo).
    """

    env: Path

    NAME = "mlflow"
    LABEL = "the local MLflow server"
    HEALTH_PATH = "/health"

    @property
    def tracking_uri(self) -> str:
        """``http://127.0.0.1:PORT``: what ``MLFLOW_TRACKING_URI`` takes."""
        return self.base_url

    def command(self) -> tuple[list[str], dict[str, str]]:
        store = self.run_dir / "mlflow.db"
        return [
            str(self.env / "bin" / "python"), "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{store}",
            "--artifacts-destination", str(self.run_dir / "artifacts"),
            "--serve-artifacts",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--allowed-hosts", f"127.0.0.1:{self.port},localhost:{self.port}",
            "--workers", "1",
        ], SERVER_ENV  # fmt: skip
