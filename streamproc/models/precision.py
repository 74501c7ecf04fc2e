"""Model precision per pipeline: ``fp32 | bf16 | fp16 | int8`` (``worker.precision``, or a
``pipelines[].precision`` of its own).

One function turns a workload into its batch function at the requested precision::

    fp32   workload.build_model(device)                       unchanged
    bf16   autocast(device, bfloat16) around the batch function, floating outputs -> float32
    fp16   autocast(device, float16)  around the batch function, floating outputs -> float32
    int8   quantize_dynamic(workload.load_module(cpu), {Linear}, qint8) -> workload.bind_model

Why these mechanisms (the measurements: docs/models.md "Precision"):

* **Autocast, not converted weights, for bf16/fp16.** Autocast runs matmuls and convolutions
  at the low precision and keeps what needs range or accuracy (softmax, reductions,
  normalisation of the input) in float32; it works for every batch function, including a user's
  ``build_model`` or a TorchScript file.
* **int8 is dynamic quantisation of ``torch.nn.Linear`` layers** (weights int8 ahead of time,
  activations quantised per batch): no calibration data, CPU kernels only (fbgemm/x86/qnnpack).
  It needs the workload's module (:meth:`~streamproc.workloads.Workload.load_module`). It uses
  ``torch.ao.quantization.quantize_dynamic``, deprecated in favour of ``torchao`` (not a
  dependency here) but present and working in the pinned torch; its deprecation warning is
  silenced at this one call.

Dtypes. The staging slab keeps the workload's decoded dtype (video: uint8, 150,528 B per frame,
already half of what fp16 would be; iot/trades: float32 rows of 512/16 B); the cast to the
compute dtype happens on the device after the host-to-device copy, never on the host. Every
bfloat16/float16 output is cast to float32 on the device before the copy back, so the pinned
output buffers, numpy (which has no bfloat16) and the encoders always see float32; int8 models
return float32 already.

Where each runs (:func:`check_precision`, at start-up):

=========  ==============================  ====================================================
precision  cpu                             cuda
=========  ==============================  ====================================================
fp32       yes                             yes
bf16       yes (warns without native bf16  on compute capability 8.0 or newer (Ampere on),
           kernels: it is then emulated)    of the worker's GPU (not ``is_bf16_supported()``)
fp16       refused: emulated on CPUs        yes
           without native fp16 kernels
int8       when torch has a quantized       refused: the dynamic int8 kernels are CPU-only
           CPU engine
=========  ==============================  ====================================================
"""

from __future__ import annotations

import warnings
from typing import Literal, get_args

import torch

from streamproc.errors import ConfigError
from streamproc.logs import get_logger
from streamproc.workloads.base import ModelFn, Workload

log = get_logger(__name__)

Precision = Literal["fp32", "bf16", "fp16", "int8"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
"""Every precision name config accepts, in the order errors list them."""

AUTOCAST_DTYPES: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The compute dtype of the autocast precisions."""

_QUANTIZED_ENGINES = ("x86", "fbgemm", "qnnpack", "onednn")

BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bf16 tensor-core hardware (Ampere)."""


def supported_precisions(device: torch.device) -> tuple[Precision, ...]:
    """The precisions :func:`check_precision` accepts on ``device`` (see the module table)."""
    if device.type == "cpu":
        found: list[Precision] = ["fp32", "bf16"]
        if _quantized_engine() is not None:
            found.append("int8")
        return tuple(found)
    if device.type == "cuda":
        bf16: tuple[Precision, ...] = ("bf16",) if _native_cuda_bf16(device) else ()
        return ("fp32", *bf16, "fp16")
    return ("fp32",)


def check_precision(
    precision: str,
    device: torch.device,
    key: str = "worker.precision",
    workload: Workload | None = None,
) -> None:
    """Refuse a precision the device cannot run well, or that ``workload`` refuses (its
    :attr:`~streamproc.workloads.Workload.refused_precisions`), naming ``key``, the reason and
    what is allowed.

    Args:
        precision: one of :data:`PRECISIONS`.
        device: where the model will run.
        key: the config key the value came from (``worker.precision`` or
            ``pipelines.<i>.precision``), for the message.
        workload: the workload whose model will run, if known.

    Raises:
        ConfigError: unknown precision, one ``device`` does not support or one the workload
            refuses; the message says why and lists the precisions allowed.
    """
    allowed = supported_precisions(device)
    refused = {} if workload is None else dict(workload.refused_precisions)
    if precision in allowed and precision in refused:
        assert workload is not None
        fits = [p for p in allowed if p not in refused]
        raise ConfigError(
            f"{key}: workload {workload.name!r} refuses {precision}: {refused[precision]} "
            f"(got {precision!r}); allowed for it on {device.type}: {fits}"
        )
    if precision in allowed:
        if precision == "bf16" and device.type == "cpu" and not _native_cpu("bf16"):
            log.warning(
                "bf16 on a CPU without native bf16 kernels (AVX512-BF16 or AMX): emulated, "
                "likely slower than fp32",
                key=key,
            )
        return
    if precision not in PRECISIONS:
        why = "unknown precision"
    elif precision == "fp16" and device.type == "cpu":
        native = "yes" if _native_cpu("fp16") else "no"
        why = (
            "fp16 is refused on cpu: torch emulates it on CPUs without native fp16 kernels "
            "(EfficientNet-Lite0 took 9-14x the CPU time of fp32 where it was measured), "
            f"and it is unmeasured on CPUs with them (native fp16 kernels here: {native}); "
            "bf16 gives the same halved precision with fp32's range"
        )
    elif precision == "int8" and device.type != "cpu":
        why = f"int8 is dynamic quantisation, whose kernels run on cpu only, not {device.type}"
    elif precision == "int8":
        why = "this torch build has no quantized CPU engine (x86, fbgemm or qnnpack)"
    elif precision == "bf16" and device.type == "cuda":
        found = "none found"
        if torch.cuda.is_available():
            found = "compute capability {}.{}".format(*torch.cuda.get_device_capability(device))
        why = (
            f"{device} ({found}) has no bf16 hardware: bf16 needs "
            f"compute capability {BF16_CAPABILITY[0]}.{BF16_CAPABILITY[1]} or newer (older "
            "GPUs emulate it)"
        )
    else:
        why = f"{precision} is not supported on {device.type}"
    raise ConfigError(
        f"{key}: {why} (got {precision!r}); allowed on {device.type}: {list(allowed)}"
    )


def build_model(
    workload: Workload,
    device: torch.device,
    precision: str,
    key: str = "worker.precision",
    check: bool = True,
) -> ModelFn:
    """The workload's batch function on ``device`` at ``precision``.

    Args:
        workload: the pipeline's workload.
        device: where the model runs.
        precision: one of :data:`PRECISIONS`.
        key: config key named in errors.
        check: run :func:`check_precision` first (benchmarks pass False to measure a refused
            combination, e.g. fp16 on CPU).

    Returns:
        A :data:`~streamproc.workloads.ModelFn`: the same inputs (the staging dtype) and output
        shapes as at fp32, floating outputs float32.

    Raises:
        ConfigError: the precision is refused on ``device`` (see :func:`check_precision`), or
            ``int8`` for a workload without :meth:`~streamproc.workloads.Workload.load_module`
            or without a ``torch.nn.Linear`` layer to quantise.
    """
    if check:
        check_precision(precision, device, key, workload)
    if precision == "fp32":
        return workload.build_model(device)
    if precision == "int8":
        return _dynamic_int8(workload, device, key)
    if precision in AUTOCAST_DTYPES:
        return autocast(workload.build_model(device), device, AUTOCAST_DTYPES[precision])
    raise ConfigError(f"{key}: unknown precision {precision!r}; allowed: {list(PRECISIONS)}")


def autocast(model: ModelFn, device: torch.device, dtype: torch.dtype) -> ModelFn:
    """Run ``model`` under ``torch.autocast(device.type, dtype)``; bfloat16/float16 outputs
    come back as float32 (cast on the device, before the copy to the host)."""

    def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.autocast(device.type, dtype=dtype):
            outputs = model(batch)
        return tuple(_as_float32(out) for out in outputs)

    return run


def _as_float32(out: torch.Tensor) -> torch.Tensor:
    return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out


def _dynamic_int8(workload: Workload, device: torch.device, key: str) -> ModelFn:
    try:
        module = workload.load_module(torch.device("cpu"))
    except NotImplementedError:
        raise ConfigError(
            f"{key}: int8 needs the workload's module (Workload.load_module) to quantise its "
            f"weights; workload {workload.name!r} only provides build_model; "
            "allowed for it: ['fp32', 'bf16', 'fp16']"
        ) from None
    engine = _quantized_engine()
    if engine is not None and torch.backends.quantized.engine != engine:
        torch.backends.quantized.engine = engine  # process-wide; "none" before: nothing used it
    with warnings.catch_warnings():
        # torch.ao.quantization (and the qint8 tensors it makes) are deprecated for torchao,
        # which is not a dependency; they work in the pinned torch.
        warnings.filterwarnings("ignore", message=r"(?s).*torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r"(?s).*quantized tensor creation functions")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
        from torch.ao.quantization import quantize_dynamic

        quantized = quantize_dynamic(  # type: ignore[no-untyped-call]
            module, {torch.nn.Linear}, dtype=torch.qint8, inplace=False
        )
    layers = sum(isinstance(m, DynamicQuantizedLinear) for m in quantized.modules())
    if layers == 0:
        raise ConfigError(
            f"{key}: int8 quantises torch.nn.Linear layers and workload {workload.name!r} "
            "has none; allowed for it: ['fp32', 'bf16']"
        )
    return workload.bind_model(quantized, device)


def _quantized_engine() -> str | None:
    """The quantized CPU engine to use: the current one, else the first this build has."""
    current = torch.backends.quantized.engine
    supported = torch.backends.quantized.supported_engines
    if current in _QUANTIZED_ENGINES:
        return current
    return next((e for e in _QUANTIZED_ENGINES if e in supported), None)


def _native_cuda_bf16(device: torch.device) -> bool:
    """Whether ``device`` (the worker's GPU, not the current one) has bf16 hardware: compute
    capability 8.0 or newer. ``torch.cuda.is_bf16_supported()`` is not the test: since torch
    2.4 it reports True on Volta and Turing, where bf16 is emulated, and it asks about the
    current device."""
    if not torch.cuda.is_available():
        return False  # no GPU to ask (the device itself is refused elsewhere)
    return torch.cuda.get_device_capability(device) >= BF16_CAPABILITY


def _native_cpu(kind: Literal["bf16", "fp16"]) -> bool:
    """Whether oneDNN has native CPU kernels for ``kind`` (AVX512-BF16/AMX, AVX512-FP16/AMX)."""
    probe = "_is_mkldnn_bf16_supported" if kind == "bf16" else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False
