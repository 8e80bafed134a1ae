"""ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the ``dp`` group.

(Under sequence parallelism over ``dpsp``, dp x sp, where the gradients are averaged: :func:`group_of`;
``N`` below is that group's size.)

Rajbhandari et al. (arXiv 1910.02054). Model-state bytes per rank, for ``P``
parameters over ``N`` dp ranks with Adam-type state (``K`` bytes per
parameter: fp32 moments, plus an fp32 master copy of half-precision
parameters), params of ``b`` bytes and grads of ``b`` bytes:

==========  ====================================  mixed precision (b=2, K=12)
plain dp    ``(2b + K) P``                        16 P
stage 1     ``2b P + K P / N``                    4 P + 12 P / N
stage 2     ``b P + (b + K) P / N``               2 P + 14 P / N
stage 3     ``(2b + K) P / N``                    16 P / N
==========  ====================================  ===========================

(``P / N`` is exactly the rank's shard, padding included:
:func:`model_state_bytes` measures what is held and :func:`formula_bytes`
gives the table's value for the same model.)

Two engines, one view for optimizers and checkpoints:

- **Stages 1 and 2** (:class:`FlatShards`, Megatron's distributed optimizer):
  the trainable parameters are packed into flat buckets (per dtype, on
  parameter boundaries, ``bucket_mb`` each, in reverse order so that backward
  fills the first bucket first); each parameter becomes a view into its
  bucket, and each bucket is cut into ``N`` equal pieces, rank ``r`` owning
  piece ``r``. Stage 1 keeps whole gradients until the step and then
  reduce-scatters each bucket; stage 2 copies each gradient into its bucket
  as it is made (``register_post_accumulate_grad_hook``) and reduce-scatters
  a bucket as soon as all its parameters have their gradient, so only the
  rank's piece outlives backward. The optimizer steps the pieces and the
  buckets are all-gathered. Traffic: reduce-scatter + all-gather = one
  all-reduce.
- **Stage 3** is torch's FSDP2 (``fully_shard``) over the ``dp`` group: one
  unit per block and the root (embeddings, head: a tied embedding is used at
  both ends) kept whole from forward to backward, as FSDP2 does. Its
  parameters are DTensors sharded on dim 0; cuboid's optimizers step their
  local rows. Traffic: all-gather (forward) + all-gather (backward) +
  reduce-scatter per block unit = 1.5 all-reduces, the root unit one.

FSDP2 is not used for stages 1 and 2: its parameters are sharded between
steps whatever ``reshard_after_forward`` says (that flag only keeps the
gathered copy from forward to backward), so it cannot hold the stage 1/2
states of the table, and it has no stage 1.

A parameter's piece is described by :func:`view_of` (a :class:`Piece`: the dp
group, the flat range ``[start, stop)`` of the parameter this rank owns, the
parameter and gradient tensors of that range); cuboid's optimizers, gradient
clipping and checkpoint code read it, so ``AdamW(model.parameters())`` keeps
state for the rank's pieces only and LAMB/LARS/clipping norms are summed over
``dp`` too.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from . import comm

__all__ = ["FlatShards", "Piece", "view_of", "shard_parameters", "reshard", "before_step", "after_step", "zero_grads",
           "full_local", "piece_of", "model_state_bytes", "formula_bytes", "plan_buckets", "group_of", "unscale_",
           "param_tags", "retag"]


def group_of(mesh):
    """The group ZeRO shards over: ``dp``, or under sequence parallelism ``dpsp`` (dp x sp).

    Every sp rank holds every weight and its gradients are averaged over dp x
    sp (the loss's backward is scaled by sp), so the sp ranks are replicas
    like the dp ones: sharding over dp x sp cuts states ``dp * sp`` ways with
    one reduce-scatter + all-gather over that group (the bytes of the
    all-reduce plain sp x dp sends). Sharding over dp alone would keep ``sp``
    times the state and add an all-reduce over sp (DeepSpeed-Ulysses also
    shards ZeRO over its data x sequence group).
    """
    return mesh.group("dpsp") if mesh.size("sp") > 1 else mesh.group("dp")


@dataclass
class Piece:
    """This rank's part of a ZeRO-sharded parameter: elements ``[start, stop)`` of the flattened
    (tensor-parallel local) parameter, whole over ``group``."""

    group: object
    start: int
    stop: int
    shape: tuple            # shape of the piece's tensors (1-D for stages 1/2, local rows for stage 3)
    param: torch.Tensor     # the piece of the parameter (updated in place)
    grad: Optional[torch.Tensor]  # the piece of the dp-averaged gradient, None when the parameter has none


def view_of(p: torch.Tensor) -> Optional[Piece]:
    """The ZeRO piece of parameter ``p`` on this rank, or None when ``p`` is not ZeRO-sharded."""
    slot = getattr(p, "_cuboid_zero", None)
    if slot is not None:
        return slot.piece(p)
    if _is_dtensor(p):
        return _dtensor_piece(p)
    return None


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _dtensor_piece(p) -> Piece:
    local = p._local_tensor
    rows = p.shape[0] if p.dim() else 1
    n = p.device_mesh.size()
    rank = p.device_mesh.get_local_rank()
    row0 = min(rank * math.ceil(rows / n), rows)  # torch.chunk's cut, as FSDP2 shards dim 0
    start = row0 * (p.numel() // max(rows, 1))
    grad = p.grad._local_tensor if p.grad is not None else None
    return Piece(p.device_mesh.get_group(), start, start + local.numel(), tuple(local.shape), local, grad)


# ------------------------------------------------------------------ stages 1 and 2


class _Bucket:
    """Parameters of one dtype packed in one flat buffer, cut into ``n`` equal pieces."""

    def __init__(self, params: list, n: int, rank: int) -> None:
        self.params = params
        self.offsets, off = {}, 0
        for p in params:
            self.offsets[id(p)] = off
            off += p.numel()
        self.numel = off
        self.shard = math.ceil(off / n)
        self.padded = self.shard * n
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        p0 = params[0]
        self.flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p in params:
                o = self.offsets[id(p)]
                view = self.flat[o:o + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        self.grad: Optional[torch.Tensor] = None        # whole (padded) gradient while it is collected
        self.grad_shard: Optional[torch.Tensor] = None  # this rank's piece, dp-averaged
        self.done = False  # reduced in this backward (stage 2) or step
        self.arrived: set = set()


def plan_buckets(params: list, bucket_mb: float = 25.0) -> list:
    """The flat buckets of stages 1/2 for trainable ``params`` (meta tensors do): lists of parameters,
    per dtype and device, in reverse order (backward makes the last gradients first), each closed before
    it would pass ``bucket_mb``."""
    cap = bucket_mb * 2 ** 20
    by_dtype: dict = {}
    for p in reversed(params):
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    buckets = []
    for group_params in by_dtype.values():
        cur, size = [], 0
        for p in group_params:
            nbytes = p.numel() * p.element_size()
            if cur and size + nbytes > cap:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            buckets.append(cur)
    return buckets


class _Slot:
    def __init__(self, engine: "FlatShards", bucket: _Bucket, p: torch.Tensor) -> None:
        self.engine, self.bucket = engine, bucket
        o, k = bucket.offsets[id(p)], p.numel()
        self.offset = o
        self.start = min(max(bucket.lo - o, 0), k)
        self.stop = max(min(bucket.hi - o, k), self.start)

    def piece(self, p) -> Piece:
        b, o = self.bucket, self.offset
        a, z = o + self.start, o + self.stop
        grad = None
        if id(p) in self.engine.got and b.grad_shard is not None:
            grad = b.grad_shard[a - b.lo:z - b.lo]
        return Piece(self.engine.group, self.start, self.stop, (self.stop - self.start,), b.flat[a:z], grad)


class FlatShards:
    """ZeRO stages 1 and 2 for the trainable parameters of ``params`` over the dp ``group``.

    ``hooks``: stage 2 reduces each bucket during backward (off under
    pipeline parallelism, where the schedule's micro-batches and the tied
    embedding's sum come first: then the buckets are reduced at the step, as
    in stage 1, and only the pieces outlive it).
    """

    def __init__(self, params: Iterable[nn.Parameter], group, stage: int, *, bucket_mb: float = 25.0,
                 hooks: bool = True) -> None:
        if stage not in (1, 2):
            raise ValueError(f"FlatShards implements ZeRO stages 1 and 2, not {stage}")
        self.group, self.stage = group, stage
        self.n, self.rank = comm.group_size(group), comm.group_rank(group)
        seen, todo = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                todo.append(p)
        self.params = todo
        self.buckets = [_Bucket(b, self.n, self.rank) for b in plan_buckets(todo, bucket_mb)]
        self.bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[id(p)] = b
                p._cuboid_zero = _Slot(self, b, p)
        self.got: set = set()       # ids of parameters with a gradient this step (the same on every dp rank)
        self.sync = True
        self.reduced = False
        self._callback_queued = False
        self.hooks = hooks and stage == 2
        _refuse_foreign_optimizers()
        if self.hooks:
            for p in todo:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # ---------------------------------------------------------- gradients

    def _collect(self, p) -> None:
        b = self.bucket_of[id(p)]
        o = b.offsets[id(p)]
        if b.grad is None:
            b.grad = torch.zeros(b.padded, dtype=p.grad.dtype, device=p.grad.device)
        b.grad[o:o + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        b.arrived.add(id(p))
        self.got.add(id(p))

    def _on_grad(self, p) -> None:
        if self.sync and not self._callback_queued:  # the first gradient of a synchronised backward
            self._callback_queued = True
            for b in self.buckets:
                b.done = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._collect(p)
        self.reduced = False
        if not self.sync:
            return
        b = self.bucket_of[id(p)]
        if len(b.arrived) == len(b.params):
            self._reduce(b)

    def _end_of_backward(self) -> None:
        """Reduce every bucket this backward has not reduced, with zeros for gradients this rank did not
        make: whether a rank reduces a bucket never depends on which gradients it got (another dp rank
        may have got them, and a reduce-scatter called on one rank alone waits for ever)."""
        self._callback_queued = False
        if self.sync:
            for b in self.buckets:
                if not b.done:
                    self._reduce(b)

    def _reduce(self, b: _Bucket) -> None:
        if b.grad is None:  # no gradient of this bucket on this rank: it contributes zeros
            b.grad = torch.zeros(b.padded, dtype=b.flat.dtype, device=b.flat.device)
        b.done = True
        out = comm.reduce_scatter_(b.grad, self.group)
        out /= self.n
        if b.grad_shard is None:
            b.grad_shard = out
        else:
            b.grad_shard += out
        b.grad = None
        b.arrived.clear()

    def set_sync(self, enabled: bool) -> None:
        """Off: the next backward passes keep whole gradients in the buckets (gradient accumulation)."""
        self.sync = bool(enabled)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce-scatter every gradient not yet reduced: after it each rank holds its pieces only."""
        if self.reduced:
            return
        for p in self.params:
            if p.grad is not None:
                self._collect(p)
        for b in self.buckets:  # stage 1 and pp: every bucket, every step; stage 2: what backward left
            if b.grad is not None or not self.hooks:
                self._reduce(b)
        self.reduced = True

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the updated pieces into every rank's whole parameters."""
        for b in self.buckets:
            comm.all_gather_(b.flat, b.flat[b.lo:b.hi].clone(), self.group)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad = b.grad_shard = None
            b.arrived.clear()
        self.got.clear()
        self.reduced = False

    def grad_bytes(self) -> int:
        """Gradient bytes held now (whole buffers, pieces and gradients not yet collected)."""
        held = sum(t.numel() * t.element_size() for b in self.buckets for t in (b.grad, b.grad_shard)
                   if t is not None)
        return held + sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)


_FOREIGN_HOOK = []


def _refuse_foreign_optimizers() -> None:
    """A torch optimizer over ZeRO 1/2 parameters would see no gradients (they live in the buckets) and
    silently do nothing: refuse it at its first step."""
    if _FOREIGN_HOOK:
        return

    def check(opt, args, kwargs):
        if getattr(opt, "zero_aware", False):
            return
        if any(getattr(p, "_cuboid_zero", None) is not None for g in opt.param_groups for p in g["params"]):
            raise TypeError(f"{type(opt).__name__} cannot step ZeRO stage 1/2 parameters (their gradients are "
                            "sharded over dp); use cuboid.parallel.optim.AdamW, LAMB or LARS")

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _FOREIGN_HOOK.append(register_optimizer_step_pre_hook(check))


def engines_of(params: Iterable[torch.Tensor]) -> list:
    out: dict = {}
    for p in params:
        slot = getattr(p, "_cuboid_zero", None)
        if slot is not None:
            out[id(slot.engine)] = slot.engine
    return list(out.values())


def before_step(params) -> None:
    """Reduce-scatter what is not reduced yet (stage 1; stage 2's leftovers); a no-op for other params."""
    for e in engines_of(params):
        e.reduce_grads()


def after_step(params) -> None:
    for e in engines_of(params):
        e.gather_params()


def zero_grads(params) -> None:
    for e in engines_of(params):
        e.zero_grad()


@torch.no_grad()
def unscale_(scaler, optimizer) -> None:
    """``scaler.unscale_(optimizer)`` on what the optimizer steps: ZeRO pieces, or whole gradients.

    torch's :class:`~torch.amp.GradScaler` unscales ``p.grad``: under ZeRO 1/2 the
    gradients live in the buckets' pieces after the reduce-scatter (stage 2
    leaves ``p.grad`` empty), under ZeRO-3 they are DTensors whose local rows
    are the piece. So the gradients are reduced first (stage 1's
    reduce-scatter, stage 2's leftovers), then each rank checks and unscales
    its pieces with torch's own kernel and records the flags where
    ``scaler.step`` reads them. The flags see only this rank's pieces: make
    them agree over the world (:func:`cuboid.train.step.sync_found_inf`) before
    stepping. Without ZeRO parameters this is ``scaler.unscale_``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pieces = [view_of(p) for p in params]
    if all(pc is None for pc in pieces):
        return scaler.unscale_(optimizer)
    if not scaler.is_enabled():
        return None
    from torch.amp.grad_scaler import OptState

    scale, _ = scaler._check_scale_growth_tracker("unscale_")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.READY:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update(), "
                           "or after step()")
    before_step(params)  # ZeRO 1/2: the pieces the optimizer steps exist after the reduce-scatter
    pieces = [view_of(p) for p in params]
    grads: dict = {}
    for p, pc in zip(params, pieces):
        g = p.grad if pc is None else pc.grad
        if g is None:
            continue
        if g.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        grads.setdefault((g.device, g.dtype), []).append(g)
    inv = scale.double().reciprocal().float()
    found: dict = {scale.device: torch.zeros((), dtype=torch.float32, device=scale.device)}
    for (device, _), gs in grads.items():
        flag = found.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, inv.to(device))
    state["found_inf_per_device"] = found
    state["stage"] = OptState.UNSCALED
    return None


# ------------------------------------------------------------------ stage 3


def param_tags(model: nn.Module) -> dict:
    """Each parameter's tags (``placement``, ``layer_ref``: parallel/layers.py) by name: what a wrap that makes
    new parameter objects (FSDP2's DTensors) puts back with :func:`retag`."""
    return {n: (getattr(p, "placement", None), getattr(p, "layer_ref", None)) for n, p in model.named_parameters()}


def retag(model: nn.Module, tags: dict) -> None:
    """Put :func:`param_tags`' tags back on the parameters of the same names."""
    for name, p in model.named_parameters():
        p.placement, p.layer_ref = tags[name]


def shard_experts_over_edp(experts, expert_group, device_type: str, reshard_after_forward=None) -> set:
    """ZeRO-3 of expert-parallel layers (``experts``): an FSDP2 unit each over ``expert_group`` (``edp``, the
    ranks holding the same experts), made before the units that enclose them. With ``edp`` of one rank (None)
    they stay whole (their gradients are complete): returns their parameters, for the enclosing units to
    leave out (``ignored_params``); else an empty set."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not experts or expert_group is None:
        return {p for m in experts for p in m.parameters()}
    mesh = DeviceMesh.from_group(expert_group, device_type)
    for m in experts:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return set()


def shard_parameters(model: nn.Module, group, blocks: str = "blocks", *, experts=(),
                     expert_group=None) -> nn.Module:
    """ZeRO-3: FSDP2 ``fully_shard`` over the dp ``group``, one unit per block and the root.

    Expert-parallel layers (``experts``) are units of their own over ``expert_group`` (``edp``: the ranks
    holding the same experts, :mod:`.experts`); with ``edp`` of one rank (``expert_group`` None) they stay
    whole (their gradients are complete).
    Parameters keep their names and their tensor-parallel ``placement``.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # zoo blocks return views (a linear's (B*T, C) -> (B, T, C) reshape) and never change them in place,
    # which is what FSDP2's warning is about; the parity tests would fail if a hook were dropped
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    p0 = next(model.parameters())
    mesh = DeviceMesh.from_group(group, p0.device.type)
    tags = param_tags(model)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():  # FSDP2 takes contiguous parameters (folder loads map transposed views)
                p.data = p.data.contiguous()
    for m in model.modules():
        if hasattr(m, "weights_released_after_use"):  # an LM head's lazy logits copy the gathered table in forward
            m.weights_released_after_use = True
    ignored = shard_experts_over_edp(experts, expert_group, p0.device.type)
    for block in getattr(model, blocks, ()):
        fully_shard(block, mesh=mesh, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    model.register_forward_hook(_reshard_without_grad)  # after FSDP2's own post-forward hook
    retag(model, tags)
    return comm.guard_fsdp(model)  # a stalled gather or reduce-scatter names rank, group and op


def _reshard_without_grad(module: nn.Module, args, output):
    """The root unit's post-forward: shard it again after a forward without gradients.

    FSDP2 keeps the root unit gathered from forward to backward and swaps the
    gathered tensors onto the module meanwhile; after a forward that no
    backward follows (an evaluation under ``no_grad``, a generation step) they
    would stay there, so ``model.parameters()`` would hand an optimizer built
    then tensors that never get a gradient. Resharding keeps ``parameters()``
    the same objects before and after every such forward.
    """
    if not torch.is_grad_enabled():
        module.reshard()
    return output


def reshard(model: nn.Module) -> None:
    """Put ZeRO-3's sharded parameters back on the modules.

    FSDP2 keeps the root unit gathered after a forward until backward ends;
    after a forward without backward (evaluation) the modules hold gathered
    plain tensors, not the parameters the optimizer steps. Checkpoints and
    evaluation call this; a no-op for other models.
    """
    for m in model.modules():
        if hasattr(m, "reshard") and type(m).__name__.startswith("FSDP"):
            m.reshard()


# ------------------------------------------------------------------ checkpoints


def full_local(p: torch.Tensor, piece: torch.Tensor, piece_info: Piece) -> torch.Tensor:
    """The whole (tensor-parallel local) tensor shaped like ``p`` from every dp rank's piece; a collective."""
    shape = tuple(p.shape)
    out = torch.zeros(math.prod(shape), dtype=piece.dtype, device=piece.device)
    out[piece_info.start:piece_info.stop] = piece.reshape(-1)
    comm.all_reduce_(out, piece_info.group)  # pieces are disjoint: the sum assembles them
    return out.view(shape)


def piece_of(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece (shaped as the optimizer holds it) of a tensor shaped like ``p``."""
    info = view_of(p)
    return whole.reshape(-1)[info.start:info.stop].reshape(info.shape).clone()


# ------------------------------------------------------------------ bytes


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer=None) -> dict:
    """Bytes this rank holds now for parameters, gradients and optimizer state (masters apart)."""
    params = list(dict.fromkeys(model.parameters()))
    out = {"params": 0, "grads": 0, "optimizer": 0, "masters": 0}
    flat = engines_of(params)
    for p in params:
        local = p._local_tensor if _is_dtensor(p) else p
        out["params"] += _nbytes(local)
        if getattr(p, "_cuboid_zero", None) is None and p.grad is not None:
            g = p.grad._local_tensor if _is_dtensor(p.grad) else p.grad
            out["grads"] += _nbytes(g)
    out["grads"] += sum(e.grad_bytes() for e in flat)
    if optimizer is not None:
        for st in optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    out["masters" if k == "master" else "optimizer"] += _nbytes(v)
    out["total"] = sum(out.values())
    return out


def formula_bytes(numel: int, stage: int, n: int, *, param_bytes: int, state_bytes: int,
                  piece: Optional[int] = None, grad_piece: Optional[int] = None) -> int:
    """The ZeRO table's model-state bytes per rank for ``numel`` parameters over ``n`` dp ranks.

    ``state_bytes``: optimizer bytes per element (fp32 moments, plus 4 for a
    master copy of half-precision params); gradients are ``param_bytes``
    wide. ``piece``: the elements of this rank's pieces (``P / N``; by
    default ``ceil(P / N)``); ``grad_piece``: those of its gradient shard
    (stage 2 keeps whole bucket shards, padding included; default ``piece``).
    """
    piece = math.ceil(numel / n) if piece is None else piece
    grad_piece = piece if grad_piece is None else grad_piece
    b, k = param_bytes, state_bytes
    if stage == 0:
        return (2 * b + k) * numel
    if stage == 1:
        return 2 * b * numel + k * piece
    if stage == 2:
        return b * numel + b * grad_piece + k * piece
    return b * piece + b * grad_piece + k * piece
