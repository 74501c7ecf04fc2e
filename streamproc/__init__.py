"""streamproc: run PyTorch models over Kafka streams, at-least-once (exactly-once opt-in),
with bounded memory.

The package is laid out by role: the stages ``intake`` -> ``decode`` -> ``device`` ->
``output``, over the Kafka seam (``kafka``) and the offset ledger (``offsets``); ``assembly``
builds them from the config and :class:`Pipeline` runs them. How a message flows through them,
which thread owns what, the queues and the lock order: ``docs/architecture.md``.

Embed it::

    from streamproc import Pipeline, load_config
    Pipeline(load_config("config.yaml")).run()
"""

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError, StreamprocError
from streamproc.pipeline import Pipeline, RunSummary

__all__ = ["Config", "ConfigError", "Pipeline", "RunSummary", "StreamprocError", "load_config"]
__version__ = "0.1.0"
