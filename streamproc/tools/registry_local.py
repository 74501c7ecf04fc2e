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

import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import cache_dir, install_once
from streamproc.tools.local_service import LocalService, maven_copy

REGISTRY_VERSION = "2.6.13.Final"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{REGISTRY_VERSION}:tar.gz:all"
RUNNER = f"apicurio-registry-app-{REGISTRY_VERSION}-runner.jar"
CCOMPAT_PATH = "/apis/ccompat/v7"


def ensure_registry_app(root: Path | None = None) -> Path:
    """Resolve Apicurio Registry from Maven Central once; return the folder holding its runner
    jar and ``lib/``.

    Raises:
        BrokerError: Maven or Java is missing, or the resolution failed (Maven's output is
            included in the message).
    """
    app = (root or cache_dir()) / f"apicurio-registry-{REGISTRY_VERSION}"
    install_once(app / ".complete", lambda: _fetch_registry_app(app))
    return app


def _fetch_registry_app(app: Path) -> None:
    """Fetch and unpack the registry into ``app`` (staged, renamed when complete); mark it."""
    marker = app / ".complete"
    download = app.parent / f"{app.name}.download"
    staging = app.parent / f"{app.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    # dependency:copy, not dependency:unpack (which leaves a marker folder in the output)
    archive_path = maven_copy(ARTIFACT, download)
    with tarfile.open(archive_path) as archive:
        archive.extractall(staging, filter="data")
    if not (staging / RUNNER).exists():
        raise BrokerError(f"{archive_path} holds no {RUNNER}")
    shutil.rmtree(download, ignore_errors=True)
    shutil.rmtree(app, ignore_errors=True)
    staging.rename(app)
    marker.write_text(f"{ARTIFACT}\n")


@dataclass
class LocalRegistry(LocalService):
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

    app: Path
    heap_mb: int = 256
    compatibility: str = "BACKWARD"

    NAME = "registry"
    LABEL = "the local Schema Registry"
    HEALTH_PATH = "/health/ready"

    @property
    def url(self) -> str:
        """The Confluent-compatible API (what ``schema_registry.url`` takes)."""
        return self.base_url + CCOMPAT_PATH

    @property
    def address(self) -> str:
        return self.url

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [
            "java",
            f"-Xmx{self.heap_mb}m",
            "-XX:+UseSerialGC",
            "-Djava.awt.headless=true",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={self.port}",
            f"-Dregistry.rules.global.compatibility={self.compatibility}",
            "-jar",
            str(self.app / RUNNER),
        ], {}

    def start(self, timeout_s: float = 90.0) -> str:
        """Start the registry on a free loopback port and wait until it is ready; returns
        :attr:`url` (see :meth:`LocalService.start`)."""
        return super().start(timeout_s)
