"""Decode, the second stage: a cut batch's records become rows of a staging slab, off the
consumer thread, on decode threads or decode processes whose count is sized to the load.

Modules, in the order a batch meets them:

``protocol``
    What crosses the stage's edges: :class:`Decoder` (what the dispatcher calls),
    :class:`DecodeSlab` (what decode needs of a staging slab), ``Failures`` (per-row errors),
    :class:`DecodeSample` (what decoders report to the sizer).
``rows``
    Pure row helpers every decoder uses: refuse oversized values, split a batch into slices,
    decode a slice.
``threads``
    ``worker.decode_mode: thread`` (the default): :class:`DecodeThreads` in this process and
    :class:`ThreadDecoder`, which decodes each batch on them or inline on the lane's
    dispatcher thread.
``route``
    :class:`DecodeRoutePolicy`: per lane, on the decode threads or inline, by the measured cost
    per record of each way (``worker.decode_inline``).
``processes``, ``process_child``
    ``worker.decode_mode: process``: :class:`DecodeProcesses` and :class:`ProcessDecoder` in
    the consumer, and what runs inside each spawned decode process. ``process`` always decodes
    in the processes: a decoder that crashes must not take the consumer with it.
``sizing``
    :class:`DecodeSizingPolicy` (how many decode workers) and :class:`DecodeSizer`, the
    ``decode-sizer`` thread that applies it between ``worker.decode_workers_min`` and
    ``decode_workers_max`` (starting at ``worker.decode_workers``).

Every decoder checks ``worker.max_message_bytes`` in this process first, so an oversized value
is never decoded (nor shipped to a decode process); every decoder splits a batch into as many
slices as there are decode workers at that moment and reports each batch decoded on them to the
sizer. Measured trade-offs: ``docs/benchmarks.md``.
"""

from streamproc.decode.process_child import DecodeSpec
from streamproc.decode.processes import DecodeProcesses, ProcessDecoder
from streamproc.decode.protocol import Decoder, DecodeSample, DecodeSlab, Failures, OnSample
from streamproc.decode.route import DecodeRoutePolicy, Route, RouteChange
from streamproc.decode.sizing import DecodeSizer, DecodeSizingPolicy, DecodeWorkers, Resize
from streamproc.decode.threads import DecodeThreads, ThreadDecoder

__all__ = [
    "DecodeProcesses",
    "DecodeRoutePolicy",
    "DecodeSample",
    "DecodeSizer",
    "DecodeSizingPolicy",
    "DecodeSlab",
    "DecodeSpec",
    "DecodeThreads",
    "DecodeWorkers",
    "Decoder",
    "Failures",
    "OnSample",
    "ProcessDecoder",
    "Resize",
    "Route",
    "RouteChange",
    "ThreadDecoder",
]
