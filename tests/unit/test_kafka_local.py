from __future__ import annotations

from pathlib import Path

import pytest

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import MARKER, LocalKafka


def test_refuses_a_folder_with_user_files(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(BrokerError, match="not created by streamproc"):
        LocalKafka(tmp_path, tmp_path / "libs").start()
    assert precious.read_text() == "keep me"


def test_claims_new_and_own_folders(tmp_path: Path) -> None:
    broker = LocalKafka(tmp_path / "new", tmp_path / "libs")
    broker._claim_run_dir()
    assert (tmp_path / "new" / MARKER).exists()
    (tmp_path / "new" / "data").mkdir()
    broker._claim_run_dir()  # ours: accepted again


def test_cluster_ids_never_look_like_an_option() -> None:
    from streamproc.tools.kafka_local import _cluster_id

    ids = [_cluster_id() for _ in range(2000)]  # about 31 would start with "-" unguarded
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(i) == 22 for i in ids)
    assert len(set(ids)) == len(ids)
