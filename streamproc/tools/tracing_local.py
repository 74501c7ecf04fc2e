"""A local trace backend without Docker, for tests, the demo and development: Zipkin behind an
OpenTelemetry Collector, both on loopback.

* **Zipkin** (``io.zipkin:zipkin-server``, the executable jar, classifier ``exec``; resolved from
  Maven Central with Maven once): the trace store (in memory), its query API
  (``/api/v2/trace/{id}``, ``/api/v2/traces``) and its UI (``/zipkin/``), on Java 17. Measured
  here: ready about 6 s after start, about 300 MB resident.
* **The collector** (OpenTelemetry Collector ``v0.148.0``, built once from the Go module proxy
  with the OpenTelemetry Collector Builder: the OTLP receiver over HTTP and gRPC, the batch
  processor, the Zipkin exporter of collector-contrib): takes OTLP, which every OpenTelemetry
  SDK exports, and forwards to Zipkin, which has no OTLP receiver of its own that Maven Central
  serves. Measured here: built in about 100 s (module and build caches about 1.3 GB), ready in
  well under a second, about 26 MB resident.

Zipkin has no span links: the collector's Zipkin exporter writes each link as a tag
``otlp.link.<n>`` = ``traceId|spanId|traceState|attributes|dropped``. Attributes become string
tags; events become annotations.

Lifecycle of one :class:`LocalTracing`::

    tracing = LocalTracing(run_dir)       # zipkin/ and collector/ below run_dir
    tracing.start()                       # Zipkin, then the collector; waits for both
    tracing.otlp_endpoint                 # "http://127.0.0.1:PORT" (OTEL_EXPORTER_OTLP_ENDPOINT)
    tracing.ui_url                        # "http://127.0.0.1:PORT/zipkin/"
    tracing.stop()                        # both; idempotent

``streamproc tracing start|stop`` runs the same two servers in the background, recorded in
their folders like ``streamproc registry start``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import cache_dir, free_port, install_once
from streamproc.tools.local_service import LocalService, maven_copy, require_tools

ZIPKIN_VERSION = "3.6.1"
ZIPKIN_ARTIFACT = f"io.zipkin:zipkin-server:{ZIPKIN_VERSION}:jar:exec"
# one release for every collector module: the only zipkinexporter release the proxy lists
COLLECTOR_VERSION = "0.148.0"
COLLECTOR_NAME = "otelcol-streamproc"
_CONTRIB = "github.com/open-telemetry/opentelemetry-collector-contrib"
COLLECTOR_MODULES = {
    "receivers": ["go.opentelemetry.io/collector/receiver/otlpreceiver"],
    "processors": ["go.opentelemetry.io/collector/processor/batchprocessor"],
    "exporters": [f"{_CONTRIB}/exporter/zipkinexporter"],
}


# Zipkin reads its settings from the environment: in memory, and none of its transport collectors
# (a shell holding KAFKA_BOOTSTRAP_SERVERS, which `streamproc kafka start` prints, would make it
# consume the topic "zipkin" there and report unhealthy while it cannot)
ZIPKIN_ENV = {
    "STORAGE_TYPE": "mem",
    "SELF_TRACING_ENABLED": "false",
    "COLLECTOR_KAFKA_ENABLED": "false",
    "KAFKA_BOOTSTRAP_SERVERS": "",
    "COLLECTOR_RABBITMQ_ENABLED": "false",
    "RABBIT_ADDRESSES": "",
    "RABBIT_URI": "",
    "COLLECTOR_ACTIVEMQ_ENABLED": "false",
    "ACTIVEMQ_URL": "",
    "COLLECTOR_SCRIBE_ENABLED": "false",
}


def claim_tracing_dir(root: Path) -> None:
    """Refuse ``root`` unless it is absent, empty, or holds only the backend's two folders.

    Raises:
        BrokerError: it holds something else (user files are never mixed with the servers')."""
    if root.exists() and not root.is_dir():
        raise BrokerError(f"{root} is a file; choose a folder for the local trace backend")
    if root.is_dir() and {p.name for p in root.iterdir()} - {"zipkin", "collector"}:
        raise BrokerError(
            f"{root} holds files other than the trace backend's zipkin/ and collector/; "
            "choose a new folder"
        )


def ensure_zipkin_jar(root: Path | None = None) -> Path:
    """Resolve Zipkin's executable jar from Maven Central once; its path.

    Raises:
        BrokerError: Maven or Java is missing, or the resolution failed.
    """
    folder = (root or cache_dir()) / f"zipkin-{ZIPKIN_VERSION}"
    jar = folder / f"zipkin-server-{ZIPKIN_VERSION}-exec.jar"

    def fetch() -> None:
        copied = maven_copy(ZIPKIN_ARTIFACT, folder.parent / f"{folder.name}.download")
        shutil.rmtree(folder, ignore_errors=True)
        copied.parent.rename(folder)
        (folder / ".complete").write_text(f"{ZIPKIN_ARTIFACT}\n")

    install_once(folder / ".complete", fetch)
    return jar


def ensure_collector(root: Path | None = None) -> Path:
    """Build the OpenTelemetry Collector of :data:`COLLECTOR_MODULES` once (the Collector
    Builder, ``go`` and the Go module proxy; caches under ``<root>/go``); the binary's path.

    Raises:
        BrokerError: ``go`` is missing, or the build failed (its output is in the message).
    """
    base = root or cache_dir()
    folder = base / f"otelcol-{COLLECTOR_VERSION}"

    def build() -> None:
        require_tools("go", what="building the OpenTelemetry Collector")
        staging = base / f"{folder.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        env = os.environ | {
            "GOBIN": str(staging / "bin"),
            "GOMODCACHE": str(base / "go" / "mod"),
            "GOCACHE": str(base / "go" / "build"),
            "GOFLAGS": "-modcacherw -buildvcs=false",
            "GOTOOLCHAIN": "local",
            "CGO_ENABLED": "0",
        }
        manifest = {
            "dist": {
                "name": COLLECTOR_NAME,
                "description": "streamproc's local trace collector (OTLP in, Zipkin out)",
                "output_path": str(staging / "build"),
                "version": COLLECTOR_VERSION,
            },
        } | {
            kind: [{"gomod": f"{module} v{COLLECTOR_VERSION}"} for module in modules]
            for kind, modules in COLLECTOR_MODULES.items()
        }
        (staging / "builder.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
        builder = f"go.opentelemetry.io/collector/cmd/builder@v{COLLECTOR_VERSION}"
        for args in (
            ["go", "install", "-trimpath", builder],
            [str(staging / "bin" / "builder"), "--config", str(staging / "builder.yaml")],
        ):
            proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise BrokerError(
                    f"building the OpenTelemetry Collector failed at `{' '.join(args)}` "
                    f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
                )
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        (folder / ".complete").write_text(f"{COLLECTOR_NAME} {COLLECTOR_VERSION}\n")

    install_once(folder / ".complete", build)
    return folder / "build" / COLLECTOR_NAME


def previous_port(endpoint_file: Path) -> int:
    """The port of the URL saved in ``endpoint_file`` when it is free again, else 0 (any)."""
    with contextlib.suppress(OSError, ValueError, IndexError):  # absent, taken, not a URL
        port = int(endpoint_file.read_text().strip().rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners
            probe.bind(("127.0.0.1", port))
        return port
    return 0


@dataclass
class LocalZipkin(LocalService):
    """One Zipkin server on 127.0.0.1, in-memory storage.

    Args:
        run_dir: folder for the log (``zipkin.log``) and the pid file; a non-empty folder that
            streamproc did not create is refused (BrokerError).
        jar: the executable jar from :func:`ensure_zipkin_jar`.
        own_lifetime: kill the server when the starting thread dies (tests, demo).
        heap_mb: Java heap size in MiB.
    """

    jar: Path
    heap_mb: int = 256

    NAME = "zipkin"
    LABEL = "the local Zipkin server"
    HEALTH_PATH = "/health"

    @property
    def address(self) -> str:
        """The UI, ``http://127.0.0.1:PORT/zipkin/`` (the query API is under ``/api/v2``)."""
        return self.base_url + "/zipkin/"

    def command(self) -> tuple[list[str], dict[str, str]]:
        # the port list replaced as a whole: address, port and protocol of its one entry
        return [
            "java", f"-Xmx{self.heap_mb}m", "-XX:+UseSerialGC", "-jar", str(self.jar),
            "--armeria.ports[0].ip=127.0.0.1",
            f"--armeria.ports[0].port={self.port}",
            "--armeria.ports[0].protocols[0]=http",
        ], ZIPKIN_ENV  # fmt: skip


@dataclass
class LocalCollector(LocalService):
    """One OpenTelemetry Collector on 127.0.0.1: OTLP over HTTP (:attr:`port`; its
    :attr:`address` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes) and gRPC (:attr:`grpc_port`)
    in, batches of at most 1 s, Zipkin out.

    Args:
        run_dir: folder for its config (``collector.yaml``), log and pid file.
        binary: the collector from :func:`ensure_collector`.
        zipkin_url: Zipkin's root, ``http://127.0.0.1:PORT``.
        own_lifetime: kill the collector when the starting thread dies (tests, demo).
    """

    binary: Path
    zipkin_url: str
    grpc_port: int = 0

    NAME = "collector"
    LABEL = "the local OpenTelemetry Collector"
    HEALTH_PATH = "/v1/traces"

    def command(self) -> tuple[list[str], dict[str, str]]:
        self.grpc_port = self.grpc_port or free_port()
        config = {
            "receivers": {
                "otlp": {
                    "protocols": {
                        "http": {"endpoint": f"127.0.0.1:{self.port}"},
                        "grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}"},
                    }
                }
            },
            "processors": {"batch": {"timeout": "1s"}},
            "exporters": {
                "zipkin": {"endpoint": f"{self.zipkin_url}/api/v2/spans", "format": "json"}
            },
            "service": {
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
                "pipelines": {
                    "traces": {"receivers": ["otlp"], "processors": ["batch"],
                               "exporters": ["zipkin"]}
                },
            },
        }  # fmt: skip
        path = self.run_dir / "collector.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return [str(self.binary), "--config", str(path)], {}

    def ready(self) -> bool:
        """True when an empty OTLP/HTTP export (no spans) is answered 200."""
        request = urllib.request.Request(
            self.base_url + self.HEALTH_PATH,
            data=b"",
            headers={"Content-Type": "application/x-protobuf"},
        )
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=2) as reply:
            return bool(reply.status == 200)
        return False


@dataclass
class LocalTracing:
    """Zipkin and the collector in front of it, in ``run_dir/zipkin`` and
    ``run_dir/collector``.

    Args:
        run_dir: the parent of both servers' folders.
        own_lifetime: kill both with the thread that started them (tests, demo).
    """

    run_dir: Path
    own_lifetime: bool = True
    zipkin: LocalZipkin | None = field(default=None, init=False)
    collector: LocalCollector | None = field(default=None, init=False)

    def start(self, timeout_s: float = 120.0) -> str:
        """Fetch or build what is missing (first use: minutes), start Zipkin, then the
        collector; the OTLP/HTTP endpoint.

        Raises:
            BrokerError: ``run_dir`` is not the backend's (:func:`claim_tracing_dir`), or a fetch,
            build or start failed (the one started is stopped again).
        """
        claim_tracing_dir(self.run_dir)
        jar, binary = ensure_zipkin_jar(), ensure_collector()
        self.zipkin = LocalZipkin(self.run_dir / "zipkin", jar, own_lifetime=self.own_lifetime)
        self.zipkin.start(timeout_s)
        self.collector = LocalCollector(
            self.run_dir / "collector", binary, self.zipkin.base_url, own_lifetime=self.own_lifetime
        )
        try:
            return self.collector.start(timeout_s)
        except BaseException:
            self.zipkin.stop()
            raise

    def _started(self) -> tuple[LocalZipkin, LocalCollector]:
        if self.zipkin is None or self.collector is None:
            raise BrokerError("the local trace backend is not started")
        return self.zipkin, self.collector

    @property
    def otlp_endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, the collector's OTLP/HTTP endpoint (BrokerError before
        :meth:`start`)."""
        return self._started()[1].address

    @property
    def ui_url(self) -> str:
        """Zipkin's UI, ``http://127.0.0.1:PORT/zipkin/`` (BrokerError before :meth:`start`)."""
        return self._started()[0].address

    @property
    def api_url(self) -> str:
        """Zipkin's query API, ``http://127.0.0.1:PORT/api/v2`` (BrokerError before
        :meth:`start`)."""
        return self._started()[0].base_url + "/api/v2"

    def stop(self) -> None:
        """Stop the collector, then Zipkin; idempotent."""
        for server in (self.collector, self.zipkin):
            if server is not None:
                server.stop()


def find_trace(api_url: str, service: str, span_name: str, timeout_s: float = 20.0) -> str | None:
    """The id of the newest trace Zipkin (its query API, ``.../api/v2``) holds with a span of
    ``service`` named ``span_name`` (Zipkin keeps names in lower case), asked every 0.5 s for
    ``timeout_s`` (spans reach Zipkin through the collector's batches); None when none
    arrived.

    Raises:
        OSError: Zipkin does not answer.
    """
    query = urllib.parse.urlencode(
        {
            "serviceName": service,
            "spanName": span_name.lower(),
            "limit": "1",
            "lookback": "3600000",
        }
    )
    deadline_s = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{api_url}/traces?{query}", timeout=5) as reply:
            found = json.load(reply)
        if found and found[0]:
            return str(found[0][0]["traceId"])
        if time.monotonic() >= deadline_s:
            return None
        time.sleep(0.5)
