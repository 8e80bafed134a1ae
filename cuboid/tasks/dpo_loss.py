"""The DPO loss family on sequence log-probabilities, with TRL 1.16's names and formulas.

Every loss is a function of the policy's and the reference's summed
log-probabilities of each pair's chosen and rejected answer (``(P,)`` each)
and returns one loss per pair ``(P,)``; :func:`pair_losses` sums several
with weights (TRL's ``loss_type`` list with ``loss_weights``: MPO is
``sigmoid+bco_pair+sft`` at ``0.8+0.2+1.0``). The log-ratios are
``policy - reference`` per answer; ``beta`` scales them into rewards.

``sft``, ``aot`` and ``aot_unpaired`` read the whole micro-batch (a token mean
over the chosen answers, ranks of sorted ratios) as TRL's do per batch; the
others are per pair, so their sum over a step does not depend on how the
step splits its pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LOSS_TYPES", "PairLogps", "pair_losses", "loss_of"]

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


@dataclass
class PairLogps:
    """One micro-batch's pairs: policy and reference log-probabilities of the chosen and rejected answers
    (P,), and each answer's tokens: ``*_tokens`` the answer's label positions (TRL's completion mask), and
    ``chosen_targets`` the chosen answer's predicted positions (its shifted mask: what its log-prob sums)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_targets: torch.Tensor

    @property
    def chosen_ratio(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_ratio(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected


def _smoothed(x: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """-logsigmoid(beta x) (1 - eps) - logsigmoid(-beta x) eps (the sigmoid loss with flipped labels)."""
    return -F.logsigmoid(beta * x) * (1 - eps) - F.logsigmoid(-beta * x) * eps


def loss_of(kind: str, p: PairLogps, beta: float, label_smoothing: float = 0.0,
            discopop_tau: float = 0.05) -> torch.Tensor:
    """The per-pair loss ``kind`` (one of :data:`LOSS_TYPES`), (P,)."""
    c, r = p.chosen_ratio, p.rejected_ratio
    delta = c - r
    eps = label_smoothing
    if kind == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if kind == "hinge":
        return torch.relu(1 - beta * delta)
    if kind in ("ipo", "sigmoid_norm"):  # per-token ratios: the sums divided by each answer's tokens
        per_token = c / p.chosen_tokens.clamp(min=1.0) - r / p.rejected_tokens.clamp(min=1.0)
        return (per_token - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * per_token)
    if kind == "exo_pair":  # KL of softmax(beta * ratios) over (chosen, rejected) from (1 - eps, eps)
        eps_t = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
        z = beta * delta
        return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps_t)) + \
            torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps_t))
    if kind == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if kind == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if kind == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if kind == "aot":  # the sorted policy margins against the sorted reference margins
        ours, _ = torch.sort(p.chosen - p.rejected, dim=0)
        ref, _ = torch.sort(p.ref_chosen - p.ref_rejected, dim=0)
        return _smoothed(ours - ref, beta, eps)
    if kind == "aot_unpaired":  # the sorted chosen ratios against the sorted rejected ratios
        return _smoothed(torch.sort(c, dim=0)[0] - torch.sort(r, dim=0)[0], beta, eps)
    if kind == "apo_zero":  # chosen up, rejected down
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if kind == "apo_down":  # chosen down, rejected down more
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * delta)
    if kind == "discopop":  # logistic and exponential losses blended by the margin
        z = beta * delta
        blend = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - blend) + torch.exp(-z) * blend
    if kind == "sft":  # the chosen answers' mean negative log-likelihood per token, the micro-batch's
        nll = -p.chosen.sum() / p.chosen_targets.sum()
        return nll.expand(p.chosen.shape[0])
    raise ValueError(f"unknown DPO loss type {kind!r}; loss types: {', '.join(LOSS_TYPES)}")


def pair_losses(p: PairLogps, kinds, weights, beta: float, label_smoothing: float = 0.0,
                discopop_tau: float = 0.05) -> torch.Tensor:
    """``sum_k weights[k] * loss_of(kinds[k])``, one value per pair (P,)."""
    total = None
    for kind, weight in zip(kinds, weights, strict=True):
        term = loss_of(kind, p, beta, label_smoothing, discopop_tau) * weight
        total = term if total is None else total + term
    return total


def check(kinds, weights, beta: float, label_smoothing: float) -> None:
    """One-sentence ValueErrors for unknown loss types, weights that do not match them, a beta that is not
    positive, or a label smoothing outside [0, 0.5) (where the losses that read it are defined)."""
    unknown = [k for k in kinds if k not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"unknown DPO loss type {', '.join(unknown)}; loss types: {', '.join(LOSS_TYPES)}")
    if len(weights) != len(kinds):
        raise ValueError(f"loss_weights has {len(weights)} weights for {len(kinds)} loss types")
    if not (beta > 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if "exo_pair" in kinds and label_smoothing == 0:
        raise ValueError("loss type exo_pair needs label_smoothing > 0 (its target is (1 - eps, eps))")
