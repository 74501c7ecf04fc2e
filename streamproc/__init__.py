"""streamproc: run PyTorch models over Kafka streams, at-least-once (exactly-once opt-in),
with bounded memory.

The package is laid out by role: the stages ``intake`` -> ``decode`` -> ``device`` ->
``output``, over the Kafka seam (``kafka``) and the offset ledger (``offsets``); ``assembly``
builds them from the config and :class:`Pipeline` runs them. How a message flows through them,
which thread owns what, the queues and the lock order: ``docs/architecture.md``.

Embed it::

    from streamproc import Pipeline, load_config
    Pipeline(load_config("config.yaml")).run()


The pipeline (and with it the Kafka clients' newest API, the share-group consumer) is imported
on first use of :class:`Pipeline`, not with the package: a module that needs only the records,
the workloads or the config (the Quix Streams contender of ``streamproc bench``, which runs in
an environment pinned to an older ``confluent-kafka``) imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError, StreamprocError

if TYPE_CHECKING:
    from streamproc.pipeline import Pipeline, RunSummary

__all__ = ["Config", "ConfigError", "Pipeline", "RunSummary", "StreamprocError", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``Pipeline`` and ``RunSummary``, imported on first use (PEP 562)."""
    if name in ("Pipeline", "RunSummary"):
        from streamproc import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted({*globals(), *__all__})
