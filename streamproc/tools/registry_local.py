"""A local Schema Registry without Docker, for tests, the demo and development.

The registry is Apicurio Registry 2.6 (``io.apicurio:apicurio-registry-app``, the whole
application: classifier ``all``, type ``tar.gz``), resolved from Maven Central with Maven into a
cache directory once. It serves the Confluent Schema Registry API under
``/apis/ccompat/v7`` (what confluent-kafka's ``SchemaRegistryClient`` speaks), keeps its schemas
in memory, and runs on Java 17 (the 3.x line needs Java 21). Measured here: ready about 6-11 s
after start, about 280 MB resident with ``-Xmx256m``.

Lifecycle of one :class:`LocalRegistry`::

    app = ensure_registry_app()           # mvn dependency:copy + unpack, cached
    registry = LocalRegistry(run_dir, app)
    registry.start()                      # spawn java on 127.0.0.1, wait for /health/ready
    registry.url                          # "http://127.0.0.1:PORT/apis/ccompat/v7"
    registry.stop()                       # SIGTERM, then SIGKILL after a deadline; idempotent

As with the local broker, ``own_lifetime=True`` (tests, demo) kills the registry with the thread
that started it; ``streamproc registry start`` passes ``own_lifetime=False`` and records the pid
in ``<dir>/registry.pid`` for ``streamproc registry stop``. A stopped registry loses its schemas
(in-memory storage); :meth:`LocalRegistry.restart` keeps the port, as a restarted server behind
a fixed address would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tarfile
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

REGISTRY_VERSION = "2.6.13.Final"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{REGISTRY_VERSION}:tar.gz:all"
RUNNER = f"apicurio-registry-app-{REGISTRY_VERSION}-runner.jar"
CCOMPAT_PATH = "/apis/ccompat/v7"
MARKER = ".streamproc-registry"


def ensure_registry_app(root: Path | None = None) -> Path:
    """Resolve Apicurio Registry from Maven Central once; return the folder holding its runner
    jar and ``lib/``.

    Raises:
        BrokerError: Maven or Java is missing, or the resolution failed (Maven's output is
            included in the message).
    """
    app = (root or cache_dir()) / f"apicurio-registry-{REGISTRY_VERSION}"
    marker = app / ".complete"
    if marker.exists():
        return app
    for tool in ("mvn", "java"):
        if shutil.which(tool) is None:
            raise BrokerError(
                f"`{tool}` not found on PATH: the local registry needs Java 17 + Maven"
            )
    download = app.parent / f"{app.name}.download"
    staging = app.parent / f"{app.name}.partial"
    for folder in (download, staging):
        shutil.rmtree(folder, ignore_errors=True)
    # dependency:copy, not dependency:unpack (which leaves a marker folder in the output)
    proc = subprocess.run(
        ["mvn", "-q", "-B", "dependency:copy", f"-Dartifact={ARTIFACT}",
         f"-DoutputDirectory={download}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    archives = list(download.glob("*.tar.gz"))
    if proc.returncode != 0 or len(archives) != 1:
        raise BrokerError(
            f"could not fetch {ARTIFACT} with Maven (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    with tarfile.open(archives[0]) as archive:
        archive.extractall(staging, filter="data")
    if not (staging / RUNNER).exists():
        raise BrokerError(f"{archives[0]} holds no {RUNNER}")
    shutil.rmtree(download, ignore_errors=True)
    shutil.rmtree(app, ignore_errors=True)
    staging.rename(app)
    marker.write_text(f"{ARTIFACT}\n")
    return app


@dataclass
class LocalRegistry:
    """One Apicurio Registry on 127.0.0.1, in-memory storage, BACKWARD compatibility by default.

    Args:
        run_dir: folder for the log (``registry.log``) and the pid file; a non-empty folder that
            streamproc did not create is refused (BrokerError), so user files are never touched.
        app: folder from :func:`ensure_registry_app`.
        own_lifetime: kill the registry when the starting thread dies (tests, demo).
        heap_mb: Java heap size in MiB.
        compatibility: the global compatibility rule (``BACKWARD``, ``FORWARD``, ``FULL``,
            ``NONE``, or their ``_TRANSITIVE`` forms): a new schema version that breaks it is
            refused with HTTP 409.
    """

    run_dir: Path
    app: Path
    own_lifetime: bool = True
    heap_mb: int = 256
    compatibility: str = "BACKWARD"
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: the server's root (health under ``/health``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The Confluent-compatible API (what ``schema_registry.url`` takes)."""
        return self.base_url + CCOMPAT_PATH

    @property
    def pid(self) -> int | None:
        """The java process's id while this object started it, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "registry.pid"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "registry.log"

    def start(self, timeout_s: float = 90.0) -> str:
        """Start the registry on a free loopback port and wait until it is ready.

        Returns:
            :attr:`url`.

        Raises:
            BrokerError: the process exited, or was not ready within ``timeout_s`` seconds
                (the message names the log file).
        """
        self._claim_run_dir()
        self.port = self.port or free_port()
        self.spawn()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def restart(self, timeout_s: float = 90.0) -> str:
        """:meth:`stop`, then start again on the same port (schemas are lost: in-memory)."""
        self.stop()
        return self.start(timeout_s)

    def spawn(self) -> None:
        """Start the java process (does not wait)."""
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [
                "java",
                f"-Xmx{self.heap_mb}m",
                "-XX:+UseSerialGC",
                "-Djava.awt.headless=true",
                "-Dquarkus.http.host=127.0.0.1",
                f"-Dquarkus.http.port={self.port}",
                f"-Dregistry.rules.global.compatibility={self.compatibility}",
                "-jar",
                str(self.app / RUNNER),
            ],
            cwd=self.run_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.own_lifetime else None,
        )
        log.close()
        self.pid_path.write_text(str(self._proc.pid))

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``/health/ready`` answers 200.

        Raises:
            BrokerError: the process exited, or not ready within ``timeout_s`` seconds.
        """
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerError(
                    f"the registry exited with code {self._proc.returncode}; see {self.log_path}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise BrokerError(
            f"the registry was not ready within {timeout_s:.0f} s; see {self.log_path}"
        )

    def pause(self) -> None:
        """SIGSTOP the registry (a hung server: connections open, no answers) until
        :meth:`resume`; its schemas stay."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the registry (idempotent)."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGCONT)

    def ready(self) -> bool:
        """True when ``/health/ready`` answers 200 now."""
        url = self.base_url + "/health/ready"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
        return False

    @property
    def running(self) -> bool:
        """True while the java process started by this object runs."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the registry (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            self.resume()  # a stopped process only dies once continued
            terminate_pid(pid, timeout_s, self._proc)
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self.pid_path.unlink(missing_ok=True)

    def _claim_run_dir(self) -> None:
        marker = self.run_dir / MARKER
        if self.run_dir.exists() and any(self.run_dir.iterdir()) and not marker.exists():
            raise BrokerError(
                f"{self.run_dir} is not empty and was not created by streamproc; "
                "choose a new folder for the registry"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text("state folder of a local Schema Registry started by streamproc\n")
