"""Apply a plan to a model, using the model's sharding spec: ``shard`` then ``prepare``.

Two steps, so that big models never exist whole on a rank:

- :func:`shard` changes the model's structure for the tensor modes (1D, 2D,
  2.5D, 3D): it swaps layers for their sharded counterparts by the spec's
  roles. It works on a meta-device model, which is then materialised shard by
  shard (``to_empty`` + ``init_weights`` or a checkpoint load, both through
  the layers' ``load_full``).
- :func:`prepare` makes the materialised model a drop-in for the
  single-device one (``cuboid.load`` calls both): it records ``model.plan``
  and ``model.mesh``, splits the batch and gathers outputs for the modes that
  cut the batch, applies activation checkpointing, and averages gradients
  over ``dp``.

A plan asking for what this build lacks (``Plan.unimplemented``: sequence
parallelism with 2D/2.5D/3D tensor parallelism, ZeRO-3 under ZBV) is a
``NotImplementedError`` naming it, never a silent single-device run.

Data parallelism is torch's composable DDP (``replicate``) over the mesh's
``dp`` group: gradients are averaged in buckets while backward runs, and the
model keeps its class and parameter names (checkpoints do not change). With
``zero`` > 0 the dp group shards instead (:mod:`.zero`): stages 1 and 2 pack
the parameters into flat buckets (``model.zero``), stage 3 is FSDP2.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel  # only to unwrap models users wrapped themselves
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from . import comm
from .mesh import Mesh
from .batch import pad_rows
from .plan import Plan


@dataclass(frozen=True)
class ShardingSpec:
    """What each layer of a model *is*: module path patterns -> role.

    ``roles`` maps glob patterns (``blocks.*.attn.qkv``) to ``column``,
    ``column_qkv``, ``column_kv`` (grouped key/value heads), ``row``,
    ``vocab``, ``embedding``, ``norm`` or ``replicate``; the tensor
    modes decide what a role means on their grid. ``blocks`` names the
    repeated blocks (activation checkpointing and pipeline stages cut there);
    ``first`` and ``last`` name the modules of the pipeline's ends.
    """

    roles: dict = field(default_factory=dict)
    blocks: str = "blocks"
    shifted_labels: bool = False  # token t's label is token t + 1 (a causal LM head shifts): sp aligns them
    pooled_first: bool = False    # the head reads position 0 (a pooler): sp gives every rank the true first token
    first: tuple = ()   # top-level modules the first pipeline stage owns (embeddings)
    last: tuple = ()    # those the last stage owns (final norm, pooler, heads); a module in both is tied

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


CHECKPOINT_MODES = ("full", "selective")


def checkpoint_blocks(model: nn.Module, blocks: str = "blocks", mode: str = "full",
                      keep_collectives: bool = False) -> int:
    """Recompute each block of ``model.<blocks>`` in backward instead of storing its activations.

    ``mode`` ``full`` keeps each block's inputs and recomputes the whole block;
    ``selective`` keeps what is dear to make (the outputs of the matmuls and of
    fused attention: :func:`selective_policy`, :class:`SelectiveContexts`)
    and recomputes the cheap ops between them (norms, activations, dropout,
    adds). Both run through ``torch.utils.checkpoint`` (non-reentrant), which
    saves and restores the RNG state, so a recomputed dropout drops the same
    elements. A block's collectives run again in its recompute, on every rank
    alike, as under ``full``; ``keep_collectives`` (selective only) keeps
    their results instead and sends nothing again, at the price of holding
    them (see :class:`SelectiveContexts` for when that costs more memory than
    it saves).

    Each block's ``forward`` is replaced on the instance rather than wrapped
    in a new module, so module paths (and so checkpoints) do not change, and
    whoever calls the blocks (the model, sequence splits, pipeline stages)
    recomputes them. Applying another mode replaces the first. Returns the
    number of blocks wrapped.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint mode must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    seq = getattr(model, blocks, None)
    if not isinstance(seq, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no ModuleList {blocks!r} to checkpoint")
    if keep_collectives and mode != "selective":
        raise ValueError("keep_collectives applies to mode selective (full recompute keeps only block inputs)")
    how = (mode, keep_collectives)
    for block in seq:
        if getattr(block, "_cuboid_checkpoint_how", None) == how:
            continue
        plain = getattr(block, "_cuboid_plain_forward", None) or block.forward
        extra = ({"context_fn": functools.partial(selective_contexts, keep_collectives=keep_collectives)}
                 if mode == "selective" else {})

        def forward(*args, _plain=plain, _extra=extra, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **_extra, **kwargs)

        block.forward = forward
        block._cuboid_plain_forward = plain
        block._cuboid_checkpointed, block._cuboid_checkpoint_how = mode, how
    return len(seq)


# ------------------------------------------------------------------ selective activation checkpointing

def _ops(*names: str) -> frozenset:
    """The ``aten`` overloads of ``names`` this build of torch has (``mm.default``, ...)."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return frozenset(out)


# what selective checkpointing keeps: the matmuls of linear layers (``F.linear`` is ``mm``/``addmm`` on any
# number of leading dims) and torch's fused attention (its output and log-sum-exp, O(T) per head). Not
# ``bmm``: here it is only the score and probability products of the plain-torch attention (the ring's and
# the return_lse path's), whose (T x T) outputs are what flash attention avoids keeping; that attention is
# recomputed, as in Megatron's selective recompute. The Triton attention (CUDA) is an autograd Function whose
# kernels the dispatcher does not see, so it is recomputed too.
SAVED_OPS = _ops("mm.default", "addmm.default", "_scaled_mm.default", "_scaled_dot_product_flash_attention.default",
                 "_scaled_dot_product_flash_attention_for_cpu.default", "_scaled_dot_product_efficient_attention.default",
                 "_scaled_dot_product_cudnn_attention.default", "_flash_attention_forward.default",
                 "_efficient_attention_forward.default")

# ops whose count differs between a forward and its recompute (torch's checkpoint adds detaches): never saved
_UNCOUNTED = _ops("detach.default") | frozenset([torch.ops.prim.device.default])


def selective_policy(ctx, op, *args, **kwargs):
    """The per-op policy of ``checkpoint=selective``, in torch's selective-checkpoint protocol (torchtitan's
    ``op`` mode): :data:`SAVED_OPS` ``MUST_SAVE``, everything else ``PREFER_RECOMPUTE``. Collectives are
    not asked about (:class:`SelectiveContexts` re-runs them, or keeps them all)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _is_collective(func) -> bool:
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


def _written(func, args) -> list:
    """The tensors a ``c10d`` op writes into: its first argument, for the in-place ops (``name_``)."""
    name = func._schema.name.split("::")[-1]
    return _tensors(args[0]) if name.endswith("_") and args else []


class SelectiveContexts:
    """The ``context_fn`` of one selectively checkpointed block call: a forward mode that keeps what the
    policy saves, and a recompute mode that hands it back and runs everything else again.

    It follows torch's selective checkpointing (``create_selective_checkpoint_contexts``: a dispatch mode
    that caches the outputs of the ops the policy marks ``MUST_SAVE``/``PREFER_SAVE`` in forward and
    returns them in recompute), with replays that do not consume the cache: torch's recompute mode marks
    each entry used, so a second backward over the region raises, and torch's pipelining runs two (the ZBV
    schedule's input pass and weight pass each unpack the block's saved tensors, and each recomputes it).

    **Collectives.** The dispatcher shows the ``c10d`` ops inside :mod:`.comm`'s autograd Functions, not
    the Functions. By default they run again in the recompute, as under full recompute: every rank
    recomputes the same blocks in the same order, so they stay matched, and ``comm.count`` counts the
    bytes sent again. They cannot simply be marked ``MUST_SAVE``: they write their result into an argument
    (``allreduce_``, ``_allgather_base_``, ``alltoall_base_``, ``recv_``, ...) and their schemas do not say
    so, so a cached return value would skip the write and leave the buffer the caller reads empty.
    ``keep_collectives=True`` keeps what each one wrote instead (references: the buffers become
    activations of the block), and the recompute writes those values into its own buffers and returns
    completed ``Work`` objects, sending nothing (``comm.count`` sees nothing then). Measured on gpt2-shaped
    blocks (``bench/checkpointing.py``'s counter, fp32 elements per token and hidden unit): that costs more
    than it saves almost everywhere, since a row linear's partial sum is kept beside its all-reduced
    result, ``tp_sequence`` keeps its all-gathered inputs, all-to-all its exchanged heads and the ring its
    received K/V: 9.5 against 7.5 re-running them at tp=2, 10.8 (more than no checkpointing's 8.9) under
    ``tp_sequence``, 13.8 (ring) and 18.8 (all-to-all, no checkpointing 16.8) at sp=2; so it is an option
    for links slower than memory is short, not the plan's default.

    A cached tensor changed in place after the forward is an error at recompute (as in torch), never a
    silent wrong gradient. Random ops are recomputed from the RNG state torch's checkpoint restores, in
    the forward's order, so dropout masks replay exactly.
    """

    def __init__(self, policy=None, keep_collectives: bool = False) -> None:
        self.policy = policy or selective_policy
        self.keep_collectives = keep_collectives
        self.kept: dict = {}        # op -> [(outputs detached, [(tensor, version)]) or None] in call order
        self.collectives: list = []  # (op, written tensors, outputs, [(tensor, version)]) in call order

    def __call__(self):
        if self.keep_collectives:
            return _KeepMode(self), _Reusable(lambda: _stacked(_quiet_tallies(), _ReplayMode(self)))
        return _KeepMode(self), _ReplayMode(self)


def _saves(policy) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy

    if isinstance(policy, bool):
        return policy
    return policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class _KeepMode(TorchDispatchMode):
    def __init__(self, store: SelectiveContexts) -> None:
        super().__init__()
        self.store, self.pending = store, []

    def __exit__(self, *exc):
        # the versions of the collectives' buffers, read when the block's forward ends: a collective's own
        # writes may come after it returns (gloo's reduce-scatter copies into its output when waited on), so
        # what the check catches is a change made after the block, before the recompute
        for record in self.pending:
            record[3][:] = [(t, t._version) for t, _ in record[3]]
        self.pending = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_collective(func):
            if not self.store.keep_collectives:
                return out
            written = _written(func, args)
            record = (func, written, out, [(t, None) for t in written + _tensors(out)])
            self.store.collectives.append(record)
            self.pending.append(record)
        elif func not in _UNCOUNTED:
            from torch.utils.checkpoint import SelectiveCheckpointContext

            if _saves(self.store.policy(SelectiveCheckpointContext(is_recompute=False, op_output=out),
                                        func, *args, **kwargs)):
                kept = tree_map(_alias, out)
                self.store.kept.setdefault(func, []).append((kept, [(t, t._version) for t in _tensors(kept)]))
            else:
                self.store.kept.setdefault(func, []).append(None)
        return out


def _alias(x):
    """``x`` detached, sharing its version counter (as torch's selective checkpointing detaches: below autograd
    a plain ``detach`` would start a counter of its own, and in-place changes would go unseen)."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _unchanged(func, versions) -> None:
    for t, version in versions:
        if t._version != version:
            raise RuntimeError(f"selective checkpointing: the output of {func} kept in forward was changed in place "
                               "afterwards, so the recompute cannot reuse it (clone it before changing it)")


class _ReplayMode(TorchDispatchMode):
    def __init__(self, store: SelectiveContexts) -> None:
        super().__init__()
        self.store, self.calls, self.position = store, {}, 0

    def __enter__(self):
        self.calls, self.position = {}, 0  # each recompute (ZBV makes two) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_collective(func):
            return self._collective(func, args) if self.store.keep_collectives else func(*args, **kwargs)
        if func in _UNCOUNTED:
            return func(*args, **kwargs)
        index = self.calls.get(func, 0)
        self.calls[func] = index + 1
        entries = self.store.kept.get(func, [])
        if index >= len(entries):
            raise RuntimeError(f"selective checkpointing: the recompute of a block ran {func} more often than its "
                               "forward (the block must not depend on state that changes before backward)")
        if entries[index] is None:
            return func(*args, **kwargs)
        kept, versions = entries[index]
        _unchanged(func, versions)
        return tree_map(_alias, kept)  # a fresh alias each time (autograd gives each recompute its own history)

    def _collective(self, func, args):
        records = self.store.collectives
        if self.position >= len(records) or records[self.position][0] is not func:
            ran = records[self.position][0] if self.position < len(records) else "nothing"
            raise RuntimeError(f"selective checkpointing: the recompute of a block ran {func} where its forward ran "
                               f"{ran} (the block's collectives must not depend on state that changes before backward)")
        _, written, out, versions = records[self.position]
        self.position += 1
        _unchanged(func, versions)
        targets = _written(func, args)
        for dst, src in zip(targets, written):
            if dst is not src:
                dst.copy_(src)
        swap = {id(src): dst for src, dst in zip(written, targets)}
        return tree_map(lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else _done(x), out)


def _done(x):
    """A completed ``Work`` in place of a recorded one (gloo's p2p works cannot be waited on twice)."""
    if isinstance(x, torch.ScriptObject):
        from torch._C._distributed_c10d import FakeWork, Work

        return Work.boxed(FakeWork())
    return x


@contextlib.contextmanager
def _quiet_tallies():
    """No :func:`.comm.count` tally sees the replayed collectives of a recompute (nothing is sent)."""
    saved = list(comm._TALLIES)
    comm._TALLIES.clear()
    try:
        yield
    finally:
        comm._TALLIES[:] = saved


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class _Reusable:
    """A context manager made anew at each entry (torch enters the recompute context once per recompute)."""

    def __init__(self, make) -> None:
        self.make, self.entered = make, []

    def __enter__(self):
        ctx = self.make()
        self.entered.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


def selective_contexts(keep_collectives: bool = False):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: selective recompute with
    :func:`selective_policy` (see :class:`SelectiveContexts`)."""
    return SelectiveContexts(keep_collectives=keep_collectives)()


def shard(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]) -> nn.Module:
    """Swap ``model``'s layers for the plan's tensor-parallel ones (in place; meta models too)."""
    from .tensor import shard_model

    plan.require_implemented()
    return shard_model(model, spec, mesh)


class BatchSplit:
    """Model-level input split and output gather for the tensor modes that cut the batch (2D, 2.5D, 3D).

    Installed by :func:`prepare` as a forward pre-hook and a forward hook, so
    that a user feeds the model its whole dp share in the single-device format
    and gets single-device outputs back:

    - before forward, every tensor input whose dim 0 is the batch is padded to
      a multiple of the mode's batch blocks (labels with -100, other inputs by
      repeating the last row, so padded rows never count in a loss) and this
      rank keeps its block (3D: attention masks in the ``inner`` layout and
      one-per-example labels whole, as its layers expect);
    - after forward, hidden-state fields of the :class:`Output` (in the mode's
      activation layout) and the logits are gathered to whole tensors *when
      read*, padding rows cut. The loss is already the mean over the whole
      share. Training that reads only ``loss`` gathers nothing.
    """

    def __init__(self, plan: Plan, mesh: Mesh) -> None:
        self.plan, self.mesh, self.parts = plan, mesh, plan.batch_parts
        self._sizes: list = []  # batch size of each forward in flight (a stack: forwards may nest)

    def _split(self, key, x: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_mode in ("2d", "2.5d"):
            from .tensor.grid import split_input

            return split_input(x, self.mesh, 0)
        from .tensor.d3 import split_input

        if key == "labels" and x.dim() == 1:  # the 3D classifier's logits are whole on every rank
            return x
        return split_input(x, self.mesh, 0, layout="inner" if key == "attention_mask" else "block")

    def _prepare(self, key, x, batch: int, pad: int):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
            return x
        return self._split(key, pad_rows(key, x, pad))

    def before(self, module, args, kwargs):
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        batch = first.shape[0] if first is not None else 0
        pad = (-batch) % self.parts
        self._sizes.append((batch, pad))
        args = tuple(self._prepare(None, v, batch, pad) for v in args)
        kwargs = {k: self._prepare(k, v, batch, pad) for k, v in kwargs.items()}
        return args, kwargs

    def _gather_hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_mode in ("2d", "2.5d"):
            from .tensor.grid import gather_output

            return gather_output(x, self.mesh, 0, hidden=True)
        from .tensor.d3 import gather_output

        return gather_output(x, self.mesh, 0, layout="block", hidden=True)

    def after(self, module, args, kwargs, output):
        batch, pad = self._sizes.pop()
        return self.whole(output, batch, pad)

    def whole(self, output, batch: int = 0, pad: int = 0):
        """``output``'s fields made whole when read: plain tensor fields (activations in the mode's layout)
        gathered over the grid, ``pad`` padding rows cut (``batch`` rows kept); in place, returned."""
        if not hasattr(output, "defer"):
            return output
        for name in ("logits", "last_hidden_state", "pooler_output"):
            if not output.is_deferred(name):
                output.defer(name, self._gather_hidden)
            if pad:
                output.defer(name, lambda t: t[:batch])
        return output


def input_splitter(plan: Plan, mesh: Mesh):
    """``batch -> batch``: this rank's block of a batch under the plan's tensor mode (None when none is cut).

    :func:`prepare` installs the same split on the model itself, so callers
    of a prepared model never need this; it remains for layer-level tests.
    """
    if mesh.size("tp") == 1 or plan.tp_mode == "1d":
        return None
    split = BatchSplit(plan, mesh)
    return lambda batch: {k: split._split(k, v) for k, v in batch.items()}


def prepare(model: nn.Module, plan: Plan, mesh: Optional[Mesh] = None, spec: Optional[ShardingSpec] = None) -> nn.Module:
    """Make a materialised model (sharded for ``plan`` if it is not yet) a drop-in for the single-device one.

    In place, and returns ``model`` itself (same class, same parameter names):

    - ``model.plan`` and ``model.mesh`` are set;
    - under 2D/2.5D/3D a :class:`BatchSplit` takes the dp share in and gives
      single-device outputs back;
    - dropout masks follow the layout (:class:`~cuboid.parallel.layers.Dropout`):
      the default generator is made equal over ``tp`` (replicated
      activations drop alike) and batch-block layouts draw per-rank masks;
    - the plan's activation checkpointing (``checkpoint``: full or selective) is applied per block;
    - with ``dp > 1``, torch's composable DDP (``replicate``) averages
      gradients over the mesh's ``dp`` group during backward, or, with
      ``zero``, ZeRO shards optimizer state, gradients and (stage 3)
      parameters over it;
    - every parameter carries its placement (optimizers and clipping read it).

    Calling it again with the same plan does nothing; a model prepared for one
    device (``cuboid.load(name)``) may be prepared again for a plan.
    """
    done = getattr(model, "_cuboid_prepared", None)
    if done is not None and (done == plan or plan.world_size == 1):
        return model
    if done is not None and done.world_size > 1:
        raise ValueError(f"the model is already prepared for plan {done.describe()}; load it again for "
                         f"plan {plan.describe()}")
    plan.require_implemented()
    if mesh is None:
        mesh = Mesh.build(plan, getattr(model, "config", None))
    shard(model, plan, mesh, spec)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("materialise the model (cuboid.zoo.materialize) before preparing it for training")
    for mod in model.modules():
        if hasattr(mod, "tag_placements"):
            mod.tag_placements()
    model.plan, model.mesh = plan, mesh
    if mesh.size("tp") > 1:
        from .layers import Dropout, sync_rng

        sync_rng(mesh.group("tp"))  # replicated activations drop the same elements on every tp rank
        if plan.tp_mode != "1d":  # every activation is a distinct block: independent masks
            for mod in model.modules():
                if isinstance(mod, Dropout):
                    mod.sharded_rank = mesh.coords["tp"]
    if mesh.size("tp") > 1 and plan.tp_mode != "1d" and mesh.size("pp") == 1:  # (pp: the first stage splits)
        split = BatchSplit(plan, mesh)
        model.register_forward_pre_hook(split.before, with_kwargs=True)
        model.register_forward_hook(split.after, with_kwargs=True)
    if mesh.size("sp") > 1:  # the model runs its blocks on this rank's chunks of every sequence
        from .layers import sync_rng
        from .sequence_split import SequenceSplit

        if spec is None:
            raise ValueError("sequence parallelism needs the model's sharding spec (cuboid.load passes it)")
        sync_rng(mesh.group("sp"))  # the embeddings run on the whole sequence on every sp rank
        model.sequence_split = SequenceSplit(model, spec, mesh)
        model.sequence_split.swap_attention(plan.sp_mode)
        model.forward = model.sequence_split.forward
    if plan.tp_sequence and mesh.size("tp") > 1:
        from .sequence_split import TensorSequenceSplit

        if spec is None:
            raise ValueError("tp_sequence needs the model's sharding spec (cuboid.load passes it)")
        model.sequence_split = TensorSequenceSplit(model, spec, mesh)
        model.forward = model.sequence_split.forward
    if plan.checkpoint != "none":
        checkpoint_blocks(model, spec.blocks if spec is not None else "blocks", plan.checkpoint)
    if mesh.size("pp") > 1:  # the schedule drives forward/backward; it averages over dp itself
        from .pipeline import Pipeline

        blocks = getattr(model, "pipeline_blocks", None)
        if blocks is None:
            raise ValueError("a pp plan needs the model cut into stages first (cuboid.load does it)")
        split = BatchSplit(plan, mesh) if mesh.size("tp") > 1 and plan.tp_mode != "1d" else None
        from . import zero

        group = zero.group_of(mesh)  # dp, or dp x sp under sp (every sp rank holds every weight)
        sharded = plan.zero == 3 and group is not None
        model.pipeline = Pipeline(model, spec, mesh, blocks, schedule=plan.schedule, microbatches=plan.microbatches,
                                  batch_split=split, shard_group=group if sharded else None)
        if plan.zero in (1, 2) and group is not None:  # the pieces are reduced at the step, after the schedule
            from .zero import FlatShards

            model.zero = model.pipeline.zero = FlatShards(model.pipeline.params, group, plan.zero, hooks=False)
        model.forward = functools.partial(_pipeline_forward, model.pipeline)
    elif plan.zero and (mesh.size("dp") > 1 or mesh.size("sp") > 1):
        _shard_over_dp(model, plan, mesh, spec)
    elif mesh.size("dp") > 1 or mesh.size("sp") > 1:
        from torch.distributed._composable import replicate

        p = next(model.parameters())
        group = mesh.group("dpsp") if mesh.size("sp") > 1 else mesh.group("dp")
        replicate(model, process_group=group, bucket_cap_mb=25,
                  **({"device_id": p.device} if p.device.type == "cuda" else {}))
        model.register_comm_hook(group, comm.ddp_comm_hook)  # the same average, seen by comm.count
    model._cuboid_prepared = plan
    return model


def _shard_over_dp(model: nn.Module, plan: Plan, mesh: Mesh, spec: Optional[ShardingSpec]) -> None:
    """ZeRO over the dp group (:mod:`.zero`): flat buckets for stages 1 and 2, FSDP2 for stage 3.

    Under sp the group is ``dpsp`` (dp x sp): every sp rank holds every weight and gradients are averaged
    over dp x sp, so ZeRO cuts states dp * sp ways (:func:`.zero.group_of`)."""
    from . import zero

    group = zero.group_of(mesh)
    if plan.zero == 3:
        zero.shard_parameters(model, group, spec.blocks if spec is not None else "blocks")
        return
    model.zero = zero.FlatShards(model.parameters(), group, plan.zero)
    model.set_requires_gradient_sync = model.zero.set_sync


def _pipeline_forward(pipeline, *args, **kwargs):
    """``model(**batch)`` under pp: the pipeline's forward without gradients (evaluation, inference), the
    same outputs on every rank."""
    if args:
        raise TypeError("a model under pipeline parallelism takes its inputs by name: model(**batch)")
    if torch.is_grad_enabled() and kwargs.get("labels") is not None:
        raise RuntimeError("a model under pipeline parallelism trains through its schedule: use "
                           "cuboid.train_step(model, optimizer, global_batch); a forward with labels runs under "
                           "torch.no_grad() (evaluation), one without labels anywhere (inference, no gradients)")
    return pipeline.forward_only(kwargs)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the dp gradient all-reduce of the next backward on or off (gradient accumulation)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def unwrap(model: nn.Module) -> nn.Module:
    """The zoo model inside a torch DDP wrapper (``prepare`` itself never wraps)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
