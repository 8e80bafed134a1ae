"""DeepSeek-V3's mixture of experts: the group-limited sigmoid router with its correction bias, the routed experts
beside a shared expert, and the bias update of auxiliary-loss-free balancing.

Module names are public: a sparse layer's ``blocks.N.mlp`` is a :class:`DeepSeekMoE` with ``router``
(``.weight`` (E, C) and ``.bias`` (E,), HF's ``gate.weight`` and ``gate.e_score_correction_bias``),
``experts`` (:class:`~cuboid.parallel.moe.Experts`: ``gate_up``, ``down``; sharded over ep) and ``shared``
(a gated MLP of ``n_shared_experts * moe_hidden``: ``gate``, ``up``, ``proj``).

The correction bias steers which experts are chosen, never their weights, and training does not differentiate
it: it is a parameter with ``requires_grad=False`` (so checkpoints, resharding and ZeRO-3 carry it as they carry
every parameter, and no optimizer touches it). DeepSeek-V3 moves it between steps by the rule
``bias += rate * sign(mean load - load)`` (:func:`update_routing_bias`); each router counts its load (the
top-k choices per expert of the tokens it routed) in the backward of each trained forward since the last update
(a forward whose routing weights get an all-zero gradient counts nothing: torch's pipeline shape inference).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.parallel import comm
from cuboid.parallel.layers import ShardedModule
from cuboid.parallel.moe import Experts
from cuboid.parallel.state import planned
from cuboid.zoo.llama.model import GatedMLP
from cuboid.zoo.llama.moe import SparseMLP

from .config import DeepSeekConfig


def gated_mlp(dim: int, hidden: int) -> GatedMLP:
    """The Llama family's SwiGLU MLP (``gate``, ``up``, ``proj``) of width ``hidden``, no biases."""
    return GatedMLP(SimpleNamespace(act="silu", dim=dim, mlp_hidden=hidden, mlp_bias=False))


class GroupRouter(ShardedModule):
    """DeepSeek-V3's router: ``forward(x (N, C)) -> (logits (N, E) fp32, weights (N, k) fp32, experts (N, k))``,
    transformers' DeepseekV3TopkRouter op for op (fp32 logits, sigmoid scores, the top ``topk_group`` groups by
    the sum of each group's top two biased scores, the top k biased scores within them, the unbiased scores of
    those normalised and scaled). ``load`` (E,) fp32: the choices per expert of the trained forwards (counted as
    backward passes them) since the last :func:`update_routing_bias` (None before the first; a plain attribute,
    not in the state dict)."""

    role = "replicate"

    def __init__(self, c: DeepSeekConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.n_group, self.topk_group = c.n_experts, c.experts_per_token, c.n_group, \
            c.topk_group
        self.norm_topk_prob, self.scale = c.norm_topk_prob, c.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(c.n_experts, c.dim))
        self.bias = nn.Parameter(torch.empty(c.n_experts), requires_grad=False)  # e_score_correction_bias
        self.load = None  # made on the first counted forward, on the input's device
        self.tag_placements()

    def forward(self, x: torch.Tensor) -> tuple:
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        scores = logits.sigmoid()
        biased = scores + self.bias.float()
        N, E, G = logits.shape[0], self.n_experts, self.n_group
        group_scores = biased.view(N, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        keep = group_mask.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
        experts = torch.topk(biased.masked_fill(~keep.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scale
        if self.training and weights.requires_grad:
            # counted when backward reaches this forward, so once per trained forward: not for a block's recompute
            # (backward runs through the first forward's graph; the recompute only refills its saved tensors),
            # nor for a forward whose weights get an all-zero gradient (torch's pipeline shape inference, whose
            # loss is multiplied by 0; a micro-batch without a trained token)
            chosen = experts.detach()
            weights.register_hook(lambda grad: self._count(chosen, grad))
        return logits, weights, experts

    @torch.no_grad()
    def _count(self, experts: torch.Tensor, grad: torch.Tensor) -> None:
        if self.load is None or self.load.device != experts.device:
            self.load = torch.zeros(self.n_experts, device=experts.device)
        trained = (grad != 0).any().to(self.load.dtype)  # on the device: no host sync in backward
        self.load.scatter_add_(0, experts.reshape(-1), trained.expand(experts.numel()))

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, top_k={self.top_k}, groups={self.topk_group}/{self.n_group}"


class DeepSeekMoE(nn.Module):
    """Routed experts (dropless, grouped GEMMs) plus the shared expert on every token: (B, T, C) -> (B, T, C).
    The router's logits join the open recorder (a forward asked for ``router_logits``)."""

    def __init__(self, c: DeepSeekConfig) -> None:
        super().__init__()
        self.router = GroupRouter(c)
        self.experts = Experts(c.dim, c.moe_hidden, c.n_experts, "silu")
        self.shared = gated_mlp(c.dim, c.moe_hidden * c.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SparseMLP.forward(self, x) + self.shared(x)  # the routed part is the Llama family's, same router API


def routers(model: nn.Module) -> list:
    """The model's :class:`GroupRouter` modules, in module order (the same on every rank of a stage)."""
    return [m for m in model.modules() if isinstance(m, GroupRouter)]


@torch.no_grad()
def update_routing_bias(model: nn.Module, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing after an optimizer step: each router's correction bias
    ``+= rate * sign(mean load - load)``, the loads (choices per expert since the last update) summed over the
    ranks that saw different tokens (dp, with ep inside it, and sp: the plan's ``balance_reduce`` group),
    then reset. Every rank of that group calls it after the same step. Padding counts as routed tokens (the
    router sees rows, not the mask): under sp, sequences padded to a multiple of 2 sp add pad rows."""
    if rate <= 0:
        return
    if not getattr(getattr(model, "config", None), "moe_layers", ()):
        raise ValueError("a routing-bias update rate applies to models whose routers carry a correction bias "
                         "(DeepSeek-V3's); this model has none")
    state = planned(model)
    group = getattr(getattr(state, "balance_reduce", None), "group", None)
    found = routers(model)
    if not found:
        return
    loads = torch.stack([r.load if r.load is not None else torch.zeros_like(r.bias, dtype=torch.float32)
                         for r in found])  # (layers, E): a router that routed nothing here sends zeros
    if group is not None:
        comm.all_reduce_(loads, group)
    for router, load in zip(found, loads):
        step = rate * torch.sign(load.mean() - load)
        router.load_full("bias", router.full_tensor("bias") + step.to(router.bias.dtype))
        router.load = None
