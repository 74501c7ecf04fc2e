"""What crosses the decode stage's edges: the slab it fills, the decoder the dispatcher calls,
the per-row failures it answers, and the sample it reports to the decode sizer.

Decode comes before the device stage in the data flow, so it names what it needs of a staging
slab here (:class:`DecodeSlab`) instead of importing the device's ``Slab``, which satisfies it
structurally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from streamproc.errors import RecordError
from streamproc.records import Record

Failures = dict[int, RecordError]
"""Per failed row of a batch (its index in the batch and the slab), the error it is
dead-lettered with."""


class DecodeSlab(Protocol):
    """A leased staging slab as decode sees it.

    Attributes:
        index: the slab's position in its staging pool (decode processes map every slab of a
            shared pool and find this one by it).
        array: the rows, shape ``(rows, *item_shape)``, the workload's item dtype; decode writes
            row ``i`` for record ``i`` and nothing else. The lease holder owns the memory.
    """

    @property
    def index(self) -> int: ...

    @property
    def array(self) -> np.ndarray: ...


class Decoder(Protocol):
    """Fills a leased slab from a batch's records.

    Attributes:
        hold_probes: set by the lane's dispatcher (its one caller) while the lane measures its
            own route: the decoder starts no probe of its decode route meanwhile.
    """

    hold_probes: bool

    @property
    def probing(self) -> bool:
        """The decoder is measuring its decode route now (its batches alternate ways)."""
        ...

    def decode(self, records: Sequence[Record], slab: DecodeSlab) -> Failures:
        """Decode ``records[i]`` into ``slab.array[i]``; return the rows that failed.

        ``len(records)`` is at most the slab's row count. Rows past ``len(records)`` are left
        untouched; a failed row holds unspecified values."""
        ...


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decoded batch, as its decoder saw it.

    Attributes:
        lane: the pipeline's input topic.
        items: records in the batch (>= 1).
        decode_s: wall seconds the dispatcher waited for the batch's decode (every slice).
        workers: decode workers (threads or processes) running when the batch was split into
            slices.
    """

    lane: str
    items: int
    decode_s: float
    workers: int


OnSample = Callable[[DecodeSample], None]
"""Where a decoder reports each batch's decode time (:meth:`DecodeSizer.observe
<streamproc.decode.sizing.DecodeSizer.observe>`)."""
