"""The local trace backend's folder and port rules (no server started)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from streamproc.errors import BrokerError
from streamproc.tools.tracing_local import claim_tracing_dir, previous_port


def test_a_folder_with_other_files_or_a_file_is_refused(tmp_path: Path) -> None:
    claim_tracing_dir(tmp_path / "absent")
    claim_tracing_dir(tmp_path)  # empty
    (tmp_path / "zipkin").mkdir()
    (tmp_path / "collector").mkdir()
    claim_tracing_dir(tmp_path)  # the backend's own
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BrokerError, match="holds files other than"):
        claim_tracing_dir(tmp_path)
    with pytest.raises(BrokerError, match="is a file"):
        claim_tracing_dir(tmp_path / "notes.txt")


def test_the_collector_keeps_its_port_while_it_is_free(tmp_path: Path) -> None:
    endpoint = tmp_path / "endpoint"
    assert previous_port(endpoint) == 0  # never started
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        endpoint.write_text(f"http://127.0.0.1:{port}")
        assert previous_port(endpoint) == 0  # taken by another process now
    assert previous_port(endpoint) == port
    endpoint.write_text("not a url")
    assert previous_port(endpoint) == 0
