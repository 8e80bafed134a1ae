"""Expert parallelism: a mixture-of-experts layer's experts sharded over the ``ep`` ranks.

The plan's ``ep`` ranks are taken from its ``dp x sp`` ranks (:class:`~.mesh.Mesh`
groups ``ep`` and ``edp``). Rank ``r`` of an ``ep`` group holds experts
``[r E / ep, (r + 1) E / ep)`` of every sparse layer: :func:`shard_experts`
swaps each module of the spec role ``experts`` (a :class:`cuboid.parallel.moe.Experts`
on the meta model) for its expert-parallel subclass, keeping those rows of
``gate_up`` and ``down``.

Each rank routes its own tokens; the subclass's :meth:`ExpertParallel.dispatch`
(the seam of ``Experts``) then

1. exchanges the per-expert counts: an all-to-all of a fixed-size int64
   tensor of ``E`` counts (rank ``j`` receives, from every rank, the counts of
   its ``E / ep`` experts);
2. sends each rank the rows of its experts: an all-to-all of variable sizes
   (autograd: the backward is the reverse all-to-all);
3. regroups the received rows by local expert (stable, so rows stay in
   source-rank order within an expert) and runs ``compute`` on them;
4. sends the results back the same way and restores the sender's order.

Every rank joins both all-to-alls of both directions whatever its counts
(zero rows are allowed): what a rank sends never decides whether it calls.

**Bytes** (the :mod:`.comm` convention: what this rank sends to other ranks):
the counts exchange is ``(ep - 1) / ep * 8 E`` bytes, each token all-to-all
the rows sent to other ranks times ``row bytes``. :func:`dispatch_bytes` is
that formula; the calls are recorded under ``all_to_all`` in the ``ep`` group
through :func:`cuboid.parallel.comm.record`.

**Gradients.** An expert's weight gradient on its rank sums the
contributions of every token of its ``ep`` group (they came through the
all-to-all), while the step's gradient is the mean over the ``dp x sp``
ranks' losses: the expert gradients must be summed over ``edp`` (the ranks
holding the same experts) and divided by ``dp x sp``. ``dispatch`` divides
the gradient reaching ``compute``'s output by ``ep`` and multiplies the one
leaving its input by ``ep`` (:class:`_GradScale`: identity forward; exact for
a power of two), so the expert weights' gradients arrive already divided by
``ep`` and the tokens' are unchanged; what remains is a plain average over
``edp``, as every other parameter is averaged over ``dp`` (``dp x sp``).
:class:`ExpertGrads` averages them under plain data parallelism (at the end
of each synchronised backward); ZeRO 1/2 buckets and ZeRO-3 units of the
experts are made over ``edp`` (:mod:`.zero`); with ``edp`` of one rank
(``ep = dp x sp``) they are complete as they are.

**Placement.** Expert parameters carry ``placement`` =
``Placement(ep group, 1)`` (their distinct rows lie over ``ep``: norms sum
over it once), and the layer answers the full-tensor interface of
checkpoints (``full_shape``, ``shard_slices``, ``full_tensor``,
``full_tensor_like``, ``load_full``) for the whole ``(E, ...)`` tensors.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .layers import Placement

__all__ = ["ExpertParallel", "shard_experts", "expert_modules", "expert_parameters", "all_to_all_v",
           "exchange_counts", "dispatch_bytes", "ExpertGrads", "average_grads", "BalanceReduce",
           "balance_reduce_for"]

ROLE = "experts"  # the spec role of a mixture-of-experts layer's experts


# ----------------------------------------------------------------- collectives


def _all_to_all_single(out: torch.Tensor, x: torch.Tensor, group, out_rows: list, in_rows: list, what: str):
    with comm.guarded(what, group):
        dist.all_to_all_single(out, x, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group)


def _rows_bytes(x: torch.Tensor, rows: list, me: int) -> float:
    per_row = math.prod(x.shape[1:]) * x.element_size()
    return float((sum(rows) - rows[me]) * per_row)


class _AllToAllV(torch.autograd.Function):
    """Rows ``send[j]`` of ``x`` (in order) to rank ``j``; ``recv[j]`` rows from rank ``j``; backward: the
    reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group, send: list, recv: list):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _exchange(x, group, send, recv)

    @staticmethod
    def backward(ctx, dy):
        return _exchange(dy, ctx.group, ctx.recv, ctx.send), None, None, None


def _exchange(x: torch.Tensor, group, send: list, recv: list) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.record("all_to_all", group, _rows_bytes(x, send, comm.group_rank(group)))
    _all_to_all_single(out, x, group, recv, send, "all_to_all (expert tokens)")
    return out


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.factor, None


def all_to_all_v(x: torch.Tensor, group, send: list, recv: list) -> torch.Tensor:
    """Variable-size all-to-all along dim 0 (autograd: the backward sends the gradient back); ``x`` itself
    for a group of one."""
    if not comm.active(group):
        return x
    return _AllToAllV.apply(x, group, list(send), list(recv))


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (E,) of this rank's rows per global expert -> (ep, E / ep): row ``i`` holds how many rows
    rank ``i`` sends to each of this rank's experts. A fixed-size all-to-all: every rank calls it."""
    p = comm.group_size(group)
    counts = counts.to(torch.int64).contiguous()
    if p == 1:
        return counts.reshape(1, -1)
    out = torch.empty_like(counts)
    comm.record("all_to_all", group, (p - 1) / p * counts.numel() * counts.element_size())
    with comm.guarded("all_to_all (expert counts)", group):
        dist.all_to_all_single(out, counts, group=group)
    return out.reshape(p, -1)


def dispatch_bytes(counts: torch.Tensor, ep: int, rank: int, row_bytes: int, recv_counts=None) -> float:
    """Bytes one rank sends in one expert-parallel forward of one layer, as :mod:`.comm` counts them: the
    counts exchange plus the token rows to the other ranks' experts (there) and, given the counts it
    received ``recv_counts`` (ep, E / ep), the result rows sent back."""
    e = counts.numel()
    per = counts.reshape(ep, e // ep).sum(1).tolist()
    total = (ep - 1) / ep * 8 * e + (sum(per) - per[rank]) * row_bytes
    if recv_counts is not None:
        back = recv_counts.sum(1).tolist()
        total += (sum(back) - back[rank]) * row_bytes
    return float(total)


# ----------------------------------------------------------------- the layer


class ExpertParallel:
    """Mixin placed before a single-device ``Experts`` class: this rank's experts and the all-to-all
    ``dispatch`` (module docstring). ``n_experts`` stays the global count; ``first_expert`` is this
    rank's first expert."""

    ep_group = None
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def local_experts(self) -> int:
        return self.n_experts // self.ep_size

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group, p, local = self.ep_group, self.ep_size, self.local_experts
        recv_counts = exchange_counts(counts, group)                     # (p, local)
        send = counts.reshape(p, local).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        x_in = all_to_all_v(x_sorted, group, send, recv)                 # by source rank, then expert
        expert = torch.arange(local, device=x_in.device).repeat(p).repeat_interleave(recv_counts.reshape(-1))
        order = torch.argsort(expert, stable=True)
        x_in = _GradScale.apply(x_in.index_select(0, order), float(p))  # the tokens' gradient unchanged ...
        y = _GradScale.apply(self.compute(x_in, recv_counts.sum(0).to(counts.device)), 1.0 / p)  # ... weights' / ep
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_v(y.index_select(0, back), group, recv, send)

    # ---------------------------------------------------------- the full-tensor interface

    def norm_placement(self, name: str) -> Optional[Placement]:
        return Placement(self.ep_group, 1) if self.ep_size > 1 else None

    def full_shape(self, name: str) -> torch.Size:
        local = self._param(name).shape
        return torch.Size((local[0] * self.ep_size,) + tuple(local[1:]))

    def shard_slices(self, name: str) -> tuple:
        shape = self.full_shape(name)
        first = self.first_expert
        return (slice(first, first + self.local_experts),) + tuple(slice(0, n) for n in shape[1:])

    def full_tensor(self, name: str) -> torch.Tensor:
        return self.full_tensor_like(name, self.local_tensor(name))

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole ``(E, ...)`` tensor of a local one shaped like ``name``: gathered over ``ep`` (a
        collective)."""
        return torch.cat(comm.all_gather_list(local.detach().contiguous(), self.ep_group), dim=0)


_CLASSES: dict = {}


def _parallel_class(cls: type) -> type:
    if issubclass(cls, ExpertParallel):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _keep_rows(mod: nn.Module, lo: int, hi: int) -> None:
    for name, p in list(mod.named_parameters(recurse=False)):
        rows = p.detach()[lo:hi]
        new = nn.Parameter(rows if p.is_meta else rows.clone(), requires_grad=p.requires_grad)
        setattr(mod, name, new)


def shard_experts(model: nn.Module, spec, mesh) -> int:
    """Swap every module of role ``experts`` for its expert-parallel subclass holding this rank's experts
    (in place; meta models too). Returns how many were swapped (0 without ``ep``)."""
    p = mesh.size("ep")
    if p == 1 or spec is None:
        return 0
    swapped = 0
    for path, mod in list(model.named_modules()):
        if spec.role_of(path) != ROLE or isinstance(mod, ExpertParallel) or getattr(mod, "placeholder", False):
            continue
        e = mod.n_experts
        if e % p:
            raise ValueError(f"{path}: {e} experts do not divide over ep={p} expert-parallel ranks")
        rank = mesh.coords["ep"]
        lo = rank * (e // p)
        _keep_rows(mod, lo, lo + e // p)
        mod.__class__ = _parallel_class(type(mod))
        mod.ep_group, mod.ep_size, mod.ep_rank, mod.first_expert = mesh.group("ep"), p, rank, lo
        mod.role = ROLE
        mod.tag_placements()
        swapped += 1
    return swapped


def expert_modules(model: nn.Module) -> list:
    """The expert-parallel layers of ``model``."""
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]


def expert_parameters(model: nn.Module) -> list:
    """The parameters of the expert-parallel layers (averaged over ``edp``, not ``dp``)."""
    return [p for m in expert_modules(model) for p in m.parameters()]


# ----------------------------------------------------------------- gradients under plain data parallelism


class ExpertGrads:
    """Plain data parallelism for the experts: at the end of every synchronised backward that went through
    an expert layer, each expert gradient is averaged over ``edp`` (one flat all-reduce; a parameter
    without a gradient contributes zeros).

    The reduction is queued by the backward of each layer's combine all-to-all, which every rank runs
    whenever backward passes through the layer (the plan decides it, not the tokens a rank holds).
    """

    def __init__(self, modules: Iterable[nn.Module], group) -> None:
        self.modules = list(modules)
        self.group = group
        self.sync = True
        self._queued = False
        for m in self.modules:
            m.register_full_backward_pre_hook(self._on_backward)

    @property
    def params(self) -> list:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def _on_backward(self, module, grad_output):
        if self.sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
        return None

    def set_sync(self, enabled: bool) -> None:
        self.sync = bool(enabled)

    def _reduce(self) -> None:
        self._queued = False
        average_grads(self.params, self.group)


@torch.no_grad()
def average_grads(params: list, group) -> None:
    """The gradients of the trainable ``params`` averaged over ``group``, one flat all-reduce per dtype. The
    list must be the same on every rank of the group: a parameter without a gradient sends zeros."""
    by_dtype: dict = {}
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    size = comm.group_size(group)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_(flat, group)
        flat /= size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


# ----------------------------------------------------------------- the load-balancing loss under plans


class BalanceReduce:
    """A mixture-of-experts model's ``balance_reduce`` under a plan that spreads each forward's tokens over
    the ranks of ``group`` (dp x sp): the auxiliary loss of the whole (global) micro-batch.

    One all-reduce (no gradient) sums the statistics of every rank: the loss's value is the single-device
    loss of the global micro-batch, ``n_experts * sum(counts * probsum) / tokens ** 2`` of the sums, on
    every rank. Its gradient is each rank's own term, ``n_experts * sum(counts_global * probsum_local) /
    tokens_global ** 2``, times the group's size: the gradient average over the group (data parallelism)
    then gives the sum of the terms, the single-device gradient. (:func:`cuboid.train.step.train_step` weighs
    the auxiliary loss by its micro-batch's share of the global batch, not by this rank's share.)"""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, counts: torch.Tensor, probsum: torch.Tensor, tokens, n_experts: int) -> torch.Tensor:
        e = counts.numel()
        tokens = torch.as_tensor(tokens, dtype=torch.float32, device=probsum.device)
        stats = torch.cat([counts.detach().float().reshape(-1), probsum.detach().float().reshape(-1),
                           tokens.detach().float().reshape(1)])
        comm.all_reduce_(stats, self.group)  # every rank, every forward: the plan decides it
        total_counts, total_probs, total_tokens = stats[:e], stats[e:2 * e], stats[-1]
        value = n_experts * torch.sum(total_counts * total_probs) / (total_tokens * total_tokens)
        mine = n_experts * torch.sum(total_counts * probsum.float()) / (total_tokens * total_tokens)
        mine = mine * comm.group_size(self.group)
        return value + (mine - mine.detach())


def balance_reduce_for(model: nn.Module, group) -> Optional[BalanceReduce]:
    """The plan's :class:`BalanceReduce` over ``group`` for a mixture-of-experts ``model`` (one with router
    statistics: ``config.n_experts``); None for a dense model or without a group (one rank sees every token)."""
    if group is None or not getattr(getattr(model, "config", None), "n_experts", 0):
        return None
    return BalanceReduce(group)
