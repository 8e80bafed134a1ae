"""Optimizers on the fused multi-tensor kernels: AdamW, LAMB, LARS.

Each class is a ``torch.optim.Optimizer`` whose ``step()`` gathers, per param
group, the params that have a gradient and their state into lists and calls the
matching kernel function of :mod:`cuboid.kernels.optim` once for the group (once
per distinct step count, which is one call unless some params skipped steps).
The kernel picks Triton on CUDA and the ``torch._foreach_*`` reference on CPU;
``backend=`` forces one.

State (per param, what ``state_dict()`` saves):

- ``step``: int, the number of steps this param has taken;
- ``exp_avg`` / ``exp_avg_sq`` (AdamW, LAMB) or ``momentum_buffer`` (LARS): fp32;
- ``master``: an fp32 copy of an fp16/bf16 param when ``master_weights=True``
  (the default). The update is applied to the master and the param receives
  ``master.to(param.dtype)``; fp32 params never get one. The master is taken
  from the param on its first step, so load model weights before stepping.

``load_state_dict`` keeps that state fp32 (torch's default would cast it to a
half param's dtype) and copies it, so a loaded optimizer continues exactly as
the saved one would have.

Param-group keys: AdamW ``lr, betas, eps, weight_decay, maximize``; LAMB
``lr, betas, eps, weight_decay, trust_ratio, exclude_1d``; LARS ``lr, momentum,
eta, weight_decay, trust_ratio, exclude_1d``. ``trust_ratio=False`` makes the
group's tensors skip the layer-wise ratio (r = 1).

The large-batch recipe's exclusion (LAMB and LARS; ``exclude_1d=True``, the
default): a parameter with ``ndim <= 1`` (biases, norm weights and biases)
takes no weight decay and no trust ratio (r = 1), so ``LARS(model.parameters())``
already does what the LAMB/LARS papers' recipes do (TF's
``exclude_from_layer_adaptation``, SimCLR's LARS). The rule reads the shape of
the parameter itself (a tensor-parallel shard has its full tensor's ndim; a
ZeRO piece is judged by its parameter), so every rank of every plan decides
alike and the sharded step stays the single-device one. ``exclude_1d=False``
adapts and decays every tensor. :func:`exclude_bias_and_norm` builds the same
split as two explicit groups (and for AdamW, whose plain path decays all).

``norm_reducer`` (LAMB, LARS, :func:`clip_grad_norm_`): a callable given the
fp32 *squared* per-tensor norms (``(2, n)`` for LAMB/LARS, ``(1, n)`` for
clipping) that returns the reduced tensor, or None after reducing in place.
Sharded runs all-reduce it over the shard groups so every shard takes the same
step a single device would. The default (None) reads each parameter's own
``placement`` (set by the tensor-parallel layers): a sharded model built
with ``cuboid.load(name, plan=...)`` takes the single-device step with
``LAMB(model.parameters())`` and no other argument. The norms of
the last step are kept in ``last_norms`` (a list of ``(params, (2, n) norms)``).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import importlib
import math

import torch

from cuboid.parallel import comm, zero
from cuboid.parallel.layers import placement_of

import cuboid.kernels as kernels  # lazy: the kernel module (and Triton) load on the first step


def _grad_norm_sq(*args, **kwargs):
    return importlib.import_module("cuboid.kernels.optim").grad_norm_sq(*args, **kwargs)

__all__ = ["AdamW", "LAMB", "LARS", "exclude_bias_and_norm", "clip_grad_norm_"]

_HALF = (torch.float16, torch.bfloat16)


class _FusedOptimizer(torch.optim.Optimizer):
    """Shared machinery: lazy fp32 state, master weights, per-group list gathering."""

    _state_keys: tuple = ()
    zero_aware = True  # steps ZeRO pieces (cuboid.parallel.zero)

    def __init__(self, params, defaults, *, master_weights: bool = True,
                 norm_reducer: Optional[Callable] = None, backend: Optional[str] = None):
        super().__init__(params, defaults)
        self.master_weights = bool(master_weights)
        self.norm_reducer = norm_reducer
        self.backend = backend
        self.last_norms: list = []

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        for key in self._state_keys:
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if self.master_weights and p.dtype in _HALF:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    def _buckets(self, group) -> dict:
        """step -> {'params', 'grads', <state keys>, 'master', 'owners'} lists for one group.

        A ZeRO-sharded parameter contributes this rank's piece (its state is
        piece-sized); ``owners`` are the parameters themselves (placements).
        """
        buckets: dict = {}
        for p in group["params"]:
            piece = zero.view_of(p)
            target, grad = (p, p.grad) if piece is None else (piece.param, piece.grad)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                self._init_state(target, state)
            state["step"] += 1
            b = buckets.setdefault(state["step"], {"params": [], "grads": [], "master": [], "owners": [],
                                                   **{k: [] for k in self._state_keys}})
            b["params"].append(target)
            b["grads"].append(grad)
            b["owners"].append(p)
            b["master"].append(state.get("master"))
            for k in self._state_keys:
                b[k].append(state[k])
        for b in buckets.values():
            if all(m is None for m in b["master"]):
                b["master"] = None
        return buckets

    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_norms = []
        params = self._all_params()
        zero.before_step(params)  # ZeRO 1/2: reduce-scatter the gradients into this rank's pieces
        for group in self.param_groups:
            for step, b in self._buckets(group).items():
                norms = self._apply(group, step, b, _reducer_for(self.norm_reducer, b["owners"]))
                if norms is not None:
                    self.last_norms.append((b["owners"], norms))
        zero.after_step(params)  # ZeRO 1/2: all-gather the updated pieces
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        zero.zero_grads(self._all_params())

    def _apply(self, group, step: int, b: dict, reducer=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def load_state_dict(self, state_dict) -> None:
        saved = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in saved:
                continue
            state = self.state[p]
            for k, v in saved[pid].items():
                if k == "step":
                    state[k] = int(v)  # also accepts torch's tensor steps
                elif torch.is_tensor(v) and v.is_floating_point():
                    state[k] = v.detach().to(device=p.device, dtype=torch.float32,
                                             memory_format=torch.contiguous_format, copy=True)


class AdamW(_FusedOptimizer):
    """AdamW (decoupled weight decay), the same step as ``torch.optim.AdamW``, fused over each group."""

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, master_weights: bool = True,
                 backend: Optional[str] = None):
        check_hparams(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize),
                         master_weights=master_weights, backend=backend)

    def _apply(self, group, step, b, reducer=None):
        beta1, beta2 = group["betas"]
        kernels.adamw_step(b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"], lr=float(group["lr"]),
                           beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                           step=step, master_params=b["master"], maximize=group["maximize"],
                           backend=self.backend)


class LAMB(_FusedOptimizer):
    """LAMB (You et al., arXiv 1904.00962) with Adam bias correction; apex FusedLAMB defaults.

    Unlike apex, no global gradient clipping is built in: call
    :func:`clip_grad_norm_` before ``step()`` if you want it.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, trust_ratio: bool = True, exclude_1d: bool = True,
                 master_weights: bool = True, norm_reducer: Optional[Callable] = None,
                 backend: Optional[str] = None):
        check_hparams(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_ratio=trust_ratio, exclude_1d=exclude_1d),
                         master_weights=master_weights, norm_reducer=norm_reducer, backend=backend)

    def _apply(self, group, step, b, reducer=None):
        beta1, beta2 = group["betas"]
        wd, trust = _recipe_flags(group, b["owners"])
        return kernels.lamb_step(b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"],
                                 lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                                 weight_decay=wd, step=step, trust_ratio=trust, master_params=b["master"],
                                 norm_reducer=reducer, backend=self.backend)


class LARS(_FusedOptimizer):
    """LARS (You et al., arXiv 1708.03888): momentum SGD with a layer-wise trust ratio.

    ``r = eta * ||w|| / (||g|| + wd ||w||)``, ``buf = momentum * buf + lr * r *
    (g + wd w)``, ``w -= buf``; a group with ``trust_ratio=False`` and
    ``weight_decay=0`` takes plain momentum-SGD steps, and so (``exclude_1d``,
    the default) do biases and norm weights in any group.
    """

    _state_keys = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, eta: float = 1e-3,
                 weight_decay: float = 0.0, *, trust_ratio: bool = True, exclude_1d: bool = True,
                 master_weights: bool = True, norm_reducer: Optional[Callable] = None,
                 backend: Optional[str] = None):
        check_hparams(lr=lr, weight_decay=weight_decay, eta=eta)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay,
                                      trust_ratio=trust_ratio, exclude_1d=exclude_1d),
                         master_weights=master_weights, norm_reducer=norm_reducer, backend=backend)

    def _apply(self, group, step, b, reducer=None):
        wd, trust = _recipe_flags(group, b["owners"])
        return kernels.lars_step(b["params"], b["grads"], b["momentum_buffer"], lr=float(group["lr"]),
                                 momentum=group["momentum"], eta=group["eta"], weight_decay=wd,
                                 trust_ratio=trust, master_params=b["master"], norm_reducer=reducer,
                                 backend=self.backend)


def _recipe_flags(group, owners):
    """The group's (weight_decay, trust_ratio), per tensor when ``exclude_1d`` opts 1-D ones out.

    Decided from each parameter's own ndim (a shard's is its full tensor's; a
    ZeRO piece is judged by its parameter), so all ranks decide alike. A saved
    group without the key reads it as on.
    """
    wd, trust = float(group["weight_decay"]), bool(group["trust_ratio"])
    if not group.get("exclude_1d", True):
        return wd, trust
    flat = [p.ndim <= 1 for p in owners]
    if not any(flat):
        return wd, trust
    return [0.0 if f else wd for f in flat], [trust and not f for f in flat]


def check_hparams(*, betas=None, **values) -> None:
    """Refuse a negative hyper-parameter (``name=value``) or betas outside [0, 1), in one line."""
    for name, v in values.items():
        if not v >= 0.0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")


def exclude_bias_and_norm(module_or_named_params, weight_decay: float, **group_options) -> list:
    """Two param groups: ndim >= 2 weights (decayed, trust ratio on) and the rest.

    Biases and norm weights/bias (ndim <= 1) go in a group with
    ``weight_decay=0.0, trust_ratio=False`` (they skip decay and the trust ratio,
    as in the LAMB and LARS papers' large-batch recipes). ``group_options``
    (e.g. ``lr``) are set on both groups.
    """
    named = (module_or_named_params.named_parameters()
             if isinstance(module_or_named_params, torch.nn.Module) else module_or_named_params)
    decay, skip = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.ndim >= 2 else skip).append(p)
    return [dict(params=decay, weight_decay=weight_decay, **group_options),
            dict(params=skip, weight_decay=0.0, trust_ratio=False, **group_options)]


def _reducer_for(reducer, params):
    """A plain ``reducer(sq)``, a param-aware one (``reducer.for_params(params)``), or, by default,
    the one the parameters' own placements call for (None when every parameter is whole)."""
    if reducer is None:
        return ShardNormReducer.for_placements(params)
    if hasattr(reducer, "for_params"):
        return reducer.for_params(list(params))
    return reducer


class ShardNormReducer:
    """A ``norm_reducer`` for sharded parameters: per-tensor squared norms summed over their shards.

    ``placements`` maps ``id(param)`` to a :class:`~cuboid.parallel.layers.Placement`
    (the group its shards lie over, and how many ranks of it hold each shard);
    parameters not in it are whole and counted once. Optimizers and
    :func:`clip_grad_norm_` call ``for_params(params)`` to bind the columns of
    the ``(k, n)`` norms tensor to parameters. With no explicit reducer they
    use :meth:`for_placements`, which reads each parameter's own ``placement``.
    """

    def __init__(self, placements: dict) -> None:
        self.placements = dict(placements)

    def for_params(self, params):
        return _placement_reduce([self.placements.get(id(p)) for p in params], [zero.view_of(p) for p in params])

    @staticmethod
    def for_placements(params):
        """The reducer for ``params`` as their ``placement`` attributes (and ZeRO pieces) say; None if
        all are whole."""
        return _placement_reduce([placement_of(p) for p in params], [zero.view_of(p) for p in params])


def _placement_reduce(placements: list, pieces: Optional[list] = None):
    """Columns grouped by the reductions they need: over the tensor-parallel placement's group (each
    shard counted once: divided by its copies) and, for a ZeRO piece, a sum over its dp group."""
    pieces = pieces or [None] * len(placements)
    cols: dict = {}
    for i, (pl, piece) in enumerate(zip(placements, pieces)):
        steps = []
        if pl is not None and pl.group is not None:
            steps.append((pl.group, pl.copies))
        if piece is not None and comm.group_size(piece.group) > 1:
            steps.append((piece.group, 1))
        if steps:
            cols.setdefault(tuple((id(g), c) for g, c in steps), (steps, []))[1].append(i)
    if not cols:
        return None

    def reduce(sq: torch.Tensor) -> torch.Tensor:
        sq = sq.clone()
        for steps, idx in cols.values():
            index = torch.tensor(idx, device=sq.device)
            part = sq.index_select(1, index)
            copies = math.prod(c for _, c in steps)
            if copies != 1:
                part = part / copies
            part = part.contiguous()
            for group, _ in steps:
                comm.all_reduce_(part, group)
            sq.index_copy_(1, index, part)
        return sq

    return reduce


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *,
                    norm_reducer: Optional[Callable] = None, eps: float = 1e-6,
                    backend: Optional[str] = None, sum_group=None, exclude=()) -> torch.Tensor:
    """Scale grads in place so their global L2 norm is at most ``max_norm``; return the norm.

    As ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + eps)``
    clamped at 1), with the per-tensor squared norms computed by the fused
    kernel and passed as ``(1, n)`` through ``norm_reducer`` before summing.
    Pipeline stages pass ``sum_group`` (the squared total is summed over it:
    each stage holds different parameters) and ``exclude`` (ids of parameters
    whose other copy another stage counts, as a tied embedding; they are
    still scaled).
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    zero.before_step(parameters)  # ZeRO 1/2: the norm is of the dp-averaged gradient pieces
    with_grad, grads = [], []
    for p in parameters:
        piece = zero.view_of(p)
        g = p.grad if piece is None else piece.grad
        if g is not None:
            with_grad.append(p)
            grads.append(g)
    if not grads:
        if sum_group is None:
            return torch.zeros(())
        # the sum over the stages is decided by the plan, not by what this rank holds: a stage with nothing
        # trainable (LoRA's frozen embedding and head, ZBV's rank 0 of a 2-block model) still joins with 0
        device = parameters[0].device if parameters else torch.device("cpu")
        total_sq = torch.zeros(1, dtype=torch.float32, device=device)
        comm.all_reduce_(total_sq, sum_group)
        return total_sq.sqrt().reshape(())
    sq = _grad_norm_sq(grads, per_tensor=True, backend=backend).reshape(1, -1)
    norm_reducer = _reducer_for(norm_reducer, with_grad)
    if norm_reducer is not None:
        out = norm_reducer(sq)
        sq = sq if out is None else out
    if exclude:
        keep = torch.tensor([id(p) not in exclude for p in with_grad], device=sq.device)
        sq = sq[:, keep]
    total_sq = sq.sum().reshape(1)
    if sum_group is not None:
        comm.all_reduce_(total_sq, sum_group)
    total = total_sq.sqrt().reshape(())
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
