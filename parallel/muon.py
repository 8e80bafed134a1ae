"""Muon (Jordan et al. 2024; Liu et al., arXiv 2502.16982): orthogonalised momentum on hidden matrices, AdamW
on the rest, in one optimizer, taking one device's step under every plan.

``Muon(model.parameters())`` routes each parameter by the role of the cuboid layer that holds it
(:func:`~.layers.layer_of`): the hidden matrices (``column``, ``row``, ``column_qkv``, ``column_kv`` layers,
and the ``experts`` stacks, orthogonalised per expert) take Muon's step; embeddings, LM heads, norms, biases,
routers, classifiers, LoRA adapters and anything 1-D take AdamW's (its own ``adamw_lr``, betas, eps and weight
decay), as torch's docs and Moonlight advise. A Muon step, per matrix (torch.optim.Muon's order):

- ``buf = lerp(buf, g, 1 - momentum)``; ``update = lerp(g, buf, momentum)`` (Nesterov) or ``buf``;
- ``O = NS(update)``: five Newton-Schulz steps with (3.4445, -4.7750, 2.0315) on the update scaled to unit
  norm, in ``ns_dtype`` (bf16 as torch does, or fp32), the wide orientation;
- ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O``, ``adjusted_lr`` = ``lr * 0.2 * sqrt(max(A, B))``
  (``adjust_lr="match_rms_adamw"``, Moonlight's: Muon's update at AdamW's RMS, the default) or
  ``lr * sqrt(max(1, A / B))`` (``"original"``, torch's default).

**Exact under every plan.** The momentum is elementwise, so each rank keeps it for the piece it holds (a
tensor-parallel shard, a ZeRO piece, both); the Newton-Schulz step needs the whole matrix, so every rank
rebuilds it from the pieces (ZeRO: :func:`~.zero.full_local`; tensor parallelism: the layer's
``full_tensor_like``, collectives over the layer's groups), computes the same orthogonalisation one device
computes, bit for bit, and keeps its own piece of it (``local_part``, :func:`~.zero.piece_of`). Every rank of
a parameter's groups walks the same parameters in the same order, so every collective is decided by the plan.
That is redundant compute (each rank orthogonalises every matrix of its stage) and an all-gather of each
matrix's update per step; torchtitan's owner scheme (an all-to-all to one owner per matrix) is the faster
layout to come.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import zero
from .layers import layer_of
from .optim import AdamW, check_hparams

__all__ = ["Muon", "MATRIX_ROLES", "newton_schulz", "routes_to_muon"]

MATRIX_ROLES = ("column", "row", "column_qkv", "column_kv", "experts")  # hidden matrices: Muon's
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST = ("match_rms_adamw", "original", "none")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def routes_to_muon(p: torch.Tensor) -> bool:
    """Whether ``p`` takes Muon's step: a matrix (or an expert stack) of a hidden layer, as its spec's role says
    (so every plan routes alike). LoRA's adapter layers take AdamW's: their roles are their classes' (a column
    shard's under tp, a plain linear's on one device), and orthogonalising a rank-r factor sets all r of its
    singular values to one."""
    found = layer_of(p)
    if found is None or p.ndim < 2 or getattr(found[0], "lora_adapter", False):
        return False
    return getattr(found[0], "role", None) in MATRIX_ROLES


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of the (..., A, B) matrices ``g`` (each on its own), as
    torch.optim.Muon computes it (in ``dtype``, the wide orientation, unit Frobenius norm first)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.transpose(-2, -1)
    if x.dim() == 2:  # torch's own sequence of ops, so one matrix's result is torch.optim.Muon's to the bit
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # a stack (experts): each matrix on its own
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.transpose(-2, -1) if tall else x


def _adjusted(lr: float, how: str, shape) -> float:
    A, B = shape[-2], shape[-1]
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    if how == "original":
        return lr * math.sqrt(max(1.0, A / B))
    return lr


class Muon(AdamW):
    """Muon on hidden matrices and AdamW on the rest (module docstring). Groups: ``use_muon`` True (``lr``,
    ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``, ``ns_dtype``, ``adjust_lr``) or False
    (``lr``, ``betas``, ``eps``, ``weight_decay``: AdamW's); given plain parameters, both are made by
    :func:`routes_to_muon`; given groups, a group without ``use_muon`` is split the same way."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.1, *,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bf16", adjust_lr: str = "match_rms_adamw",
                 eps: float = 1e-7, adamw_lr: float = 3e-4, adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: Optional[float] = None, master_weights: bool = True,
                 backend: Optional[str] = None):
        check_hparams(lr=lr, weight_decay=weight_decay, adamw_lr=adamw_lr, eps=eps)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if ns_dtype not in _DTYPES or adjust_lr not in ADJUST or not 1 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_dtype is one of {', '.join(_DTYPES)}, adjust_lr one of {', '.join(ADJUST)} "
                             f"and 1 <= ns_steps < 100; got {ns_dtype!r}, {adjust_lr!r}, {ns_steps}")
        self._muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                          ns_dtype=ns_dtype, adjust_lr=adjust_lr, ns_eps=eps)
        self._adamw = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                           weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        super().__init__(self._routed(params), lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                         weight_decay=self._adamw["weight_decay"], master_weights=master_weights, backend=backend)

    def _routed(self, params) -> list:
        """The param groups: each given group (or the plain parameters) split into its Muon and AdamW parts."""
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        out = []
        for g in groups:
            if "use_muon" in g:
                out.append({**(self._muon if g["use_muon"] else self._adamw), **g})
                continue
            ps = list(g["params"])
            rest = {k: v for k, v in g.items() if k != "params"}
            for use, part in ((True, [p for p in ps if routes_to_muon(p)]),
                              (False, [p for p in ps if not routes_to_muon(p)])):
                if part:
                    out.append({**(self._muon if use else self._adamw), **rest, "params": part, "use_muon": use})
        return out

    def _buckets(self, group) -> dict:
        self._state_keys = ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")
        return super()._buckets(group)

    def _apply(self, group, step, b, reducer=None):
        if not group["use_muon"]:
            return super()._apply(group, step, b, reducer)
        lr, mu, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
        dtype = _DTYPES[group["ns_dtype"]]
        masters = b["master"] or [None] * len(b["params"])
        for p, g, buf, master, owner in zip(b["params"], b["grads"], b["momentum_buffer"], masters, b["owners"]):
            g = g.float()
            buf.lerp_(g, 1 - mu)
            update = g.lerp(buf, mu) if group["nesterov"] else buf
            whole = _whole(owner, update)  # every rank of the parameter's groups: the same whole matrix
            ortho = newton_schulz(whole, group["ns_steps"], NS_COEFFICIENTS, group["ns_eps"], dtype)
            mine = _piece(owner, ortho.float(), update)
            target = master if master is not None else p
            target.mul_(1 - lr * wd)
            target.add_(mine.to(target.dtype), alpha=-_adjusted(lr, group["adjust_lr"], whole.shape))
            if master is not None:
                p.copy_(master)
        return None


def _whole(p: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``p`` from this rank's ``piece`` of it (shaped as the optimizer holds it): ZeRO's
    pieces assembled over dp, then the layer's shards over its tensor-parallel groups (collectives)."""
    info = zero.view_of(p)
    local = piece if info is None else zero.full_local(p, piece, info)
    layer, name = layer_of(p)
    return layer.full_tensor_like(name, local)


def _piece(p: torch.Tensor, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the whole tensor ``whole`` of ``p``, shaped like ``like`` (what the optimizer
    holds)."""
    layer, name = layer_of(p)
    local = layer.local_part(name, whole)
    if zero.view_of(p) is None:
        return local.reshape(like.shape)
    return zero.piece_of(p, local).reshape(like.shape)
