"""streamproc: run PyTorch models over Kafka streams, at-least-once, with bounded memory.

Data flow (one message, in file order)::

    source.py     consumer thread: poll -> Record -> per-partition ring (pause/resume)
    buffers.py    rings + watermarks (pure)
    batcher.py    when to cut a batch (pure, injected clock)
    dispatch.py   cut at dispatch time, decode into a pinned staging slab
    worker/       staging pool, device worker (streams, events), completion thread
    results.py    encode results, dead-letter failures
    sink.py       idempotent acks=all producer, delivery reports
    commit.py     contiguous watermarks per assignment -> commits (by the source thread)

Embed it::

    from streamproc import Pipeline, load_config
    Pipeline(load_config("config.yaml")).run()
"""

from streamproc.config import Config, load_config
from streamproc.errors import ConfigError, StreamprocError
from streamproc.pipeline import Pipeline, RunSummary

__all__ = ["Config", "ConfigError", "Pipeline", "RunSummary", "StreamprocError", "load_config"]
__version__ = "0.1.0"
