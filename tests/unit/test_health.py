"""HealthServer: probes, metrics, and quiet handling of clients that hang up early."""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from streamproc.health import HealthServer

TIMEOUT_S = 30.0  # generous: the suite must pass with both cores busy


@pytest.fixture
def gate() -> Iterator[tuple[threading.Event, threading.Event]]:
    """(probe entered, probe may answer): lets a test hang up while a probe is being computed."""
    entered, release = threading.Event(), threading.Event()
    yield entered, release
    release.set()


def make_server(gate: tuple[threading.Event, threading.Event]) -> HealthServer:
    entered, release = gate
    registry = CollectorRegistry()
    Counter("demo_total", "a counter", registry=registry).inc(3)

    def slow_live() -> tuple[bool, str]:
        entered.set()
        assert release.wait(TIMEOUT_S)
        return True, "polled 0.1 s ago"

    server = HealthServer("127.0.0.1", 0, registry, slow_live, lambda: (False, "no partitions"))
    server.start()
    return server


def get(server: HealthServer, path: str) -> tuple[int, str]:
    try:
        url = f"http://127.0.0.1:{server.port}{path}"
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:  # the error holds the response: closed here, not by the collector
            return exc.code, exc.read().decode()


def wait_for_request_threads() -> None:
    """Wait until every request thread of the server has finished (written or failed)."""
    deadline_s = time.monotonic() + TIMEOUT_S
    while any("process_request_thread" in t.name for t in threading.enumerate()):
        assert time.monotonic() < deadline_s, "a request thread is still running"
        time.sleep(0.01)


def test_routes_answer(gate: tuple[threading.Event, threading.Event]) -> None:
    server = make_server(gate)
    gate[1].set()
    try:
        assert get(server, "/healthz") == (200, "polled 0.1 s ago\n")
        assert get(server, "/readyz") == (503, "no partitions\n")
        status, body = get(server, "/metrics")
        assert status == 200 and "demo_total 3.0" in body
        assert get(server, "/nope")[0] == 404
    finally:
        server.close()
        server.close()  # idempotent


def test_client_hanging_up_mid_request_prints_no_traceback(
    gate: tuple[threading.Event, threading.Event], capfd: pytest.CaptureFixture[str]
) -> None:
    """A probe or scrape that times out and closes its socket (RST) is routine, not an error:
    the server must neither print a traceback (BrokenPipeError/ConnectionResetError) nor stop."""
    entered, release = gate
    server = make_server(gate)
    try:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S)
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(TIMEOUT_S), "the probe was never called"
        # SO_LINGER 0: close() sends a reset, as a client that gave up does.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        release.set()
        wait_for_request_threads()
        assert get(server, "/healthz") == (200, "polled 0.1 s ago\n")
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_metrics_speak_openmetrics_when_asked_so_exemplars_reach_the_scraper() -> None:
    registry = CollectorRegistry()
    Counter("demo_total", "a counter", registry=registry).inc(3)
    server = HealthServer("127.0.0.1", 0, registry, lambda: (True, ""), lambda: (True, ""))
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        asked = urllib.request.Request(
            url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(asked, timeout=TIMEOUT_S) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert resp.read().decode().endswith("# EOF\n")
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:  # plain Prometheus text
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert "# EOF" not in resp.read().decode()
    finally:
        server.close()
