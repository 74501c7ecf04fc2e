"""Load one model version beside the serving one: memory check, one batch function per device
at the pipeline's precision, warm-up on zeros, and the output contract checked against the
serving version's.

Runs on the pipeline's ``models-<pipeline>`` thread (and once at start-up on the main thread),
never on a device thread: the serving version keeps running meanwhile.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from streamproc.device.backend import free_memory_bytes, on_stream, settle, side_stream
from streamproc.errors import StreamprocError
from streamproc.models.precision import build_model
from streamproc.models.sources import ModelVersionFiles
from streamproc.workloads.base import ModelFn, Workload
from streamproc.workloads.torchscript import generic_model, load_model_file

OutputSignature = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""Per model output, the shape of one row and the dtype."""


class VersionRefused(StreamprocError):
    """A version that must not serve; ``reason`` is one of ``source``, ``memory``, ``load``,
    ``warmup``, ``contract``, ``busy`` (the ``streamproc_model_refused_versions`` label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LoadedVersion:
    """A version resident on every device of the pipeline.

    Attributes:
        name: the version's name.
        fns: its batch function per device, in the order of the pipeline's devices.
        size_bytes: its size in bytes: the larger of its model file and its module's
            parameters and buffers (the memory check's estimate for the next version).
        signature: per output, one row's shape and its dtype (on zeros).
        loaded_s: seconds the load and warm-up took.
    """

    name: str
    fns: tuple[ModelFn, ...]
    size_bytes: int = 0
    signature: OutputSignature = ()
    loaded_s: float = 0.0


Loader = Callable[[ModelVersionFiles, LoadedVersion | None], LoadedVersion]
"""Loads a version's files on every device of a pipeline (the serving version, if any, for
the memory check beside it); see :func:`load_version`."""


class _VersionModel:
    """The pipeline's workload with one version's module: what
    :func:`~streamproc.models.precision.build_model` asks of a workload."""

    def __init__(self, workload: Workload, files: ModelVersionFiles) -> None:
        self._workload = workload
        self._files = files
        self.name = workload.name
        self.refused_precisions = workload.refused_precisions
        self.module_bytes = 0  # parameters and buffers of the loaded module, measured

    def load_module(self, device: torch.device) -> torch.nn.Module:
        module = self._load_module(device)
        self.module_bytes = max(self.module_bytes, module_bytes(module))
        return module

    def _load_module(self, device: torch.device) -> torch.nn.Module:
        files = self._files
        if files.model_file is not None:
            return load_model_file(files.model_file, device)
        assert files.plugin is not None
        module_name, _, attr = files.plugin.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        module = factory(device)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"plugin {files.plugin} returned {type(module).__name__}, not a Module")
        return module.eval()

    def bind_model(self, module: torch.nn.Module, device: torch.device) -> ModelFn:
        try:
            return self._workload.bind_model(module, device)
        except NotImplementedError:  # a workload that builds its own model only
            return generic_model(module)

    def build_model(self, device: torch.device) -> ModelFn:
        return self.bind_model(self.load_module(device), device)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_memory(
    files: ModelVersionFiles, devices: Sequence[torch.device], headroom: float, serving_bytes: int
) -> None:
    """Refuse a version that would not fit beside the serving one: each device needs
    ``headroom`` times the version's size free (its file's size, else the serving version's).

    Raises:
        VersionRefused: reason ``memory``, naming the device and both numbers.
    """
    needed = int(max(files.size_bytes, serving_bytes) * headroom)
    for device in devices:
        free = free_memory_bytes(device)
        if free < needed:
            raise VersionRefused(
                "memory",
                f"version {files.version} needs {needed} bytes free on {device} "
                f"(model.memory_headroom={headroom} x {max(files.size_bytes, serving_bytes)}), "
                f"{free} free",
            )


def signature_of(outputs: Sequence[torch.Tensor]) -> OutputSignature:
    """Per output, one row's shape and the dtype."""
    return tuple((tuple(out.shape[1:]), out.dtype) for out in outputs)


def output_signature(
    fn: ModelFn, workload: Workload, device: torch.device, rows: int
) -> OutputSignature:
    """Run ``fn`` on zeros of every power-of-two batch size up to ``rows`` and ``rows`` (the
    sizes the adaptive batcher cuts), each checked to return that many rows.

    Returns:
        The output signature.

    Raises:
        VersionRefused: reason ``warmup``, with what the model raised or returned.
    """
    sizes = sorted({*(2**i for i in range(rows.bit_length()) if 2**i <= rows), rows})
    signature: OutputSignature = ()
    dtype = torch.from_numpy(np.zeros(1, dtype=workload.item_dtype)).dtype
    stream = side_stream(device)
    for size in sizes:
        try:
            with torch.inference_mode(), on_stream(stream):
                # made on the side stream: filled before the call reads it, in stream order,
                # and its memory is not reused by another stream while the call runs
                x = torch.zeros((size, *workload.item_shape), dtype=dtype, device=device)
                outputs = fn(x)
            if stream is not None:
                stream.synchronize()
        except Exception as exc:
            raise VersionRefused(
                "warmup", f"warm-up on {size} zero rows raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(outputs, tuple) or any(
            not isinstance(o, torch.Tensor) or o.shape[0] != size for o in outputs
        ):
            raise VersionRefused(
                "warmup", f"warm-up on {size} rows returned {_shapes(outputs)}, not {size} rows"
            )
        signature = signature_of(outputs)
    return signature


def load_version(
    files: ModelVersionFiles,
    workload: Workload,
    devices: Sequence[torch.device],
    precision: str,
    rows: int,
    serving: LoadedVersion | None = None,
    headroom: float = 1.5,
    key: str = "worker.precision",
) -> LoadedVersion:
    """Load ``files`` on every device at ``precision``, warm it up (``rows``: the largest
    batch), and check its outputs against ``serving``'s (same count, row shapes and dtypes:
    the encoder and the output buffers expect them).

    Raises:
        VersionRefused: reason ``memory``, ``load``, ``warmup`` or ``contract``.
    """
    started = time.perf_counter()
    check_memory(files, devices, headroom, 0 if serving is None else serving.size_bytes)
    model = _VersionModel(workload, files)
    view = cast(Workload, model)
    fns: list[ModelFn] = []
    signature: OutputSignature = ()
    for device in devices:
        try:
            fn = build_model(view, device, precision, key)
        except Exception as exc:
            raise VersionRefused(
                "load", f"version {files.version} does not load: {type(exc).__name__}: {exc}"
            ) from exc
        signature = output_signature(fn, workload, device, rows)
        settle(device)
        fns.append(fn)
    if serving is not None and serving.signature and signature != serving.signature:
        raise VersionRefused(
            "contract",
            f"version {files.version} returns {_described(signature)}, the serving version "
            f"{serving.name} {_described(serving.signature)}",
        )
    size = max(files.size_bytes, model.module_bytes)  # a plug-in has no file: measured
    return LoadedVersion(files.version, tuple(fns), size, signature, time.perf_counter() - started)


def _shapes(outputs: object) -> object:
    """What a model returned, for messages: tensor shapes, other values' type names."""
    if not isinstance(outputs, tuple):
        return type(outputs).__name__
    return [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outputs]


def _described(signature: OutputSignature) -> str:
    return "[" + ", ".join(f"{list(shape)} {dtype}" for shape, dtype in signature) + "]"
