"""The workload contract: codec + model for one kind of message.

A workload turns one record into one fixed-shape array row, runs a model over a batch of rows on
the device, and turns one output row back into an output message::

    decode(record, out)          record bytes + headers -> writes ``out`` (item_shape, item_dtype)
    model(batch)                 uint8/float tensor (n, *item_shape) on the device
                                 -> tuple of tensors, each (n, ...) on the device
    encode(record, outputs)      one row of each output (numpy, host) -> value bytes + headers

``decode`` runs on decode-pool threads and must only write into ``out`` (a view of a pinned
staging buffer owned by the worker's pool; never keep a reference to it). It raises
:class:`~streamproc.errors.DecodeError` for bad input, which sends the record to the
dead-letter topic. ``model`` must be pure per row (row ``i`` of each output depends only on row
``i`` of the input), return as many rows as it received, and not synchronise the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ValidationError

from streamproc.errors import DecodeError
from streamproc.records import Headers, Record

ModelFn = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
M = TypeVar("M", bound=BaseModel)


def source_coordinates(record: Record) -> dict[str, str | int]:
    """``{"topic", "partition", "offset"}`` of the input record, for result bodies."""
    return {"topic": record.tp.topic, "partition": record.tp.partition, "offset": record.offset}


def require_value(record: Record) -> bytes:
    """The record's value; DecodeError for a tombstone (null) or an empty value."""
    if record.value is None:
        raise DecodeError("tombstone record: value is null")
    if not record.value:
        raise DecodeError("empty value")
    return record.value


def parse_json(record: Record, schema: type[M]) -> M:
    """Validate the record's JSON value against a pydantic ``schema``.

    Raises:
        DecodeError: tombstone, empty, malformed JSON or schema violation (with the field).
    """
    try:
        return schema.model_validate_json(require_value(record))
    except ValidationError as exc:
        first = exc.errors()[0]
        kind = "malformed JSON" if first["type"] == "json_invalid" else "schema"
        where = ".".join(map(str, first["loc"])) or "<root>"
        raise DecodeError(f"{kind}: {first['msg']} at {where}") from exc


@dataclass(frozen=True)
class Encoded:
    """An output message body: value bytes plus extra headers."""

    value: bytes
    headers: Headers = ()


class Workload:
    """Base class for workloads; subclasses set the class attributes and override the methods.

    Attributes:
        name: workload name used in config and metrics.
        item_shape: shape of one decoded row.
        item_dtype: numpy dtype of one decoded row.
        default_priority: ``high``, ``normal`` or ``low``; the replay stamps it into the
            ``priority`` header (latency-critical trades high, IoT normal, video low).
    """

    name: str = "workload"
    default_priority: str = "normal"
    item_shape: tuple[int, ...] = ()
    item_dtype: np.dtype = np.dtype(np.uint8)

    def decode(self, record: Record, out: np.ndarray) -> None:
        """Write the decoded row of ``record`` into ``out``.

        Raises:
            DecodeError: malformed, empty or tombstone input.
        """
        raise NotImplementedError

    def build_model(self, device: torch.device) -> ModelFn:
        """Load the model onto ``device`` in eval mode and return the batch function."""
        raise NotImplementedError

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        """Serialise one result row (one row of each model output).

        Raises:
            EncodeError: the row cannot be serialised.
        """
        raise NotImplementedError
