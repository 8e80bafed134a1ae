"""``parallelize(model, plan)``: apply a plan to a model, using the model's sharding spec.

Two steps, so that big models never exist whole on a rank:

- :func:`shard` changes the model's structure for the tensor modes (1D in
  this build): it swaps layers for their sharded counterparts by the spec's
  roles. It works on a meta-device model, which is then materialised shard by
  shard (``to_empty`` + ``init_weights`` or a checkpoint load, both through
  the layers' ``load_full``).
- :func:`parallelize` shards (if not done yet), applies activation
  checkpointing, and wraps the model for data parallelism.

A plan asking for what this build lacks (2D/2.5D/3D tensor, pipeline or
sequence parallelism, ZeRO) is a ``NotImplementedError`` naming it, never a
silent single-device run.

Data parallelism is torch's DDP over the mesh's ``dp`` group: gradients are
averaged in buckets while backward runs. DDP composes with the zoo layers
because they are plain modules with plain parameters.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from .mesh import Mesh
from .plan import Plan


@dataclass(frozen=True)
class ShardingSpec:
    """What each layer of a model *is*: module path patterns -> role.

    ``roles`` maps glob patterns (``blocks.*.attn.qkv``) to ``column``,
    ``row``, ``vocab``, ``embedding``, ``norm`` or ``replicate``; the tensor
    modes decide what a role means on their grid. ``blocks`` names the
    repeated blocks (activation checkpointing and pipeline stages cut there).
    """

    roles: dict = field(default_factory=dict)
    blocks: str = "blocks"

    def role_of(self, path: str) -> Optional[str]:
        for pattern, role in self.roles.items():
            if fnmatch.fnmatchcase(path, pattern):
                return role
        return None

    def apply_roles(self, model: nn.Module) -> None:
        """Set ``role`` on every cuboid layer the spec names."""
        for path, mod in model.named_modules():
            role = self.role_of(path)
            if role is not None and hasattr(mod, "role"):
                mod.role = role


def checkpoint_blocks(model: nn.Module, blocks: str = "blocks") -> int:
    """Recompute each block of ``model.<blocks>`` in backward instead of storing its activations.

    Each block's ``forward`` is replaced on the instance rather than wrapped
    in a new module, so module paths (and so checkpoints) do not change.
    Returns the number of blocks wrapped.
    """
    seq = getattr(model, blocks, None)
    if not isinstance(seq, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no ModuleList {blocks!r} to checkpoint")
    for block in seq:
        if getattr(block, "_cuboid_checkpointed", False):
            continue
        plain = block.forward

        def forward(*args, _plain=plain, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._cuboid_checkpointed = True
    return len(seq)


def shard(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]) -> nn.Module:
    """Swap ``model``'s layers for the plan's tensor-parallel ones (in place; meta models too)."""
    plan.require_implemented()
    if mesh.size("tp") == 1:
        if spec is not None:
            spec.apply_roles(model)
        return model
    if spec is None:
        raise ValueError(f"plan {plan.describe()} shards layers by role: pass the model's sharding spec")
    if plan.tp_mode == "1d":
        from .tensor.d1 import shard_1d

        return shard_1d(model, spec, mesh)
    if plan.tp_mode == "2d":
        from .tensor.d2 import shard_2d

        return shard_2d(model, spec, mesh)
    if plan.tp_mode == "2.5d":
        from .tensor.d2p5 import shard_2p5d

        return shard_2p5d(model, spec, mesh)
    from .tensor.d3 import shard_3d

    return shard_3d(model, spec, mesh)


def input_splitter(plan: Plan, mesh: Mesh):
    """``batch -> batch``: the model inputs each rank feeds its layers under the plan's tensor mode.

    1D keeps activations replicated, so the dp share goes in whole; 2D, 2.5D
    and 3D split the batch dim over their grid (labels too: their losses take
    the mean over the whole share). Targets are counted before the split.
    """
    if mesh.size("tp") == 1 or plan.tp_mode == "1d":
        return None
    if plan.tp_mode in ("2d", "2.5d"):
        from .tensor.grid import split_input

        return lambda batch: {k: split_input(v, mesh, 0) for k, v in batch.items()}
    from .tensor.d3 import split_input as split3

    def split(batch: dict) -> dict:
        out = {}
        for k, v in batch.items():
            if k == "attention_mask":  # attention runs on the "inner" batch chunk
                out[k] = split3(v, mesh, 0, layout="inner")
            elif k == "labels" and v.dim() == 1:  # the 3D classifier's logits are whole on every rank
                out[k] = v
            else:
                out[k] = split3(v, mesh, 0)
        return out

    return split


def norm_reducer(model: nn.Module, mesh: Optional[Mesh] = None):
    """An explicit ``norm_reducer`` for ``model``'s parameters (None when all are whole).

    Optimizers and clipping already read each parameter's ``placement``; this
    is the same rule as an object, for callers that pass reducers around.
    """
    from .layers import placement_of
    from .optim import ShardNormReducer

    placements = {id(p): placement_of(p) for p in unwrap(model).parameters() if placement_of(p) is not None}
    return ShardNormReducer(placements) if placements else None


def parallelize(model: nn.Module, plan: Plan, mesh: Optional[Mesh] = None,
                spec: Optional[ShardingSpec] = None) -> nn.Module:
    """Apply ``plan`` to a materialised ``model``; returns the model to train (a DDP wrapper when dp > 1)."""
    plan.require_implemented()
    if mesh is None:
        mesh = Mesh.build(plan, getattr(model, "config", None))
    shard(model, plan, mesh, spec)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("materialise the model (cuboid.zoo.materialize) before parallelize wraps it for training")
    if plan.activation_checkpoint:
        checkpoint_blocks(model, spec.blocks if spec is not None else "blocks")
    if mesh.size("dp") > 1:
        device_ids = None
        p = next(model.parameters())
        if p.device.type == "cuda":
            device_ids = [p.device.index]
        model = DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.group("dp"),
                                        bucket_cap_mb=25)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The zoo model inside whatever ``parallelize`` wrapped it in."""
    return model.module if isinstance(model, DistributedDataParallel) else model
