"""The one registry of built-in workloads: class, replay data and default priority per name.

Config validation (``pipelines[].workload``), :func:`~streamproc.workloads.load_workload`, the
built-in classes' ``default_priority``, the replayer (``streamproc produce``), the demo and the
bench all read :data:`BUILTIN_WORKLOADS`; nothing else spells the list. Adding a built-in
workload is one entry here plus its module.

Classes and replay functions are named as ``"module:attribute"`` and imported on first use, so
reading the registry (as config validation does) imports none of the built-in modules: no
model, codec or recording.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from streamproc.records import PRIORITY_HEADER, Priority

if TYPE_CHECKING:
    from streamproc.records import Headers
    from streamproc.workloads.base import Workload


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


MAX_BATCH_SIZE_LIMIT = 4096
"""The largest accepted ``max_batch_size``: ``batching``, ``pipelines[]`` or a workload's own."""


@dataclass(frozen=True)
class BuiltinWorkload:
    """One built-in workload.

    Attributes:
        name: the name ``pipelines[].workload`` and ``streamproc produce`` take.
        workload_class: ``"module:Class"`` of its :class:`~streamproc.workloads.base.Workload`.
        replay_messages: ``"module:function"`` returning the endless stream of distinct
            ``(key, value, headers)`` replay messages from its real recording (headers without
            ``priority``: the replayer adds :attr:`default_priority`).
        recording_size: ``"module:function"`` returning the distinct messages in one pass.
        default_priority: the class of a record without a ``priority`` header, and the
            header the replayer stamps on every message.
        max_batch_size: its pipelines' largest batch unless config sets one
            (``Workload.max_batch_size``): light records (trades, iot) 64, so a batch's fixed
            costs are spread over many rows (capacity 3-5x that at 4) while a batch's cycle
            stays short; under overload iot kept 0.43-0.92 of its capacity in time at 64,
            0.17-0.28 at 256 (docs/benchmarks.md, "Batch sizes per workload"); video 4 (a
            frame's model call is most of its cost; a batch of 4 keeps a CPU lane's cycle
            short).
        demo_messages, demo_rate_msg_s: what ``streamproc demo`` replays (messages, open-loop
            rate): about 26 s each, within what a 2-core CPU machine serves for all built-ins
            at once.
    """

    name: str
    workload_class: str
    replay_messages: str
    recording_size: str
    default_priority: Priority
    max_batch_size: int
    demo_messages: int
    demo_rate_msg_s: float

    def load_class(self) -> type[Workload]:
        """The workload class (imports its module)."""
        cls: type[Workload] = _resolve(self.workload_class)
        return cls

    def messages(self) -> Iterator[tuple[bytes, bytes, Headers]]:
        """The endless replay stream: ``(key, value, headers)`` with the ``priority`` header."""
        priority = (PRIORITY_HEADER, self.default_priority.label.encode())
        for key, value, headers in _resolve(self.replay_messages)():
            yield key, value, (*headers, priority)

    def size(self) -> int:
        """Distinct messages in one pass over the recording."""
        size: int = _resolve(self.recording_size)()
        return size


BUILTIN_WORKLOADS: Mapping[str, BuiltinWorkload] = MappingProxyType(
    {
        w.name: w
        for w in (
            BuiltinWorkload(
                "video",
                "streamproc.workloads.video:VideoWorkload",
                "streamproc.workloads.video:replay_messages",
                "streamproc.workloads.video:recording_size",
                default_priority=Priority.LOW,
                max_batch_size=4,
                demo_messages=370,
                demo_rate_msg_s=14.0,
            ),
            BuiltinWorkload(
                "iot",
                "streamproc.workloads.iot:IotWorkload",
                "streamproc.workloads.iot:replay_messages",
                "streamproc.workloads.iot:recording_size",
                default_priority=Priority.NORMAL,
                max_batch_size=64,
                demo_messages=536,
                demo_rate_msg_s=20.0,
            ),
            BuiltinWorkload(
                "trades",
                "streamproc.workloads.trades:TradesWorkload",
                "streamproc.workloads.trades:replay_messages",
                "streamproc.workloads.trades:recording_size",
                default_priority=Priority.HIGH,
                max_batch_size=64,
                demo_messages=3600,
                demo_rate_msg_s=140.0,
            ),
        )
    }
)
"""Built-in workloads by name, in the order the CLI, demo and error messages list them."""
