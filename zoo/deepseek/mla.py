"""Multi-head latent attention (DeepSeek-V2/V3), its RoPE, and the latent cache generation keeps.

Module names are public (specs and checkpoints address them): ``q`` (no q low-rank path) or ``q_a``, ``q_norm``,
``q_b``; ``kv_a`` (hidden -> latent + RoPE key), ``kv_norm``, ``kv_b`` (latent -> each head's key part without
RoPE and its value); ``proj``. The attention core is a :class:`LatentCore`: sequence parallelism swaps it for
its ring or all-to-all core like any other (it takes the expanded q, k, v), and generation for a
:class:`LatentCache`, which keeps the latent and the rotated RoPE key (``kv_lora_rank + qk_rope_head_dim``
numbers per token) instead of every head's keys and values, and expands them at each step.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn

import cuboid.kernels as kernels
from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.mask import Mask

from .config import DeepSeekConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * log(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class PartialRotary(L.Rotary):
    """RoPE on the last ``head_dim`` features of q and k (DeepSeek's ``qk_rope_head_dim``), default or YaRN
    (HF's ``rope_parameters``), with transformers' ops so that the tables are bit-identical: YaRN's blended
    inverse frequencies, and cos/sin scaled by its ``attention_factor``. The features arrive de-interleaved
    (:class:`MLA` reorders DeepSeek's interleaved pairs), so the rotation is Llama's ``rotate_half``."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], n_positions: int) -> None:
        super().__init__(head_dim, theta, scaling)
        key = (head_dim, theta, tuple(sorted(scaling.items())) if scaling else None, n_positions)
        self.inv_freq, self.factor = _frequencies(*key)  # on the CPU (explicitly: builds run on meta)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, key: Optional[tuple] = None) -> tuple:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (..., T, D/2) fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, key: Optional[tuple] = None):
        R = self.head_dim
        cos, sin = self.tables(positions, q.dtype)
        qr, kr = kernels.rope(q[..., -R:], k[..., -R:], cos, sin)
        q = qr if q.shape[-1] == R else torch.cat([q[..., :-R], qr], -1)
        k = kr if k.shape[-1] == R else torch.cat([k[..., :-R], kr], -1)
        return q, k


@functools.lru_cache(maxsize=16)
def _frequencies(D: int, base: float, pairs: Optional[tuple], n_positions: int) -> tuple:
    """(inverse frequencies (D / 2,) fp32 on the CPU, cos/sin factor) of RoPE over ``D`` features: default, or
    YaRN's blend of interpolated and extrapolated frequencies (transformers' _compute_yarn_parameters).
    Shared by the layers (cached): a meta build of 61 layers computes them once."""
    s = dict(pairs) if pairs else None
    if s is None or s.get("rope_type", s.get("type")) == "default":
        return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D)), 1.0
    factor = s.get("factor") or n_positions / s["original_max_position_embeddings"]
    att = s.get("attention_factor")
    if att is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        att = float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    original = s["original_max_position_embeddings"]

    def dim_of(rotations):
        return (D * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos = base ** (torch.arange(0, D, 2, device="cpu").to(dtype=torch.float) / D)
    keep = 1 - ramp  # the extrapolated share of each frequency
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep, att


class LatentCore(L.Attention):
    """MLA's attention core: the plain core on expanded (B, H, T, D) q, k and (B, H, T, Dv) v; ``cached``
    gives generation the core that keeps the latent instead (:class:`LatentCache`)."""

    latent = False  # takes the expanded keys and values

    def cached(self, capacity: int) -> "LatentCache":
        return LatentCache(capacity)


class LatentCache(nn.Module):
    """Generation's core for MLA: ``forward(q, c, k_rot, expand=, mask=, rope=)`` with the new tokens' latent
    ``c`` (B, T, kv_lora_rank) and RoPE key ``k_rot`` (B, 1, T, R) not yet rotated. It rotates q and k_rot at
    the tokens' positions, writes c and the rotated k_rot into (B, capacity, kv_lora_rank) and (B, capacity, R)
    buffers allocated once at prefill, expands every cached token (``expand(c, k_rot) -> k, v``) and attends."""

    role = "attention"
    latent = True

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.c: Optional[torch.Tensor] = None
        self.k_rot: Optional[torch.Tensor] = None

    def forward(self, q, c, k_rot, *, expand, causal: bool = True, mask: Optional[Mask] = None, rope=None):
        T = q.shape[2]
        keep = mask.keep if mask is not None else None  # (B, S) every cached token and the new ones
        S = self.length + T
        if keep is None:
            positions = torch.arange(S - T, S, device=q.device)
        else:
            positions = (keep.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        q, k_rot = rope(q, k_rot, positions)
        k_rot = k_rot[:, 0]  # (B, T, R)
        if self.c is None or S > self.c.shape[1]:  # prefill (or past the capacity: grow)
            size = max(S, self.capacity)
            grown = [t.new_empty(t.shape[0], size, t.shape[2]) for t in (c, k_rot)]
            if self.c is not None:
                grown[0][:, :self.length], grown[1][:, :self.length] = self.c[:, :self.length], \
                    self.k_rot[:, :self.length]
            self.c, self.k_rot = grown
        self.c[:, self.length:S] = c
        self.k_rot[:, self.length:S] = k_rot
        self.length = S
        k, v = expand(self.c[:, :S], self.k_rot[:, :S, None].transpose(1, 2))
        return L.attention(q, k, v, causal=causal, key_padding_mask=keep)

    def numel(self) -> int:
        """Numbers held: the latent's and the RoPE key's buffers (B x capacity x (kv_lora_rank + R))."""
        return sum(t.numel() for t in (self.c, self.k_rot) if t is not None)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... as Llama's halves (x0, x2, ..; x1, x3, ..)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


class MLA(nn.Module):
    """Multi-head latent attention: (B, T, C) -> (B, T, C). Head counts are read off the (possibly sharded)
    ``q``/``q_b`` and ``kv_b`` projections, so a tensor-parallel rank runs its heads unchanged."""

    def __init__(self, c: DeepSeekConfig) -> None:
        super().__init__()
        self.nope, self.rope_dim, self.v_dim, self.latent = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, \
            c.kv_lora_rank
        self.head_dim = c.head_dim
        self.interleave = c.rope_interleave
        if c.q_lora_rank is None:
            self.q = L.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        else:
            self.q_a = L.Linear(c.dim, c.q_lora_rank, bias=c.attention_bias)
            self.q_norm = L.RMSNorm(c.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b = L.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.kv_a = L.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_norm = L.RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b = L.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.proj = L.Linear(c.n_heads * c.v_head_dim, c.dim, bias=c.attention_bias)
        self.rope = PartialRotary(c.qk_rope_head_dim, c.rope_theta, c.rope, c.n_positions)
        self.core = LatentCore()
        self.dropout = L.Dropout(c.dropout)
        # the kernel scales scores by head_dim ** -0.5; YaRN's mscale_all_dim multiplies that by mscale ** 2
        s = c.rope or {}
        m_all = s.get("mscale_all_dim", 0) if s.get("rope_type", "default") != "default" else 0
        self.q_scale = yarn_mscale(s["factor"], m_all) ** 2 if m_all else None

    def expand(self, c: torch.Tensor, k_rot: torch.Tensor) -> tuple:
        """Keys and values from the latent ``c`` (B, S, kv_lora_rank) and the RoPE key ``k_rot`` (B, 1, S, R):
        k (B, H, S, nope + R), v (B, H, S, v_head_dim)."""
        B, S, _ = c.shape
        kv = self.kv_b(c).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)  # (B, H, S, nope + Dv)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], -1)
        return k, v

    def forward(self, x: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        q = self.q(x) if hasattr(self, "q") else self.q_b(self.q_norm(self.q_a(x)))  # (B, T, H * D)
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        c, k_rot = self.kv_a(x).split([self.latent, self.rope_dim], -1)  # (B, T, L), (B, T, R)
        c = self.kv_norm(c)
        # the RoPE key is shared by every head, and a column-cut kv_b (tensor parallelism) gives this rank some of
        # them: its gradient sums over kv_b's group, as the column layer's own input's does (no-op on one device)
        k_rot = comm.copy_to(k_rot.view(B, 1, T, self.rope_dim), getattr(self.kv_b, "group", None))
        if self.interleave:
            q = torch.cat([q[..., :self.nope], deinterleave(q[..., self.nope:])], -1)
            k_rot = deinterleave(k_rot)
        if self.q_scale is not None:
            q = q * self.q_scale
        if getattr(self.core, "latent", False):  # generation: the core keeps the latent and expands it
            y = self.core(q, c, k_rot, expand=self.expand, causal=True, mask=mask, rope=self.rope)
        else:
            k, v = self.expand(c, k_rot)
            y = self.core(q, k, v, causal=True, mask=mask, rope=self.rope)  # (B, H, T, Dv)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))
