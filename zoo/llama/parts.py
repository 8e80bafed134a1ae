"""Layers the Gemma 3 options of the Llama family add: Gemma's RMSNorm and RoPE with linear scaling."""
from __future__ import annotations

from typing import Optional

import torch

import cuboid.kernels as kernels
from cuboid.parallel import comm
from cuboid.parallel import layers as L


class GemmaRMSNorm(L.RMSNorm):
    """Gemma's RMS norm: the normalised input times ``1 + weight``, the product in fp32 and then cast to the
    input's dtype (``transformers``' Gemma3RMSNorm); the residual add fused as :class:`~L.RMSNorm`'s. The
    stored weight is Gemma's (0 scales by 1), so checkpoints map as they are."""

    offset = 1.0

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None and residual.dtype != x.dtype:
            x = x.to(residual.dtype)
        w = self.weight if self.seq_group is None else comm.copy_to(self.weight, self.seq_group)
        return kernels.rms_norm(x, 1.0 + w.float(), self.eps, residual=residual)


def rotary(head_dim: int, theta: float, scaling: Optional[dict]) -> L.Rotary:
    """The RoPE layer for HF's ``rope_scaling`` (None, default, llama3 or linear)."""
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "linear":
        return LinearRotary(head_dim, theta, scaling)
    return L.Rotary(head_dim, theta, scaling)


class LinearRotary(L.Rotary):
    """RoPE with HF's ``linear`` scaling (Gemma 3's global layers): the inverse frequencies divided by
    ``factor``, computed with the same ops as ``transformers`` so the tables are bit-identical."""

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, key: Optional[tuple] = None) -> tuple:
        D = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=positions.device).float() / D))
        inv_freq = inv_freq / float(self.scaling["factor"])
        freqs = positions[..., None].float() * inv_freq  # (..., T, D/2) fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
