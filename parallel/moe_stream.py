"""A mixture of experts' load-balancing statistics where a plan runs the blocks: sequence and pipeline parallelism.

On one device the model opens a :class:`~.moe.Recorder` around its blocks and adds
``router_aux_loss_coef * aux_loss`` to its loss (transformers' semantics, when
``output_router_logits``). Under ``sp`` (:mod:`.sequence_split`) and ``pp``
(:mod:`.pipeline`) the plan runs the blocks itself, so it opens the recording,
through a :class:`Routing`:

- **sp**: each rank records its own tokens (the padding to ``2 sp`` excluded);
  the statistics are summed over ``sp`` by the recorder's reduce, so the loss
  and its gradient are those of one device's forward on the whole sequences;
- **pp**: the statistics of the blocks on earlier stages travel with the
  stream (:meth:`Routing.carry`: counts and tokens as data, ``probsum`` with
  its gradient flowing back through the p2p), and the last stage adds the
  micro-batch's auxiliary loss to the micro-batch's loss (one device running
  the plan's micro-batches: each micro-batch's own aux loss, weighted as its
  loss is).

Whether a model records is its config's (``sparse_layers``), the same on every
rank: a dense model's stream and collectives are unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .head import Deferred
from .moe import Recorder, recording


@dataclass(frozen=True)
class Routing:
    """What a plan needs of a model with sparse layers: ``n_experts``, ``top_k`` (experts per token),
    ``coef`` (``router_aux_loss_coef``) and ``routed`` (``output_router_logits``: the aux loss joins the loss
    and the router logits are returned, unless a forward says otherwise)."""

    n_experts: int
    top_k: int
    coef: float
    routed: bool

    @classmethod
    def of(cls, model: nn.Module) -> Optional["Routing"]:
        """The routing of ``model`` (None for a model without sparse layers: it records nothing)."""
        c = getattr(model, "config", None)
        if not getattr(c, "sparse_layers", ()):
            return None
        return cls(int(c.n_experts), int(c.experts_per_token), float(c.router_aux_loss_coef),
                   bool(c.output_router_logits))

    def recorder(self, keep: Optional[torch.Tensor], reduce: Optional[Callable], carried: tuple = (),
                 keep_logits: bool = False) -> Recorder:
        """A recorder for the blocks of one forward (or one stage): ``keep`` (N,) the tokens that count (None:
        all), ``reduce`` the sum over the ranks sharing the forward's tokens (None: none), ``carried`` the
        stream's ``(stats, probsum)`` of the earlier stages (:meth:`carry`)."""
        rec = Recorder(self.top_k, keep_logits=keep_logits, keep=keep, reduce=reduce)
        if carried:
            stats, probsum = carried
            rec.counts, rec.probsum, rec.tokens = stats[:-1], probsum, stats[-1]
        return rec

    def start(self, device) -> tuple:
        """The first stage's statistics: ``(stats (E + 1,), probsum (E,))``, zeros."""
        return (torch.zeros(self.n_experts + 1, dtype=torch.float32, device=device),
                torch.zeros(self.n_experts, dtype=torch.float32, device=device))

    def carry(self, rec: Recorder) -> tuple:
        """The stream's statistics after a stage's blocks: ``(stats, probsum)``, ``stats`` the counts (E,) and
        then the tokens (no gradient), ``probsum`` (E,) with its gradient."""
        return torch.cat([rec.counts, rec.tokens.reshape(1)]).detach(), rec.probsum

    def aux_term(self, rec: Recorder) -> torch.Tensor:
        """``coef * aux loss`` of what ``rec`` holds (a pipeline's last stage with a sparse layer on some
        stage: the stream's statistics always hold one)."""
        return self.coef * rec.loss(self.n_experts)

    def finish(self, out, rec: Recorder, labels: Optional[torch.Tensor], routed: Optional[bool] = None,
               gather: Optional[Callable] = None):
        """``out`` with ``aux_loss`` and ``router_logits`` (when ``rec`` kept them; each through ``gather``,
        when given, on first read: :class:`GatheredLogits`), and, with ``labels`` and ``routed`` (default:
        the config's), ``loss + coef * aux_loss``, as the model's own forward on one device."""
        routed = self.routed if routed is None else routed
        aux = rec.loss(self.n_experts)
        if routed and labels is not None and aux is not None and out.loss is not None:
            out.loss = out.loss + (self.coef * aux).to(out.loss.dtype)
        out.aux_loss = aux
        logits = None
        if rec.keep_logits:
            logits = tuple(rec.logits) if gather is None else GatheredLogits(rec.logits, gather)
        out.router_logits = logits
        return out


def recording_of(rec: Optional[Recorder]):
    """:func:`~.moe.recording` of ``rec``, or nothing for a dense model (None)."""
    return contextlib.nullcontext() if rec is None else recording(rec)


class GatheredLogits(Sequence):
    """Each sparse layer's router logits, (N, E) with one device's N (the whole batch's tokens), gathered from
    this rank's with ``gather`` when first read. Reading runs collectives: every rank of the group reads
    (as the logits of :class:`~cuboid.zoo.common.Output`); ``len`` reads nothing."""

    def __init__(self, local: list, gather: Callable) -> None:
        self._n = len(local)
        self._made = Deferred(lambda: tuple(gather(t) for t in local))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(self._made, Deferred):
            self._made = self._made.resolve()
        return self._made[i]

    def __repr__(self) -> str:
        return f"GatheredLogits({self._n} layers{', deferred' if isinstance(self._made, Deferred) else ''})"
