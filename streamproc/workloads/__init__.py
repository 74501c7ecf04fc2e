"""Workloads: codec + model per kind of message, selected by name in config.

``load_workload(spec)`` accepts a built-in name (``video``) or ``package.module:factory`` (a
callable returning a :class:`~streamproc.workloads.base.Workload`, called with the pipeline's
``options`` as keyword arguments).
"""

from __future__ import annotations

import importlib
from typing import Any

from streamproc.errors import ConfigError
from streamproc.workloads.base import Encoded, ModelFn, Workload

__all__ = ["Encoded", "ModelFn", "Workload", "load_workload"]


def load_workload(spec: str, options: dict[str, Any] | None = None) -> Workload:
    """Instantiate the workload named by ``spec``.

    Raises:
        ConfigError: unknown name, unimportable module, or a factory that does not return a
            Workload.
    """
    options = options or {}
    if spec == "video":
        from streamproc.workloads.video import VideoWorkload

        return VideoWorkload(**options)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
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
    raise ConfigError(
        f"pipelines.workload: unknown workload {spec!r}; allowed: 'video' or "
        "'package.module:factory'"
    )
