"""Model versions from MLflow's model registry (a tracking server reached over HTTP).

A version of registered model ``<model>`` is MLflow's model version ``N``; its artifacts must
hold what a version folder holds (:mod:`streamproc.models.sources`): one ``*.pt``/``*.ts``/
``*.pt2`` file, or a ``version.json`` naming a plug-in. :func:`register_version` registers such a
file (tests, the demo, an operator's first steps).

Only the configured tracking server is contacted. MLflow's usage telemetry is switched off
(``MLFLOW_DISABLE_TELEMETRY``) and its HTTP calls are bounded (:data:`HTTP_DEFAULTS`: 5 s per
request, 2 retries, so an unreachable or hung server fails a call within about 5 s or 20 s
rather than MLflow's default of minutes); an operator may set those ``MLFLOW_HTTP_REQUEST_*``
variables otherwise. Both are set in this process's environment the first time a source or
:func:`register_version` is used; MLflow is imported only then.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.parse
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from streamproc.models.sources import (
    Fingerprint,
    ModelSourceError,
    ModelVersionFiles,
    folder_fingerprint,
    version_files,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

#: MLflow's HTTP settings unless already set: seconds per request, retries, backoff factor (s),
#: backoff jitter (s).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}
ARTIFACT_PATH = "model"  # where register_version puts the file in its run


def _client(tracking_uri: str) -> MlflowClient:
    """An MLflow client of ``tracking_uri`` (its model registry too), telemetry off."""
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm in logs
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _errors() -> tuple[type[Exception], ...]:
    """What MLflow raises for an unknown name or an unreachable server."""
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)


def _redact(uri: str) -> str:
    """``uri`` without user and password (for messages and logs)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _reason(exc: BaseException) -> str:
    """MLflow's message, first line, at most 300 characters; an unreachable server in short."""
    text = str(getattr(exc, "message", exc)).strip()
    unreachable = re.search(r"Max retries exceeded.*?Caused by (\w+)", text, re.DOTALL)
    if unreachable:
        return f"server unreachable ({unreachable.group(1)})"
    return (text.splitlines() or [type(exc).__name__])[0][:300]


class MlflowSource:
    """The versions of registered model ``model`` on an MLflow tracking server.

    Args:
        tracking_uri: the server, e.g. ``http://127.0.0.1:5000`` (its model registry is used).
        model: the registered model's name.
        cache_dir: where fetched versions are kept, ``<cache_dir>/<model, URL-quoted>/<version>``
            (the version's artifact folder); None: a temporary folder of this object, removed
            with it (or at exit).
    """

    def __init__(self, tracking_uri: str, model: str, cache_dir: Path | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.model = model
        if cache_dir is None:
            cache_dir = Path(tempfile.mkdtemp(prefix="streamproc-mlflow-"))
            weakref.finalize(self, shutil.rmtree, cache_dir, ignore_errors=True)
        self.cache = cache_dir / urllib.parse.quote(model, safe="")
        self._client = _client(tracking_uri)

    def describe(self) -> str:
        return f"MLflow model {self.model!r} at {_redact(self.tracking_uri)}"

    def _fail(self, what: str, exc: BaseException) -> ModelSourceError:
        reason = _reason(exc)
        return ModelSourceError(
            f"MLflow model {self.model!r} {what} at {_redact(self.tracking_uri)}: {reason}",
            "tracking_uri" if reason.startswith("server unreachable") else "version",
        )

    def resolve(self, reference: str) -> str:
        """The version number ``reference`` means now.

        Args:
            reference: ``latest`` (the highest version number), ``@alias``, or a version number.

        Raises:
            ModelSourceError: no such version or alias, no version at all, a reference of
                another form, or the server cannot be reached (after about 5-20 s).
        """
        try:
            if reference == "latest":
                versions = self.versions()
                if not versions:
                    raise ModelSourceError(
                        f"MLflow model {self.model!r} has no version (or is not registered) at "
                        f"{_redact(self.tracking_uri)}"
                    )
                return versions[-1]
            if reference.startswith("@"):
                alias = reference[1:]
                found = self._client.get_model_version_by_alias(self.model, alias)
                return str(found.version)
            if not reference.isdigit():
                raise ModelSourceError(
                    f"MLflow model {self.model!r}: {reference!r} is not a version reference "
                    "(latest, @alias or a version number)"
                )
            return str(self._client.get_model_version(self.model, reference).version)
        except _errors() as exc:
            raise self._fail(f"version {reference!r}", exc) from exc

    def versions(self) -> list[str]:
        """The model's version numbers, lowest first.

        Raises:
            ModelSourceError: the server cannot be reached (an unknown model has none).
        """
        quote = '"' if "'" in self.model else "'"
        numbers: list[int] = []
        token: str | None = None
        try:
            while True:
                page = self._client.search_model_versions(
                    f"name = {quote}{self.model}{quote}", max_results=1000, page_token=token
                )
                numbers += [int(v.version) for v in page]
                token = page.token
                if not token:
                    return [str(n) for n in sorted(numbers)]
        except _errors() as exc:
            raise self._fail("versions", exc) from exc

    def fetch(self, version: str) -> ModelVersionFiles:
        """Version ``version`` on local disk, downloaded from the server the first time.

        Raises:
            ModelSourceError: no such version, its artifacts hold no model file (or several),
                or the server cannot be reached.
        """
        if not version.isdigit():
            raise ModelSourceError(
                f"MLflow model {self.model!r}: version {version!r} is not a version number"
            )
        folder = self.cache / version
        if not folder.is_dir():
            self.cache.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.cache))
            try:
                from mlflow.artifacts import download_artifacts

                local = download_artifacts(
                    artifact_uri=self._download_uri(version),
                    dst_path=str(partial),
                    tracking_uri=self.tracking_uri,
                )
                # a folder's download is <dst>/<its name>: that folder is the version
                (Path(local) if Path(local).is_dir() else partial).rename(folder)
            except _errors() as exc:
                raise self._fail(f"version {version!r}", exc) from exc
            finally:
                shutil.rmtree(partial, ignore_errors=True)
        return version_files(version, folder)

    def fingerprint(self, version: str) -> Fingerprint:
        """The downloaded copy's files (empty before the first :meth:`fetch`): a registered
        version's artifacts do not change, so a refused one is tried again only once its
        copy in :attr:`cache` was removed (or changed) by hand."""
        return folder_fingerprint(self.cache / version)

    def _download_uri(self, version: str) -> str:
        """Where the version's artifacts are stored. Resolved here, not by MLflow's
        ``models:/<name>/<version>`` download, which asks the process-wide registry URI rather
        than :attr:`tracking_uri` (MLflow 3.17)."""
        uri = self._client.get_model_version_download_uri(self.model, version)
        if uri.startswith("models:/"):  # an MLflow 3 logged model: models:/<model id>
            uri = self._client.get_logged_model(uri.removeprefix("models:/")).artifact_location
        return uri


def register_version(
    tracking_uri: str, model: str, model_file: Path, alias: str | None = None
) -> str:
    """Register ``model_file`` as a new version of ``model`` (created when missing).

    The file is logged as an artifact (under ``model/``) of a new run of the default
    experiment, registered from there, and, with ``alias``, that alias is moved to it.

    Returns:
        The new version number.

    Raises:
        ModelSourceError: the server refused or cannot be reached.
    """
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        run = client.create_run(experiment_id="0", run_name=f"{model} {model_file.name}")
        run_id = run.info.run_id
        client.log_artifact(run_id, str(model_file), artifact_path=ARTIFACT_PATH)
        client.set_terminated(run_id)
        try:
            client.create_registered_model(model)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        created = client.create_model_version(
            model, source=f"{run.info.artifact_uri}/{ARTIFACT_PATH}", run_id=run_id
        )
        version = str(created.version)
        if alias is not None:
            client.set_registered_model_alias(model, alias, version)
    except _errors() as exc:
        raise ModelSourceError(
            f"could not register {model_file} as a version of MLflow model {model!r} at "
            f"{_redact(tracking_uri)}: {_reason(exc)}"
        ) from exc
    return version
