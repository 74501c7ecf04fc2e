"""Workloads: codec + model per kind of message, selected by name in config.

``load_workload(spec, options)`` accepts:

* a built-in name (:data:`~streamproc.workloads.registry.BUILTIN_WORKLOADS`: ``video``,
  ``iot``, ``trades``);
* a TorchScript file path ending in ``.pt`` or ``.ts``, or a ``torch.export`` program saved
  as ``.pt2`` (generic JSON-array codec; options ``input_shape`` and ``dtype``);
* ``package.module:factory``: a callable returning a :class:`~streamproc.workloads.base.Workload`,
  called with the pipeline's ``options`` as keyword arguments. The working directory is
  importable, as with ``python -m``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from streamproc.errors import ConfigError
from streamproc.workloads.base import (
    Encoded,
    ModelFn,
    Workload,
    parse_json,
    require_value,
    source_coordinates,
)
from streamproc.workloads.registry import (
    BUILTIN_WORKLOADS,
    MAX_BATCH_SIZE_LIMIT,
    BuiltinWorkload,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "BuiltinWorkload",
    "Encoded",
    "ModelFn",
    "Workload",
    "load_workload",
    "parse_json",
    "require_value",
    "source_coordinates",
]


def load_workload(spec: str, options: dict[str, Any] | None = None) -> Workload:
    """Instantiate the workload named by ``spec``.

    Raises:
        ConfigError: unknown name, missing file, unimportable module, bad options, a factory
            that does not return a Workload, or a workload whose ``max_batch_size`` is not an
            integer from 1 to 4096.
    """
    workload = _instantiate(spec, dict(options or {}))
    size = workload.max_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH_SIZE_LIMIT:
        raise ConfigError(
            f"pipelines.workload: {spec!r} has max_batch_size {size!r}; allowed: an integer "
            f"from 1 to {MAX_BATCH_SIZE_LIMIT} (or set pipelines[].max_batch_size)"
        )
    return workload


def _instantiate(spec: str, options: dict[str, Any]) -> Workload:
    try:
        if spec in BUILTIN_WORKLOADS:
            return BUILTIN_WORKLOADS[spec].load_class()(**options)
        if spec.endswith((".pt", ".ts", ".pt2")):
            from streamproc.workloads.torchscript import TorchScriptWorkload

            return TorchScriptWorkload(spec, **options)
        if ":" in spec:
            return _from_factory(spec, options)
    except TypeError as exc:
        raise ConfigError(f"pipelines.options for {spec!r}: {exc}") from exc
    raise ConfigError(
        f"pipelines.workload: unknown workload {spec!r}; "
        f"allowed: one of {list(BUILTIN_WORKLOADS)}, "
        "a TorchScript (*.pt, *.ts) or torch.export (*.pt2) file path or 'package.module:factory'"
    )


def _from_factory(spec: str, options: dict[str, Any]) -> Workload:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"pipelines.workload: cannot load {spec!r}: {exc}") from exc
    workload = factory(**options)
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"pipelines.workload: {spec!r} returned {type(workload).__name__}, "
            "expected a streamproc.workloads.Workload"
        )
    return workload
