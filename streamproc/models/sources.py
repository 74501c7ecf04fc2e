"""Where a pipeline's model versions come from: a model repository folder (the embedded
default) or MLflow's model registry (:mod:`streamproc.models.mlflow_source`).

A *version* is a folder on local disk holding one model file (TorchScript ``*.pt``/``*.ts``,
or a ``torch.export`` program ``*.pt2``) or a ``version.json`` naming a plug-in
(``{"plugin": "package.module:factory"}``: ``factory(device)`` returns the model as an
eval-mode ``torch.nn.Module``), plus optional metadata in ``version.json``. A source turns a
version reference (``latest``, a version name, MLflow's ``@alias``) into such a folder.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any, Protocol

from streamproc.errors import StreamprocError

MODEL_SUFFIXES = (".pt", ".ts", ".pt2")
METADATA_FILE = "version.json"

Fingerprint = tuple[tuple[str, int, int, int, int], ...]
"""A version folder's files as ``(path relative to the folder, size in bytes, mtime_ns,
ctime_ns, st_mode)``, sorted by path, symlinks followed: what changes when a file in it is
written, replaced, added, removed, or its mode changed (``chmod`` moves ctime, not mtime)."""


class ModelSourceError(StreamprocError):
    """A version cannot be found or read (unknown name, no model file, source unreachable).

    Attributes:
        key: the ``pipelines[].model`` key at fault: ``repository`` (the folder is missing),
            ``tracking_uri`` (the server cannot be reached), else ``version``.
    """

    def __init__(self, message: str, key: str = "version") -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class ModelVersionFiles:
    """One version on local disk.

    Attributes:
        version: the version's name (``3``; a result's ``streamproc.model.version`` header).
        folder: the folder holding its files.
        model_file: its TorchScript or ``torch.export`` file, None for a plug-in.
        plugin: ``package.module:factory`` from ``version.json``, None for a model file.
        metadata: the rest of ``version.json`` (free-form; e.g. ``description``).
    """

    version: str
    folder: Path
    model_file: Path | None
    plugin: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        """The model file's size in bytes (0 for a plug-in): the memory check's estimate."""
        return 0 if self.model_file is None else self.model_file.stat().st_size


class ModelSource(Protocol):
    """A pipeline's versions. Called from the pipeline's ``models-<pipeline>`` thread only
    (and once at start-up); methods may block on the network."""

    def describe(self) -> str:
        """Where the versions come from, for logs (no secrets)."""
        ...

    def versions(self) -> list[str]:
        """Every version's name, lowest first.

        Raises:
            ModelSourceError: the model's folder is missing, or the source cannot be reached.
        """
        ...

    def resolve(self, reference: str) -> str:
        """The version name ``reference`` means now (``latest``, ``@alias`` or a name).

        Raises:
            ModelSourceError: no such version, or the source cannot be reached.
        """
        ...

    def fetch(self, version: str) -> ModelVersionFiles:
        """Version ``version`` on local disk (downloaded once where the source is remote).

        Raises:
            ModelSourceError: no such version, no model file in it, or unreachable.
        """
        ...

    def fingerprint(self, version: str) -> Fingerprint:
        """The files of version ``version`` as they are now on local disk (empty while none
        are there): a refused version is tried again once this changed. Never raises, never
        reaches the network."""
        ...


def version_files(version: str, folder: Path) -> ModelVersionFiles:
    """The model file or plug-in of the version held in ``folder``.

    Raises:
        ModelSourceError: ``version.json`` is not a JSON object, or the folder holds no model
            file and no plug-in, or more than one model file.
    """
    metadata: dict[str, Any] = {}
    meta_path = folder / METADATA_FILE
    if meta_path.is_file():
        try:
            metadata = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelSourceError(f"version {version}: {meta_path} is not JSON: {exc}") from exc
        if not isinstance(metadata, dict):
            raise ModelSourceError(f"version {version}: {meta_path} is not a JSON object")
    plugin = metadata.pop("plugin", None)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in MODEL_SUFFIXES)
    if plugin is not None:
        if not isinstance(plugin, str) or ":" not in plugin:
            raise ModelSourceError(
                f"version {version}: plugin must be 'package.module:factory', got {plugin!r}"
            )
        return ModelVersionFiles(version, folder, None, plugin, metadata)
    if len(files) != 1:
        found = [str(p.relative_to(folder)) for p in files]
        raise ModelSourceError(
            f"version {version}: {folder} must hold exactly one model file "
            f"({', '.join('*' + s for s in MODEL_SUFFIXES)}) or a {METADATA_FILE} with a "
            f"plugin; found {found or 'none'}"
        )
    return ModelVersionFiles(version, folder, files[0], None, metadata)


def folder_fingerprint(folder: Path) -> Fingerprint:
    """The :data:`Fingerprint` of every file under ``folder`` (empty where it does not
    exist; a file removed while it is read is left out). Symlinks are followed (weights
    behind ``weights -> ../shared`` count), a folder already on the way down is not entered
    again (a symlink loop ends at once), a dangling symlink is left out. Never raises."""
    found: list[tuple[str, int, int, int, int]] = []
    try:
        top = os.stat(folder)
    except OSError:
        return ()
    _walk(folder, "", {(top.st_dev, top.st_ino)}, found)
    return tuple(sorted(found))


def _walk(
    folder: Path,
    prefix: str,
    ancestors: set[tuple[int, int]],
    found: list[tuple[str, int, int, int, int]],
) -> None:
    """Add the files under ``folder`` (named ``prefix`` + their name) to ``found``; enter the
    folders among them that are not in ``ancestors`` (device, inode)."""
    try:
        with os.scandir(folder) as entries:
            listed = list(entries)
    except OSError:
        return
    for entry in listed:
        try:
            stat = entry.stat()  # follows symlinks
        except OSError:
            continue  # dangling, or removed while read
        name = prefix + entry.name
        if S_ISDIR(stat.st_mode):
            key = (stat.st_dev, stat.st_ino)
            if key not in ancestors:
                _walk(Path(entry.path), name + "/", ancestors | {key}, found)
        elif S_ISREG(stat.st_mode):
            found.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_mode))


def version_order(name: str) -> tuple[int, int | str]:
    """Sort key of version names: numbers by value, after them other names by text."""
    return (0, int(name)) if re.fullmatch(r"\d+", name) else (1, name)


class FolderSource:
    """Versions in ``<repository>/<model>/<version>/`` (a mounted volume in Kubernetes).

    Args:
        repository: the model repository root.
        model: the model's folder name in it.
    """

    def __init__(self, repository: str | Path, model: str) -> None:
        self.root = Path(repository) / model

    def describe(self) -> str:
        return f"folder {self.root}"

    def versions(self) -> list[str]:
        """The version folders, lowest first (a folder whose name starts with ``.`` or ends
        with ``.tmp`` is one being written: skipped).

        Raises:
            ModelSourceError: the model folder does not exist.
        """
        if not self.root.is_dir():
            raise ModelSourceError(f"model folder {self.root} does not exist", "repository")
        names = [
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".tmp")
        ]
        return sorted(names, key=version_order)

    def resolve(self, reference: str) -> str:
        versions = self.versions()
        if reference == "latest":
            if not versions:
                raise ModelSourceError(f"no version in {self.root}")
            return versions[-1]
        if reference not in versions:
            raise ModelSourceError(f"no version {reference!r} in {self.root}; versions: {versions}")
        return reference

    def fetch(self, version: str) -> ModelVersionFiles:
        folder = self.root / version
        if not folder.is_dir():
            raise ModelSourceError(f"no version {version!r} in {self.root}")
        return version_files(version, folder)

    def fingerprint(self, version: str) -> Fingerprint:
        return folder_fingerprint(self.root / version)
