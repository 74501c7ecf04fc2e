"""HTTP endpoint on ``metrics.port``: ``/metrics``, ``/healthz`` and ``/readyz``.

* ``/metrics``: Prometheus text format from the process's own registry.
* ``/healthz`` (liveness): 200 while the source thread's poll loop has polled within
  ``liveness_timeout_s``, else 503. A revoke may hold the poll loop for up to
  ``revoke_timeout_s``, so the timeout is at least twice that.
* ``/readyz`` (readiness): 200 when the pipeline is running and owns at least one partition,
  else 503.

The server runs on daemon threads (stdlib ``ThreadingHTTPServer``) and reads state through two
callables, so it holds no pipeline logic. A client that hangs up before its answer is written (a
probe or scrape that timed out) is routine: the answer is dropped without a traceback.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

Probe = Callable[[], tuple[bool, str]]
Answer = tuple[int, bytes, str]
"""An HTTP answer: status, body, content type."""


class AdminRoutes(Protocol):
    """Routes served beside the probes (the model admin endpoint): None for a path they do
    not serve."""

    def get(self, path: str) -> Answer | None: ...

    def post(self, path: str, authorization: str | None, body: bytes) -> Answer | None: ...


MAX_BODY_BYTES = 65536
CLIENT_TIMEOUT_S = 30.0


class HealthServer:
    """Serve metrics and probes.

    Args:
        host: bind address.
        port: TCP port (0 picks a free one; see :attr:`port`).
        registry: Prometheus registry to expose.
        live: returns (alive, reason).
        ready: returns (ready, reason).
        admin: the admin routes (``GET /models``, ``POST /models/<pipeline>``), None: none.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        live: Probe,
        ready: Probe,
        admin: AdminRoutes | None = None,
    ) -> None:
        def metrics(accept: str | None) -> Answer:
            # OpenMetrics when the scraper asks for it (the exemplars: streamproc.tracing)
            encoder, content_type = choose_encoder(accept or "")
            return 200, encoder(registry), content_type

        routes: dict[str, Callable[[], Answer]] = {
            "/healthz": lambda: _probe(live),
            "/readyz": lambda: _probe(ready),
        }

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT_S  # a client that sends nothing does not hold a thread

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
                if path == "/metrics":
                    answer: Answer | None = metrics(self.headers.get("Accept"))
                else:
                    answer = route() if route else None
                if answer is None and admin is not None:
                    answer = admin.get(path)
                self._send(answer or (404, b"not found\n", "text/plain"))

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_BODY_BYTES:
                    self._send((413, b"body missing length or too large\n", "text/plain"))
                    return
                body = self.rfile.read(length)
                path = self.path.split("?", 1)[0]
                answer = None
                if admin is not None:
                    answer = admin.post(path, self.headers.get("Authorization"), body)
                self._send(answer or (404, b"not found\n", "text/plain"))

            def _send(self, answer: Answer) -> None:
                status, body, content_type = answer
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds would flood the logs

        self._server = _Server((host, port), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: object
    ) -> None:
        # BrokenPipeError, ConnectionResetError, ConnectionAborted: the client went away.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def _probe(check: Probe) -> tuple[int, bytes, str]:
    ok, reason = check()
    return (200 if ok else 503), f"{reason}\n".encode(), "text/plain; charset=utf-8"
