"""Layers the Gemma 3 and gpt-oss options of the Llama family add: Gemma's RMSNorm, RoPE with linear and YaRN
scaling."""
from __future__ import annotations

import math
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
    """The RoPE layer for HF's ``rope_scaling`` (None, default, llama3, linear or yarn)."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return LinearRotary(head_dim, theta, scaling)
    if kind == "yarn":
        return YarnRotary(head_dim, theta, scaling)
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


class YarnRotary(L.Rotary):
    """RoPE with HF's ``yarn`` scaling (gpt-oss): each inverse frequency blended between the original and the
    ``factor``-interpolated one by a linear ramp over the dims between the correction bounds of ``beta_fast``
    and ``beta_slow`` rotations, and the tables scaled by the attention factor (``0.1 ln(factor) + 1`` unless
    given), in transformers' order of operations (``_compute_yarn_parameters``) so the tables agree."""

    def inverse_frequencies(self, device) -> tuple:
        """(inv_freq (D/2,) fp32, attention factor)."""
        s, D, base = self.scaling, self.head_dim, self.theta
        factor = float(s["factor"])
        attention = s.get("attention_factor")
        if attention is None:
            mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim \
                else _yarn_mscale(factor)
        original = s["original_max_position_embeddings"]

        def correction(rotations: float) -> float:
            return (D * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction(s.get("beta_fast") or 32), correction(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
        pos = base ** (torch.arange(0, D, 2).to(device=device, dtype=torch.float) / D)
        keep = 1 - ramp  # the extrapolation's share
        return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep, float(attention)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, key: Optional[tuple] = None) -> tuple:
        inv_freq, attention = self.inverse_frequencies(positions.device)
        freqs = positions[..., None].float() * inv_freq  # (..., T, D/2) fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
