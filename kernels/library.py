"""What the kernels' torch custom ops (``torch.ops.cuboid.*``) share, so that ``torch.compile`` sees one op each.

Each kernel file registers its own ops next to its launchers (``cuboid::norm``
and ``cuboid::norm_backward`` in kernels/norm.py, ``cuboid::rope``,
``cuboid::swiglu``, ``cuboid::flash_attention``, ``cuboid::lce_stats``,
``cuboid::grouped_mm``, ... in theirs), so importing a kernel file registers
its ops. An op's real implementation launches the Triton kernel (compiled on
CUDA, the interpreter on CPU under ``TRITON_INTERPRET=1``), its fake
implementation gives the output shapes and dtypes for tracing, and the forward
ops have their backward registered, so Dynamo traces a model through them
without a graph break and AOTAutograd puts the backward op into the backward
graph. The public functions (:func:`cuboid.kernels.layer_norm`, ``rope``,
``swiglu``, ``attention``, ``linear_cross_entropy``) still choose the backend;
these ops are their Triton path. The torch path needs no op: it is plain
torch, which inductor fuses itself. The exception is ``grouped_mm``, whose op
carries both paths (``use_triton``): its CPU torch path calls
``torch._grouped_mm``, whose own fake kernel takes bf16 only, and reads
counts on the host for float64.

Outputs never alias inputs (a custom op's contract): where a launcher has
nothing to return for an optional output (no residual, no bias gradient), the
op returns :func:`empty_output` and the Python wrapper turns it back into None
with :func:`or_none`. This module imports no kernel file.
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

__all__ = ["empty_output", "or_none"]


def empty_output(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The empty stand-in for an absent output: a 1-D tensor of no elements on ``like``'s device."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def or_none(t: Tensor) -> Optional[Tensor]:
    """None for :func:`empty_output`'s stand-in, else ``t``."""
    return None if t.numel() == 0 and t.dim() == 1 else t
