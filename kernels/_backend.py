"""Backend choice for every kernel: Triton or the plain-torch reference.

The rule (the README's "Kernel backends"):

- CUDA tensors run the Triton kernel;
- CPU tensors run the torch reference, unless the Triton interpreter was asked
  for with ``TRITON_INTERPRET=1`` *before* ``cuboid.kernels`` was imported
  (Triton reads the variable when a kernel is decorated, so setting it later
  has no effect and is reported as such);
- a caller may force ``backend="triton"`` or ``backend="torch"``, per call or
  for a block of code with :func:`use_backend`;
- an unsupported combination is a clear error, never a silent fallback.

Nothing here runs at import time beyond reading one environment variable.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence

import torch

BACKENDS = ("triton", "torch")

# Triton decides interpret-or-compile when the @triton.jit decorators run, i.e.
# when the kernel modules are imported; record what was in force then.
INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_override: Optional[str] = None
_picks: dict = {}  # op -> index into the op's GPU autotune list (absent: 0, the launcher's own choice)


def interpreter_active() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1``."""
    return INTERPRETER


@contextlib.contextmanager
def use_backend(backend: Optional[str]) -> Iterator[None]:
    """Force one backend for every kernel call inside the block.

    ``use_backend("torch")`` is how a caller keeps the fast torch path on CPU in
    a process where the interpreter is on (the zoo tests do this); ``None``
    restores the automatic rule inside the block.
    """
    global _override
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    previous, _override = _override, backend
    try:
        yield
    finally:
        _override = previous


@contextlib.contextmanager
def autotune_pick(op: str, index: int) -> Iterator[None]:
    """Launch ``op``'s kernels with entry ``index`` of their GPU autotune list inside the block.

    Each kernel module names its tunable ops in ``AUTOTUNE`` (op -> number of
    candidates); entry 0 is the launcher's fixed choice, and an index past a
    table row's list falls back to it. ``bench/gpu.py`` times every entry on
    a GPU; the compile gate (tests/kernels/compile_gate.py) compiles every
    entry for sm_80 and sm_90. Nothing is tuned automatically: the
    interpreter cannot run multi-config autotuning, and launches stay
    deterministic.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"autotune_pick: index must be an int >= 0, got {index!r}")
    previous = _picks.get(op)
    _picks[op] = index
    try:
        yield
    finally:
        if previous is None:
            _picks.pop(op, None)
        else:
            _picks[op] = previous


def picked(op: str, candidates: Sequence):
    """The entry of ``candidates`` that :func:`autotune_pick` chose for ``op`` (entry 0 by default)."""
    index = _picks.get(op, 0)
    return candidates[index] if index < len(candidates) else candidates[0]


def _device_of(op: str, tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(
            f"{op}: all tensors must be on one device, got {sorted(str(d) for d in devices)}"
        )
    return devices.pop()


def auto_backend(device: torch.device) -> tuple[str, str]:
    """The backend the automatic rule picks for ``device``, and why."""
    if _override is not None:
        return _override, "forced by cuboid.kernels.use_backend"
    if device.type == "cuda":
        return "triton", "CUDA tensors run the Triton kernels"
    if device.type == "cpu":
        if INTERPRETER:
            return "triton", "TRITON_INTERPRET=1 was set before import: Triton interpreter"
        return "torch", "CPU tensors use the torch reference (set TRITON_INTERPRET=1 for the interpreter)"
    return "torch", f"{device.type} tensors have no Triton path here: torch reference"


def resolve_backend(op: str, tensors: Sequence[torch.Tensor], backend: Optional[str] = None) -> str:
    """Pick the backend for one call of ``op`` over ``tensors`` (None entries ignored).

    Raises ``ValueError`` for an unknown backend name, tensors on different
    devices, or ``backend="triton"`` where Triton cannot run.
    """
    device = _device_of(op, tensors)
    if backend is None:
        if _override == "triton":
            return _check_triton(op, device)
        return auto_backend(device)[0]
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        return _check_triton(op, device)
    return "torch"


def _check_triton(op: str, device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and INTERPRETER:
        return "triton"
    if device.type == "cpu":
        why = (
            "Triton needs CUDA tensors, or TRITON_INTERPRET=1 set in the environment "
            "before cuboid.kernels is imported"
        )
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            why += " (it is set now, but was not when the kernels were imported)"
        raise ValueError(f"{op}: backend='triton' cannot run on CPU tensors here: {why}")
    raise ValueError(f"{op}: backend='triton' cannot run on {device.type} tensors")


def on_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device current for a kernel launch (nothing for other devices)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def dot_options(dtype: torch.dtype) -> dict:
    """``UPCAST`` and ``PRECISION`` for kernels' ``tl.dot``: fp32 operands take "ieee" dots (as torch's fp32
    matmul without TF32); bf16 tiles are upcast under the interpreter, whose bf16 arithmetic is broken."""
    upcast = dtype == torch.float32 or (dtype == torch.bfloat16 and interpreter_active())
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")


def check_floating(op: str, name: str, t: torch.Tensor,
                   dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16)) -> None:
    """Raise a ``TypeError`` naming ``name`` when ``t`` is not one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {str(t.dtype).replace('torch.', '')}, expected one of {allowed}")


def check_same_dtype(op: str, **tensors: Optional[torch.Tensor]) -> None:
    """Raise a ``TypeError`` when the given tensors do not share one dtype."""
    present = {k: v.dtype for k, v in tensors.items() if v is not None}
    if len(set(present.values())) > 1:
        listing = ", ".join(f"{k}={str(d).replace('torch.', '')}" for k, d in present.items())
        raise TypeError(f"{op}: tensors must share one dtype, got {listing}")
