"""A user model as a TorchScript file, with a generic JSON-array codec.

Config::

    workload: /models/scorer.pt          # TorchScript (.pt, .ts) or torch.export (.pt2)
    options: {input_shape: [16], dtype: float32}

A ``.pt2`` program must be exported with a dynamic batch dimension
(``dynamic_shapes={"x": {0: torch.export.Dim("batch")}}``) to take any batch size.

Message value: a JSON array (nested to ``input_shape``) of numbers. The scripted module is called
with a ``(n, *input_shape)`` tensor of ``dtype`` on the device and must return one tensor or a
tuple of tensors with ``n`` rows. Output value: ``{"outputs": [row of each output as JSON],
"source": {...}}``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import torch

from streamproc.errors import ConfigError, DecodeError
from streamproc.records import Record
from streamproc.workloads.base import Encoded, ModelFn, Workload, require_value, source_coordinates


class TorchScriptWorkload(Workload):
    """Run a TorchScript file over JSON-array messages.

    Args:
        path: the ``.pt``/``.ts`` file saved with ``torch.jit.save``.
        input_shape: shape of one message's array.
        dtype: numpy dtype name of the input rows.

    Raises:
        ConfigError: the file does not exist or the options are invalid.
    """

    name = "torchscript"

    def __init__(self, path: str, input_shape: list[int], dtype: str = "float32") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"pipelines.workload: TorchScript file {path!r} does not exist")
        if not input_shape or any(int(d) < 1 for d in input_shape):
            raise ConfigError(f"pipelines.options.input_shape: positive ints, got {input_shape}")
        try:
            self.item_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigError(f"pipelines.options.dtype: unknown dtype {dtype!r}") from exc
        self.item_shape = tuple(int(d) for d in input_shape)

    def decode(self, record: Record, out: np.ndarray) -> None:
        value = require_value(record)
        try:
            values = np.asarray(orjson.loads(value), dtype=self.item_dtype)
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"malformed JSON: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"schema: not a numeric array: {exc}") from exc
        if values.shape != self.item_shape:
            raise DecodeError(
                f"schema: shape {list(values.shape)}, expected {list(self.item_shape)}"
            )
        out[...] = values

    def load_module(self, device: torch.device) -> torch.nn.Module:
        return load_model_file(self.path, device)

    def bind_model(self, module: torch.nn.Module, device: torch.device) -> ModelFn:
        return generic_model(module)

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return Encoded(
            orjson.dumps(
                {
                    "outputs": [np.asarray(o).tolist() for o in outputs],
                    "source": source_coordinates(record),
                }
            )
        )


def load_model_file(path: Path, device: torch.device) -> torch.nn.Module:
    """A TorchScript (``*.pt``, ``*.ts``) or ``torch.export`` (``*.pt2``) file as an eval-mode
    module on ``device``.

    Raises:
        Exception: whatever torch raises for an unreadable file (the caller names it).
    """
    if path.suffix == ".pt2":  # torch.export program (the successor of TorchScript)
        return torch.export.load(str(path)).module().to(device)
    module: torch.nn.Module = torch.jit.load(  # type: ignore[no-untyped-call]  # unannotated
        str(path), map_location=device
    )
    return module.eval()


def generic_model(module: torch.nn.Module) -> ModelFn:
    """The batch function of a module that takes the batch and returns one tensor or a tuple
    of tensors, each with the batch's rows."""

    @torch.inference_mode()
    def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = module(batch)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    return run
