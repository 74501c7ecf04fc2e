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

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import numpy as np
import orjson
import torch
from pydantic import BaseModel, TypeAdapter, ValidationError

from streamproc.errors import ConfigError, DecodeError, RecordError, RegistryUnavailable
from streamproc.records import Headers, Priority, Record

if TYPE_CHECKING:
    from streamproc.schemas.writers import WriterSchemas

ModelFn = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


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


@overload
def parse_json(record: Record, schema: type[M]) -> M: ...
@overload
def parse_json(record: Record, schema: TypeAdapter[T]) -> T: ...
def parse_json(record: Record, schema: type[BaseModel] | TypeAdapter[Any]) -> Any:
    """Parse the record's JSON value with orjson and validate it against a pydantic model class
    or ``TypeAdapter`` (a ``TypedDict`` adapter validates the same constraints without building
    a model object: about half the time per message, measured on the trades schema).

    orjson is strict RFC 8259 (no ``NaN``/``Infinity``, no number beyond the float range);
    pydantic's own JSON parser accepts ``NaN``. The built-in trades and iot workloads decode
    with msgspec instead (:mod:`streamproc.workloads.codecs`: same strictness, a third to a
    half of the time); this helper stays for workloads whose schema is a pydantic model.

    Raises:
        DecodeError: tombstone, empty, malformed JSON or schema violation (with the field).
    """
    value = require_value(record)
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from exc
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_python(data)
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "<root>"
        raise DecodeError(f"schema: {first['msg']} at {where}") from exc


class Encoded:
    """An output message body: value bytes plus extra headers. Treated as immutable.

    A plain class with slots, not a frozen dataclass: one is built per result, and a frozen
    dataclass costs 320 ns to build against 120 ns (``timeit`` on this machine, issue 15).

    Attributes:
        value: the result's value bytes.
        headers: extra ``(name, value bytes)`` headers of the result (after streamproc's own).
    """

    __slots__ = ("headers", "value")

    def __init__(self, value: bytes, headers: Headers = ()) -> None:
        self.value = value
        self.headers = headers

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Encoded):
            return NotImplemented
        return self.value == other.value and self.headers == other.headers

    def __hash__(self) -> int:
        return hash((self.value, self.headers))

    def __repr__(self) -> str:
        return f"Encoded({self.value!r}, {self.headers!r})"


class Workload:
    """Base class for workloads; subclasses set the class attributes and override the methods.

    Attributes:
        name: workload name used in config and metrics.
        item_shape: shape of one decoded row.
        item_dtype: numpy dtype of one decoded row.
        default_priority: the class of a record without a ``priority`` header (a
            :class:`~streamproc.records.Priority`, or its name: ``high``, ``normal``, ``low``);
            the replay stamps it into the header (trades high, IoT normal, video low).
        max_batch_size: the largest batch of its pipelines where neither
            ``pipelines[].max_batch_size`` nor ``batching.max_batch_size`` is set (rows;
            built-ins from the registry: trades and iot 64, video 4; 4 unless a subclass
            says more: a model of unknown cost per row starts with small batches).
        refused_precisions: precision name (``worker.precision``) -> why this workload's
            model must not run at it (measured); refused at start-up with that reason.
        ordered: its results must follow their inputs' order per key (a stateful workload,
            as ``pipelines[].ordered`` declares it): a share group (``kafka.group_type:
            share``), which keeps no order, is refused for it at start-up.
    """

    name: str = "workload"
    default_priority: Priority | str = Priority.NORMAL
    item_shape: tuple[int, ...] = ()
    item_dtype: np.dtype = np.dtype(np.uint8)
    max_batch_size: int = 4
    refused_precisions: Mapping[str, str] = MappingProxyType({})
    input_formats: tuple[str, ...] = ("json",)
    ordered: bool = False

    def use_input_format(self, name: str, writers: WriterSchemas | None) -> None:
        """Read message values in format ``name`` (``pipelines[].format``), the writer schemas
        coming from ``writers`` (the pipeline's Schema Registry; None without one). The
        default reads only the workload's own format.

        Raises:
            ConfigError: the workload does not read ``name`` (names the formats it reads).
        """
        if name not in self.input_formats:
            raise ConfigError(
                f"pipelines.format: workload {self.name!r} reads {list(self.input_formats)}, "
                f"not {name!r}"
            )

    def result_schema(self) -> dict[str, Any]:
        """The Avro schema of this workload's results (``pipelines[].output_format: avro``).

        Raises:
            ConfigError: the workload has none (the default).
        """
        raise ConfigError(
            f"pipelines.output_format: workload {self.name!r} writes JSON results only"
        )

    def result_json_schema(self) -> dict[str, Any]:
        """The JSON Schema of this workload's results (``output_format: jsonschema``).

        Raises:
            ConfigError: the workload has none (the default).
        """
        raise ConfigError(
            f"pipelines.output_format: workload {self.name!r} has no JSON Schema of its results"
        )

    def result_message(self) -> type[Any]:
        """The generated Protobuf class of this workload's results
        (``pipelines[].output_format: protobuf``).

        Raises:
            ConfigError: the workload has none (the default).
        """
        raise ConfigError(
            f"pipelines.output_format: workload {self.name!r} writes JSON results only"
        )

    def use_output_format(self, name: str, serializer: Callable[[Any], bytes] | None) -> None:
        """Write results in format ``name`` (``pipelines[].output_format``); ``serializer``
        turns one result into value bytes (None for ``json``). The default writes JSON only.

        Raises:
            ConfigError: the workload does not write ``name``.
        """
        if name != "json":
            raise ConfigError(
                f"pipelines.output_format: workload {self.name!r} writes ['json'], not {name!r}"
            )

    def decode(self, record: Record, out: np.ndarray) -> None:
        """Write the decoded row of ``record`` into ``out``.

        Raises:
            DecodeError: malformed, empty or tombstone input.
        """
        raise NotImplementedError

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        """Write the decoded row of ``records[i]`` into ``rows[i]`` for every ``i``.

        ``rows`` is a view of ``(len(records), *item_shape)`` ``item_dtype`` staging rows. This
        is what the decode pool calls, once per slice of a batch (per run of rows between those
        refused up front, e.g. oversized values). The default calls
        :meth:`decode` per record; workloads whose per-message cost is a few microseconds
        override it to parse per record and compute features once per slice (numpy).

        Returns:
            Per failed index into ``records``, its error (the other rows are written); an
            unexpected exception from :meth:`decode` becomes a :class:`DecodeError` naming it.
        """
        failed: dict[int, RecordError] = {}
        decode = self.decode
        for index, record in enumerate(records):
            try:
                decode(record, rows[index])
            except RecordError as exc:
                failed[index] = exc
            except RegistryUnavailable:
                raise  # the Schema Registry's state, not the record's fault
            except Exception as exc:
                failed[index] = DecodeError(f"{type(exc).__name__}: {exc}")
        return failed

    def build_model(self, device: torch.device) -> ModelFn:
        """Load the model onto ``device`` in eval mode and return the batch function.

        The default is ``bind_model(load_module(device), device)``. A workload may override
        this method instead of those two; it then runs at ``fp32``, ``bf16`` and ``fp16``
        (autocast around the batch function) but not at ``int8``, which converts the weights
        of the module and so needs :meth:`load_module` (``streamproc.models.precision``).
        """
        return self.bind_model(self.load_module(device), device)

    def load_module(self, device: torch.device) -> torch.nn.Module:
        """The model as an eval-mode ``torch.nn.Module`` on ``device``, float32 weights, loaded
        offline (from a package or the repository).

        Raises:
            NotImplementedError: the workload builds its batch function in
                :meth:`build_model` only (``int8`` is then refused at start-up).
        """
        raise NotImplementedError

    def bind_model(self, module: torch.nn.Module, device: torch.device) -> ModelFn:
        """The batch function around ``module`` (what :meth:`load_module` returned, possibly
        converted, e.g. dynamically quantised): pre-processing on the device, the module, and
        post-processing to the workload's outputs."""
        raise NotImplementedError

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        """Serialise one result row (one row of each model output).

        Raises:
            EncodeError: the row cannot be serialised.
        """
        raise NotImplementedError

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        """Serialise one batch's results: ``outputs`` are the model outputs (n, ...) on the
        host, row ``i`` belonging to ``records[i]``. Only rows that decoded are passed.

        This is what the result handler calls, once per batch. The default calls :meth:`encode`
        per row; light workloads override it to convert outputs to Python numbers once per
        batch (``ndarray.tolist()``) instead of once per value.

        Returns:
            Per record, its :class:`Encoded` or the exception its encode raised (that row is
            retried alone with :meth:`encode`, then dead-lettered with stage ``encode``).
        """
        results: list[Encoded | Exception] = []
        encode = self.encode
        for index, record in enumerate(records):
            try:
                results.append(encode(record, tuple(out[index] for out in outputs)))
            except Exception as exc:
                results.append(exc)
        return results
