"""The Llama family's mixture-of-experts pieces (Qwen3-MoE, Mixtral, OLMoE): the sparse MLP block, the output
with router logits and the auxiliary loss, and the statistics a forward records.

Module names are public (specs and checkpoints address them): a sparse layer's ``blocks.N.mlp`` is a
:class:`SparseMLP` with ``router`` (``.weight`` (E, C)) and ``experts`` (``.gate_up``, ``.down``).

A forward's load-balancing statistics are recorded by a :class:`~cuboid.parallel.moe.Recorder` opened around
the blocks (:func:`recorder_for`, :func:`~cuboid.parallel.moe.recording`); :func:`with_router_outputs` turns
what it holds into the output's ``router_logits`` and ``aux_loss`` and adds the loss as transformers does.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from cuboid.parallel.moe import Experts, Recorder, Router, active_recorder
from cuboid.zoo.common import Output

from .config import LlamaConfig
from .gpt_oss import GptOssExperts, GptOssRouter


class SparseMLP(nn.Module):
    """Top-k routed gated MLPs, dropless: (B, T, C) -> (B, T, C). The router's logits join the open recorder."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        if c.arch == "gpt_oss":  # a biased router, biased experts with the clamped SwiGLU
            self.router = GptOssRouter(c.dim, c.n_experts, c.experts_per_token)
            self.experts = GptOssExperts(c.dim, c.expert_hidden, c.n_experts, c.swiglu_alpha, c.swiglu_limit)
            return
        # Mixtral weighs the experts' outputs with fp32 routing weights; Qwen3-MoE and OLMoE cast them first
        self.router = Router(c.dim, c.n_experts, c.experts_per_token, c.norm_topk_prob, cast=c.arch != "mixtral")
        self.experts = Experts(c.dim, c.expert_hidden, c.n_experts, c.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        logits, weights, experts = self.router(flat)
        recorder = active_recorder()
        if recorder is not None:
            recorder.add(logits)
        return self.experts(flat, weights, experts).view(shape)


class MoeOutput(Output):
    """:class:`~cuboid.zoo.common.Output` with ``router_logits`` (one (B*T, E) tensor per sparse layer, when
    asked for) and ``aux_loss`` (the load-balancing loss, before ``router_aux_loss_coef``)."""

    def __init__(self, *args, router_logits: Optional[tuple] = None, aux_loss: Optional[torch.Tensor] = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.router_logits, self.aux_loss = router_logits, aux_loss


def recorder_for(c: LlamaConfig, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 keep_logits: bool, reduce: Optional[Callable] = None) -> Optional[Recorder]:
    """The recorder of one forward of a model with sparse layers (None for a dense one). Padding (0 in
    ``attention_mask``, whose last T columns are the tokens of ``input_ids`` (B, T)) does not count. ``reduce``:
    the plan's loss from the statistics (see :class:`~cuboid.parallel.moe.Recorder`)."""
    if not c.sparse_layers:
        return None
    keep = None
    if attention_mask is not None:
        keep = attention_mask[:, -input_ids.shape[1]:].reshape(-1)
    return Recorder(c.experts_per_token, keep_logits=keep_logits, keep=keep, reduce=reduce)


def with_router_outputs(c: LlamaConfig, out: Output, recorder: Recorder, labels: Optional[torch.Tensor],
                        add_loss: bool) -> MoeOutput:
    """``out`` with the recorded router logits and auxiliary loss; with ``labels`` and ``add_loss``
    (``output_router_logits``), ``loss`` + ``router_aux_loss_coef`` * aux loss (transformers')."""
    aux = recorder.loss(c.n_experts)
    fields = {name: out.raw(name) for name in Output.FIELDS}  # a deferred field (logits) stays unmade
    if add_loss and labels is not None and aux is not None and fields["loss"] is not None:
        fields["loss"] = fields["loss"] + c.router_aux_loss_coef * aux.to(fields["loss"].dtype)
    logits = tuple(recorder.logits) if recorder.keep_logits else None
    return MoeOutput(**fields, router_logits=logits, aux_loss=aux)
