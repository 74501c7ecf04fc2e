"""FolderSource and version_files: version folders ordered by number, folders being written
skipped, exactly one model file or a plug-in per version, version.json checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from streamproc.models.sources import FolderSource, ModelSourceError, version_files, version_order


def add_version(root: Path, name: str, *files: str) -> Path:
    folder = root / "scorer" / name
    folder.mkdir(parents=True)
    for file in files:
        (folder / file).write_bytes(b"model bytes")
    return folder


def test_latest_is_the_highest_number_not_the_last_text(tmp_path: Path) -> None:
    for name in ("9", "10", "2"):
        add_version(tmp_path, name, "model.pt")
    source = FolderSource(tmp_path, "scorer")
    assert source.versions() == ["2", "9", "10"]
    assert source.resolve("latest") == "10"
    assert source.resolve("9") == "9"
    assert sorted(["b", "10", "a", "9"], key=version_order) == ["9", "10", "a", "b"]


def test_folders_being_written_and_plain_files_are_skipped(tmp_path: Path) -> None:
    add_version(tmp_path, "3", "model.pt")
    add_version(tmp_path, "11.tmp", "model.pt")
    add_version(tmp_path, ".12", "model.pt")
    (tmp_path / "scorer" / "13").write_text("a file, not a version folder")
    source = FolderSource(tmp_path, "scorer")
    assert source.versions() == ["3"]
    assert source.resolve("latest") == "3"
    with pytest.raises(ModelSourceError, match=r"no version '11\.tmp'.*versions: \['3'\]"):
        source.resolve("11.tmp")


def test_missing_model_folder_empty_folder_and_unknown_version(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        FolderSource(tmp_path, "scorer").resolve("latest")
    (tmp_path / "scorer").mkdir()
    source = FolderSource(tmp_path, "scorer")
    with pytest.raises(ModelSourceError, match="no version in"):
        source.resolve("latest")
    with pytest.raises(ModelSourceError, match="no version '4'"):
        source.fetch("4")
    assert str(tmp_path / "scorer") in source.describe()


def test_one_model_file_is_the_version(tmp_path: Path) -> None:
    folder = add_version(tmp_path, "1")
    (folder / "nested").mkdir()
    (folder / "nested" / "net.pt2").write_bytes(b"12345")
    (folder / "README.md").write_text("not a model file")
    files = FolderSource(tmp_path, "scorer").fetch("1")
    assert files.version == "1" and files.folder == folder
    assert files.model_file == folder / "nested" / "net.pt2"
    assert files.plugin is None and files.metadata == {}
    assert files.size_bytes == 5


@pytest.mark.parametrize("names", [(), ("a.pt", "b.ts")])
def test_zero_or_two_model_files_are_refused(tmp_path: Path, names: tuple[str, ...]) -> None:
    add_version(tmp_path, "1", "notes.txt", *names)
    with pytest.raises(ModelSourceError, match="exactly one model file") as caught:
        FolderSource(tmp_path, "scorer").fetch("1")
    assert ("found none" in str(caught.value)) == (not names)
    assert all(name in str(caught.value) for name in names)


def test_plugin_in_version_json_wins_over_files(tmp_path: Path) -> None:
    folder = add_version(tmp_path, "2", "weights.pt")
    meta = {"plugin": "my_models.scorer:build", "description": "rules v2"}
    (folder / "version.json").write_text(json.dumps(meta))
    files = version_files("2", folder)
    assert files.plugin == "my_models.scorer:build"
    assert files.model_file is None and files.size_bytes == 0
    assert files.metadata == {"description": "rules v2"}


def test_metadata_beside_a_model_file(tmp_path: Path) -> None:
    folder = add_version(tmp_path, "2", "model.ts")
    (folder / "version.json").write_text('{"description": "retrained"}')
    files = version_files("2", folder)
    assert files.model_file == folder / "model.ts"
    assert files.metadata == {"description": "retrained"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not a JSON object"),
        ('{"plugin": "no_colon"}', "plugin must be 'package.module:factory'"),
        ('{"plugin": 3}', "plugin must be"),
    ],
)
def test_bad_version_json_is_refused(tmp_path: Path, text: str, error: str) -> None:
    folder = add_version(tmp_path, "5", "model.pt")
    (folder / "version.json").write_text(text)
    with pytest.raises(ModelSourceError, match=f"version 5: .*{error}"):
        version_files("5", folder)


def test_a_versions_fingerprint_changes_when_a_file_in_it_is_written(tmp_path: Path) -> None:
    source = FolderSource(tmp_path, "scorer")
    assert source.fingerprint("1") == ()  # not there (yet)
    folder = add_version(tmp_path, "1", "model.pt")
    before = source.fingerprint("1")
    assert [(path, size) for path, size, *_ in before] == [("model.pt", len(b"model bytes"))]
    assert source.fingerprint("1") == before
    with (folder / "model.pt").open("ab") as out:
        out.write(b"more")
    assert source.fingerprint("1") != before


def test_a_versions_fingerprint_changes_when_a_file_is_made_readable_again(
    tmp_path: Path,
) -> None:
    """chmod moves ctime and the mode, not mtime: a version refused for a file it could not
    read is tried again once the file is readable."""
    folder = add_version(tmp_path, "1", "model.pt")
    source = FolderSource(tmp_path, "scorer")
    (folder / "model.pt").chmod(0o000)
    unreadable = source.fingerprint("1")
    (folder / "model.pt").chmod(0o644)
    assert source.fingerprint("1") != unreadable


def test_files_behind_a_symlinked_folder_are_fingerprinted(tmp_path: Path) -> None:
    folder = add_version(tmp_path, "1", "model.pt")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "w.bin").write_bytes(b"weights")
    (folder / "weights").symlink_to("../../shared")
    source = FolderSource(tmp_path, "scorer")
    before = source.fingerprint("1")
    assert [entry[0] for entry in before] == ["model.pt", "weights/w.bin"]
    stat = (shared / "w.bin").stat()
    (shared / "w.bin").write_bytes(b"WEIGHTS")  # same size
    os.utime(shared / "w.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime
    assert source.fingerprint("1") != before


def test_a_symlink_loop_in_a_version_is_walked_once(tmp_path: Path) -> None:
    folder = add_version(tmp_path, "1", "model.pt")
    (folder / "sub").mkdir()
    (folder / "sub" / "a.bin").write_bytes(b"a")
    (folder / "sub" / "up").symlink_to("..")  # sub/up/sub/up/... without an end
    (folder / "self").symlink_to(".")
    (folder / "dangling").symlink_to("nowhere")
    paths = [entry[0] for entry in FolderSource(tmp_path, "scorer").fingerprint("1")]
    assert paths == ["model.pt", "sub/a.bin"]
