"""Apply a plan to a model, using the model's sharding spec: ``shard`` then ``prepare``.

Two steps, so that big models never exist whole on a rank:

- :func:`shard` changes the model's structure for the tensor modes (1D, 2D,
  2.5D, 3D): it swaps layers for their sharded counterparts by the spec's
  roles. It works on a meta-device model, which is then materialised shard by
  shard (``to_empty`` + ``init_weights`` or a checkpoint load, both through
  the layers' ``load_full``).
- :func:`prepare` makes the materialised model a drop-in for the
  single-device one (``cuboid.load`` calls both): it gives the model its
  :class:`~.state.ParallelState` (``model.parallel``: plan, mesh and what the
  plan built), splits the batch and gathers outputs for the modes that cut
  the batch, applies activation recompute, and averages gradients over
  ``dp``.

A plan asking for what this build lacks (``Plan.unimplemented``: sequence
parallelism with 2D/2.5D/3D tensor parallelism, ZeRO-3 under ZBV) is a
``NotImplementedError`` naming it, never a silent single-device run.

Data parallelism is torch's composable DDP (``replicate``) over the mesh's
``dp`` group: gradients are averaged in buckets while backward runs, and the
model keeps its class and parameter names (checkpoints do not change). With
``zero`` > 0 the dp group shards instead (:mod:`.zero`): stages 1 and 2 pack
the parameters into flat buckets (``model.parallel.zero``), stage 3 is FSDP2.
"""
from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel  # only to unwrap models users wrapped themselves

from . import comm, zero
from .batch import BatchSplit
from .experts import balance_reduce_for
from .mesh import Mesh
from .plan import Plan
from .recompute import recompute_blocks
from .spec import ShardingSpec, blocks_of
from .state import ParallelState, attach, planned, state_of


def shard(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]) -> nn.Module:
    """Swap ``model``'s layers for the plan's tensor-parallel ones (in place; meta models too)."""
    from .experts import shard_experts
    from .tensor import shard_model

    plan.require_implemented()
    shard_model(model, spec, mesh)
    shard_experts(model, spec, mesh)  # ep: this rank's experts and the all-to-all dispatch
    return model


def prepare(model: nn.Module, plan: Plan, mesh: Optional[Mesh] = None, spec: Optional[ShardingSpec] = None) -> nn.Module:
    """Make a materialised model (sharded for ``plan`` if it is not yet) a drop-in for the single-device one.

    In place, and returns ``model`` itself (same class, same parameter names):

    - ``model.parallel`` holds the plan, the mesh and what the plan built
      (:class:`~.state.ParallelState`; read it through :func:`~.state.state_of`);
    - under 2D/2.5D/3D a :class:`~.batch.BatchSplit` takes the dp share in and
      gives single-device outputs back;
    - dropout masks follow the layout (:class:`~cuboid.parallel.layers.Dropout`):
      the default generator is made equal over ``tp`` (replicated
      activations drop alike) and batch-block layouts draw per-rank masks;
    - the plan's activation recompute (``checkpoint``: full or selective) is applied per block;
    - with ``dp > 1``, torch's composable DDP (``replicate``) averages
      gradients over the mesh's ``dp`` group during backward, or, with
      ``zero``, ZeRO shards optimizer state, gradients and (stage 3)
      parameters over it;
    - every parameter carries its placement (optimizers and clipping read it).

    Calling it again with the same plan does nothing; a model prepared for one
    device (``cuboid.load(name)``) may be prepared again for a plan.
    """
    if _prepared_already(model, plan):
        return model
    plan.require_implemented()
    if mesh is None:
        mesh = Mesh.build(plan, getattr(model, "config", None))
    _materialised_shards(model, plan, mesh, spec)
    before = planned(model)
    state = ParallelState(plan=plan, mesh=mesh, spec=spec, stages=before.stages if before is not None else None)
    _layout_dropout(model, plan, mesh)
    if mesh.size("tp") > 1 and plan.tp_mode != "1d":
        state.batch_split = BatchSplit(plan, mesh)
        if mesh.size("pp") == 1:  # (pp: the pipeline's first stage splits)
            state.batch_split.install(model)
    state.sequence_split = _sequence_split(model, plan, mesh, spec)
    # mixture of experts: the load-balancing statistics of each forward summed over the ranks sharing its tokens
    # (dp x sp; under sp alone the sequence split sums them over sp itself)
    if mesh.size("dp") > 1:
        state.balance_reduce = balance_reduce_for(model, zero.group_of(mesh))
    if plan.checkpoint != "none":
        recompute_blocks(model, blocks_of(spec), plan.checkpoint)
    if plan.compile:  # torch.compile each block in place (torchtitan's per-block compile)
        from .compile import compile_blocks

        compile_blocks(model, blocks_of(spec))
    if mesh.size("pp") > 1:  # the schedule drives forward/backward; it averages over dp itself
        _build_pipeline(model, state)
    elif plan.zero and (mesh.size("dp") > 1 or mesh.size("sp") > 1):
        _shard_over_dp(model, state)
    elif mesh.size("dp") > 1 or mesh.size("sp") > 1:
        _replicate(model, state)
    state.prepared = True
    attach(model, state)
    state.install_forward(model)
    return model


def _prepared_already(model: nn.Module, plan: Plan) -> bool:
    """Whether ``model`` is prepared for ``plan`` (or for a plan and asked for one device); a model
    prepared for another multi-device plan is an error."""
    before = planned(model)
    done = before.plan if before is not None and before.prepared else None
    if done is not None and (done == plan or plan.world_size == 1):
        return True
    if done is not None and done.world_size > 1:
        raise ValueError(f"the model is already prepared for plan {done.describe()}; load it again for "
                         f"plan {plan.describe()}")
    return False


def _materialised_shards(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]) -> None:
    """Shard ``model`` for the plan's tensor mode (a no-op when it is), check it is allocated, and tag every
    parameter with its placement."""
    shard(model, plan, mesh, spec)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("materialise the model (cuboid.zoo.materialize) before preparing it for training")
    for mod in model.modules():
        if hasattr(mod, "tag_placements"):
            mod.tag_placements()


def _layout_dropout(model: nn.Module, plan: Plan, mesh: Mesh) -> None:
    """Replicated activations drop the same elements on every tp rank; under the modes where every
    activation is a distinct block (2D, 2.5D, 3D) each rank draws its own masks."""
    if mesh.size("tp") == 1:
        return
    from .layers import Dropout, sync_rng

    sync_rng(mesh.group("tp"))
    if plan.tp_mode != "1d":
        for mod in model.modules():
            if isinstance(mod, Dropout):
                mod.sharded_rank = mesh.coords["tp"]


def _sequence_split(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]):
    """The model's split of every sequence: over ``sp`` (blocks on this rank's chunks, attention over the
    ring or all-to-all) or, under ``tp_sequence``, over ``tp`` (Megatron's sequence parallelism); None."""
    if mesh.size("sp") > 1:
        from .layers import sync_rng
        from .sequence_split import SequenceSplit

        if spec is None:
            raise ValueError("sequence parallelism needs the model's sharding spec (cuboid.load passes it)")
        sync_rng(mesh.group("sp"))  # the embeddings run on the whole sequence on every sp rank
        split = SequenceSplit(model, spec, mesh)
        split.swap_attention(plan.sp_mode)
        return split
    if plan.tp_sequence and mesh.size("tp") > 1:
        from .sequence_split import TensorSequenceSplit

        if spec is None:
            raise ValueError("tp_sequence needs the model's sharding spec (cuboid.load passes it)")
        return TensorSequenceSplit(model, spec, mesh)
    return None


def _build_pipeline(model: nn.Module, state: ParallelState) -> None:
    """Under pp: the :class:`~.pipeline.Pipeline` over this rank's stages, with ZeRO over dp (x sp) inside
    it (stage 3: FSDP2 units per block and stage; stages 1 and 2: flat buckets reduced at the step)."""
    from .pipeline import Pipeline

    plan, mesh = state.plan, state.mesh
    if state.stages is None:
        raise ValueError("a pp plan needs the model cut into stages first (cuboid.load does it)")
    group = zero.group_of(mesh)  # dp, or dp x sp under sp (every sp rank holds every weight)
    sharded = plan.zero == 3 and group is not None
    state.pipeline = Pipeline(model, state.spec, mesh, state.stages, schedule=plan.schedule,
                              microbatches=plan.microbatches, batch_split=state.batch_split,
                              sequence_split=state.sequence_split, shard_group=group if sharded else None)
    if plan.zero in (1, 2) and group is not None:  # the pieces are reduced at the step, after the schedule
        from .experts import expert_parameters

        ids = {id(p) for p in expert_parameters(model)}  # ep: the experts' own buckets over edp
        state.zero = state.pipeline.zero = zero.FlatShards([p for p in state.pipeline.params if id(p) not in ids],
                                                           group, plan.zero, hooks=False)
        if ids:
            state.expert_zero = zero.FlatShards([p for p in state.pipeline.params if id(p) in ids],
                                                mesh.group("edp"), plan.zero, hooks=False)


def _shard_over_dp(model: nn.Module, state: ParallelState) -> None:
    """ZeRO over the dp group (:mod:`.zero`): flat buckets for stages 1 and 2, FSDP2 for stage 3.

    Under sp the group is ``dpsp`` (dp x sp): every sp rank holds every weight and gradients are averaged
    over dp x sp, so ZeRO cuts states dp * sp ways (:func:`.zero.group_of`)."""
    from .experts import expert_modules, expert_parameters

    group, mesh = zero.group_of(state.mesh), state.mesh
    experts = expert_modules(model)
    if state.plan.zero == 3:
        edp = mesh.group("edp")
        zero.shard_parameters(model, group, blocks_of(state.spec), experts=experts, expert_group=edp)
        state.gradient_sync = model.set_requires_gradient_sync  # FSDP2's, over every unit
        return
    ids = {id(p) for p in expert_parameters(model)}
    state.zero = zero.FlatShards([p for p in model.parameters() if id(p) not in ids], group, state.plan.zero)
    syncs = [state.zero.set_sync]
    if experts:  # the experts' own buckets over the ranks holding the same experts
        state.expert_zero = zero.FlatShards(expert_parameters(model), mesh.group("edp"), state.plan.zero)
        syncs.append(state.expert_zero.set_sync)
    state.gradient_sync = _all_of(syncs)


def _all_of(switches: list):
    """One gradient-sync switch that sets each of ``switches``."""
    def sync(enabled: bool) -> None:
        for each in switches:
            each(enabled)

    return sync


def _replicate(model: nn.Module, state: ParallelState) -> None:
    """Plain data parallelism: torch's composable DDP over ``dp`` (``dpsp`` under sp), its average made
    through :func:`.comm.ddp_comm_hook` so that :func:`.comm.count` sees it."""
    from torch.distributed._composable import replicate

    from .experts import ExpertGrads, expert_modules

    mesh = state.mesh
    p = next(model.parameters())
    group = mesh.group("dpsp") if mesh.size("sp") > 1 else mesh.group("dp")
    experts = expert_modules(model)  # ep: averaged over edp by their own engine
    replicate(model, process_group=group, bucket_cap_mb=25, ignored_modules=experts or None,
              **({"device_id": p.device} if p.device.type == "cuda" else {}))
    model.register_comm_hook(group, comm.ddp_comm_hook)
    state.gradient_sync = model.set_requires_gradient_sync  # replicate's
    if experts and mesh.group("edp") is not None:  # ep < dp x sp: averaged over the ranks holding them
        state.expert_grads = ExpertGrads(experts, mesh.group("edp"))
        state.gradient_sync = _all_of([model.set_requires_gradient_sync, state.expert_grads.set_sync])


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the dp gradient all-reduce of the next backward on or off (gradient accumulation)."""
    state_of(unwrap(model)).set_gradient_sync(enabled)


def unwrap(model: nn.Module) -> nn.Module:
    """The zoo model inside a torch DDP wrapper (``prepare`` itself never wraps)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
