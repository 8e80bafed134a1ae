"""The layers gpt-oss adds to the Llama family: the biased top-k router, the experts with biases and the clamped
SwiGLU, the attention sinks, and the MXFP4 dequantisation of the published expert tensors.

Module names are public (specs and checkpoints address them): a gpt-oss layer's ``blocks.N.mlp`` holds ``router``
(``.weight`` (E, C), ``.bias`` (E,)) and ``experts`` (``.gate_up`` (E, 2I, C), gate rows first then up rows;
``.gate_up_bias`` (E, 2I); ``.down`` (E, C, I); ``.down_bias`` (E, C)); ``blocks.N.attn.sinks.weight`` is the
(H,) sink logits (a :class:`~cuboid.parallel.layers.LearnedTensor`, so that the spec gives it a role).
transformers stores the experts transposed and the gate/up columns interleaved
(``gate_up_proj`` (E, C, 2I), gate at even columns): zoo/llama/gpt_oss_hf.py maps them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cuboid.parallel.moe import Experts, Router

# MXFP4's sixteen values (the E2M1 codes 0..15: sign bit 3), as the format defines them
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class GptOssRouter(Router):
    """gpt-oss's router: ``logits = x W^T + b``; the top-k logits chosen and softmaxed among themselves (in the
    logits' dtype), transformers' GptOssTopKRouter. The logits (with the bias) are what the load-balancing loss
    and ``router_logits`` read."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__(dim, n_experts, top_k, norm_topk_prob=False, cast=True)
        self.bias = torch.nn.Parameter(torch.empty(n_experts))
        self.tag_placements()

    def forward(self, x: torch.Tensor) -> tuple:
        logits = F.linear(x, self.weight, self.bias)  # (N, E)
        top, experts = torch.topk(logits, self.top_k, dim=-1)  # (N, k) each
        return logits, torch.softmax(top, dim=-1, dtype=top.dtype), experts


class GptOssExperts(Experts):
    """Experts with biases and gpt-oss's clamped SwiGLU: ``h = x W_gu^T + b_gu``, ``gate`` clamped above at
    ``limit``, ``up`` to ``[-limit, limit]``, ``a = (up + 1) * gate * sigmoid(alpha * gate)``, out ``a W_d^T +
    b_d`` (transformers' GptOssExperts). Expert parallelism keeps each bias's rows with its expert's weights."""

    def __init__(self, dim: int, hidden: int, n_experts: int, alpha: float, limit: float) -> None:
        super().__init__(dim, hidden, n_experts, "silu")
        self.alpha, self.limit = alpha, limit
        self.gate_up_bias = torch.nn.Parameter(torch.empty(n_experts, 2 * hidden))
        self.down_bias = torch.nn.Parameter(torch.empty(n_experts, dim))
        self.tag_placements()

    def compute(self, x_sorted: torch.Tensor, counts_local: torch.Tensor) -> torch.Tensor:
        # each sorted row's local expert (no host sync: the output size is the rows')
        expert = torch.repeat_interleave(torch.arange(counts_local.numel(), device=x_sorted.device), counts_local,
                                         output_size=x_sorted.shape[0])
        h = self.project("gate_up", x_sorted, counts_local) + self.gate_up_bias[expert].to(x_sorted.dtype)
        gate = h[:, :self.hidden].clamp(max=self.limit)
        up = h[:, self.hidden:].clamp(min=-self.limit, max=self.limit)
        a = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self.project("down", a, counts_local) + self.down_bias[expert].to(a.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", alpha={self.alpha}, limit={self.limit}"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 to floats: ``blocks`` (..., G, 16) uint8, two E2M1 codes a byte (low nibble first), ``scales``
    (..., G) uint8 exponents biased by 127, each scaling its group of 32 values -> (..., G * 32) in ``dtype``.

    The values are computed in fp32, where every ``code * 2 ** exponent`` is exact, then cast: the numbers
    transformers' dequantisation (``convert_moe_packed_tensors``) gives in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 expects uint8 blocks (..., G, 16) and uint8 scales (..., G), got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack(((blocks & 0x0F).long(), (blocks >> 4).long()), -1)  # (..., G, 16, 2): low nibble first
    values = lut[codes].flatten(-2)  # (..., G, 32)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (gate at even indices of ``dim``) as gate's half then up's half."""
    x = t.movedim(dim, 0)
    return torch.cat((x[0::2], x[1::2]), 0).movedim(0, dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`deinterleave`: gate's and up's halves of ``dim`` interleaved, gate first."""
    gate, up = t.chunk(2, dim)
    return torch.stack((gate, up), dim + 1).flatten(dim, dim + 1)
