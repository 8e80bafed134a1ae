"""Activation recompute per block: keep less in forward, compute it again in backward.

"Recompute" here is what torch calls activation checkpointing; "checkpoint"
in cuboid means the saved files (:mod:`cuboid.zoo.checkpoint`).
:func:`recompute_blocks` wraps each block of a model in
``torch.utils.checkpoint`` (non-reentrant) in one of two modes:

- ``full``: each block keeps its inputs and runs whole again in backward;
- ``selective``: each block keeps what is dear to make (the outputs of its
  matmuls and of fused attention: :func:`selective_policy`) and recomputes
  the cheap ops between them (norms, activations, dropout, adds), through
  the dispatch modes of :class:`SelectiveContexts`.

The plan's ``checkpoint`` field (``none | full | selective``) picks the mode;
:func:`~cuboid.parallel.prepare` applies it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from . import comm


MODES = ("full", "selective")


def recompute_blocks(model: nn.Module, blocks: str = "blocks", mode: str = "full",
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
    in a new module, so module paths (and so saved checkpoints) do not change,
    and whoever calls the blocks (the model, sequence splits, pipeline stages)
    recomputes them. Applying another mode replaces the first. Returns the
    number of blocks wrapped.
    """
    if mode not in MODES:
        raise ValueError(f"checkpoint mode must be one of {', '.join(MODES)}, got {mode!r}")
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


checkpoint_blocks = recompute_blocks  # torch's name for it ("activation checkpointing")


# ------------------------------------------------------------------ selective recompute

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
    completed ``Work`` objects, sending nothing (``comm.count`` sees nothing then). That holds more than
    it saves in most layouts (a row linear keeps its partial sum beside the all-reduced result,
    ``tp_sequence`` its all-gathered inputs, all-to-all its exchanged heads, the ring its received K/V:
    ``bench/RESULTS.md``, activation checkpointing), so it is an option for links slower than memory is
    short, not the plan's default.

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
            return _KeepMode(self), _Reusable(lambda: _stacked(comm.uncounted(), _ReplayMode(self)))
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
