"""The versioned model of one pipeline (``pipelines[].model``): its source, the version serving
at start-up (loaded and warmed up on every device), the resident versions
(:class:`~streamproc.models.versions.ModelVersions`) and the ``models-<pipeline>`` thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamproc.assembly.shared import Shared
from streamproc.config.sections import ModelConfig, PipelineConfig
from streamproc.errors import ConfigError
from streamproc.logs import get_logger
from streamproc.models.loading import LoadedVersion, Loader, VersionRefused, load_version
from streamproc.models.manager import TRANSIENT, ModelManager
from streamproc.models.sources import (
    Fingerprint,
    FolderSource,
    ModelSource,
    ModelSourceError,
    ModelVersionFiles,
)
from streamproc.models.versions import ModelVersions
from streamproc.workloads import Workload

log = get_logger(__name__)

BOUNDARY_TIMEOUT_S = 60.0
"""Longest a version switch waits for the open transaction to end under exactly-once."""


@dataclass(frozen=True)
class VersionedModel:
    """A versioned pipeline's model parts (nothing started)."""

    versions: ModelVersions
    manager: ModelManager


def model_source(config: ModelConfig) -> ModelSource:
    """The source ``config`` names (``folder`` or ``mlflow``)."""
    if config.source == "mlflow":
        from streamproc.models.mlflow_source import MlflowSource  # the MLflow client: on use

        assert config.tracking_uri is not None  # validated
        return MlflowSource(config.tracking_uri, config.name)
    assert config.repository is not None  # validated
    return FolderSource(config.repository, config.name)


def version_loader(spec: PipelineConfig, workload: Workload, shared: Shared) -> Loader:
    """Loads a version of ``spec``'s model on every device at the pipeline's precision."""
    config = shared.config
    assert spec.model is not None
    index = config.pipelines.index(spec)
    precision = spec.precision or config.worker.precision
    key = "worker.precision" if spec.precision is None else f"pipelines.{index}.precision"
    devices = [d.device for d in shared.devices]
    rows, headroom = (
        spec.max_batch_rows(config.batching, workload.max_batch_size),
        spec.model.memory_headroom,
    )

    def load(files: ModelVersionFiles, serving: LoadedVersion | None) -> LoadedVersion:
        return load_version(files, workload, devices, precision, rows, serving, headroom, key)

    return load


def initial_version(
    spec: PipelineConfig, source: ModelSource, load: Loader
) -> tuple[LoadedVersion, dict[str, tuple[VersionRefused, Fingerprint]]]:
    """The version ``pipelines[].model.version`` names now in ``source``, loaded on every
    device (``load``: :func:`version_loader`). With ``latest``, a newest version that does
    not load is passed over for the next one (a bad upload never keeps the pipeline from
    starting while an older version loads); those passed over are returned, refused, with
    their files' fingerprint before the try (polling tries them again once it changes).

    Raises:
        ConfigError: no version can be found or loaded (naming the pipeline and the key).
    """
    assert spec.model is not None
    reference = spec.model.version
    refused: dict[str, tuple[VersionRefused, Fingerprint]] = {}
    try:
        names = [source.resolve(reference)]
        if reference == "latest":
            names = list(reversed(source.versions()))
        for name in names:
            fingerprint = source.fingerprint(name)
            try:
                loaded = load(source.fetch(name), None)
                break
            except (ModelSourceError, VersionRefused) as exc:
                if len(names) == 1:
                    raise
                refusal = (
                    exc if isinstance(exc, VersionRefused) else VersionRefused("source", str(exc))
                )
                refused[name] = (refusal, fingerprint)
                log.warning(
                    "model version passed over", pipeline=spec.name, version=name, error=str(exc)
                )
        else:
            detail = "; ".join(f"{name}: {exc}" for name, (exc, _) in refused.items())
            raise VersionRefused("load", f"no version loads ({detail})")
    except ModelSourceError as exc:
        raise ConfigError(f"pipelines[{spec.name!r}].model.{exc.key}: {exc}") from exc
    except VersionRefused as exc:
        raise ConfigError(
            f"pipelines[{spec.name!r}].model.version: {reference!r} from {source.describe()}: {exc}"
        ) from exc
    log.info(
        "model version serving",
        pipeline=spec.name,
        version=loaded.name,
        source=source.describe(),
        seconds=round(loaded.loaded_s, 3),
    )
    return loaded, refused


def version_boundary(shared: Shared) -> Callable[[], None] | None:
    """What a version switch waits for before the new version's first results (the
    guarantee's :meth:`~streamproc.offsets.guarantees.Guarantee.boundary`: under exactly-once
    the open transaction ended, the source thread asked to commit it now); None: nothing."""
    # never longer than a drain may take (a switch while stopping, the source thread gone)
    timeout_s = min(BOUNDARY_TIMEOUT_S, shared.config.shutdown_timeout_s / 2)
    boundary = shared.guarantee.boundary(shared.control.request_commit, timeout_s)
    if boundary is None:
        return None

    def wait() -> None:
        if not boundary():
            log.warning(
                "model version switch: the open transaction did not end in time; going on",
                timeout_s=timeout_s,
            )

    return wait


def build_versioned_model(
    spec: PipelineConfig, workload: Workload, shared: Shared
) -> VersionedModel:
    """The serving version (loaded now), the resident versions and the model thread of a
    versioned pipeline.

    Raises:
        ConfigError: the version ``pipelines[].model.version`` names cannot be found or loaded.
    """
    assert spec.model is not None
    source = model_source(spec.model)
    load = version_loader(spec, workload, shared)
    serving, passed_over = initial_version(spec, source, load)
    versions = ModelVersions(
        spec.input_topic, serving, spec.model, shared.metrics, version_boundary(shared)
    )
    manager = ModelManager(
        spec.name,
        spec.model,
        versions,
        source,
        load,
    )
    for name, (refusal, fingerprint) in passed_over.items():
        if refusal.reason not in TRANSIENT:  # polling tries a failed download again
            manager.refused_at_start(name, refusal, fingerprint)
    return VersionedModel(versions, manager)
