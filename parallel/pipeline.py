"""Pipeline parallelism: stages cut from the sharding spec, run by ``torch.distributed.pipelining``.

``cuboid.load(name, plan)`` with ``pp > 1`` cuts the model
(:func:`.stages.cut_model`) and ``prepare`` builds a :class:`Pipeline` on it; ``cuboid.train_step`` runs
a step through it and ``model(**batch)`` under ``no_grad`` evaluates. The
schedules are torch's: ``gpipe`` and ``1f1b`` (one stage per rank),
``interleaved`` (interleaved 1F1B, stages r and r + pp on rank r) and
``zbv`` (zero-bubble V: stages r and 2 pp - 1 - r). Under 2D/3D tensor
parallelism the first stage cuts each micro-batch into this rank's block,
so stages exchange only blocks with the ranks of equal tensor coordinates.

**Stage cut** (:mod:`.stages`): each rank keeps the blocks and end modules
of its stages; a module both ends own (a tied embedding) has its gradient
summed over the two (Megatron's embedding group) so that both copies take
the single-device step.

**The stream between stages** is ``(x, residual, attention_mask, labels)``:
the residual of pre-LN models starts as zeros (``norm(x + 0)`` is
``norm(x)`` exactly), post-LN models pass zeros through, a model without an
attention mask passes a (B, 1) mask of ones (no key is masked). A batch with
``position_ids`` (packed rows) sends them in the mask's place, stacked under
it as (B, 2, T) (:func:`_stream_mask`); every stage builds the attention
cores' :class:`~.mask.Mask` from it, document ids counted on whole rows. Labels
travel with their micro-batch to the last stage, which returns the
micro-batch's mean loss; the schedule's loss function weights it by its
share of the global batch's label count, so a step is one device's step.

**A loss of the caller's** (:class:`Objective`, :meth:`Pipeline.run`'s
``loss``, ``targets``, ``head_kwargs``): the micro-batch's per-row tensors
(the model's inputs and the ``targets``, which are none) travel whole
(every rank of a 2D/3D grid, sp or tp group holds its micro-batch's rows)
after the labels, ``(x, residual, mask, labels, *micro-batch)``; the last
stage calls ``loss(out, micro_batch)`` on the head's output in one device's
layout (the batch blocks and sequence chunks gathered when read,
differentiably) and returns that sum, which the schedule's loss function
weights as it does the mean loss. Without one the stream is the one above.

A mixture of experts whose aux loss joins the loss (``output_router_logits``)
adds the router statistics of the stages so far to the stream, ``(stats,
probsum)`` (:mod:`.moe_stream`): the last stage adds each micro-batch's aux
loss of every layer's statistics to its loss, and probsum's gradient flows
back through the p2p to the earlier stages' routers. Dense models' streams
are unchanged (the config decides, the same on every rank).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm
from cuboid.kernels.flash_attention import doc_ids_from_positions

from .batch import pad_batch, split_batch
from .experts import average_grads, expert_modules, expert_parameters
from .head import logprob_targets
from .mask import Mask
from .moe_stream import Routing, recording_of
from .pipeline_shard import check_tied_reduce, embedding_group, shard_stages
from .sequence_split import SequenceSplit, TensorSequenceSplit
from .stages import stage_ids
from .state import balance_reduce_of


@dataclass
class StageInfo:
    stage: int
    stages: int
    blocks: range
    input_keys: tuple = ()    # the batch keys the first stage takes, in order


@dataclass(frozen=True)
class Objective:
    """What a training step's last stage computes (:meth:`Pipeline.run`): the model's mean loss (``fn`` None),
    or ``fn(out, micro_batch)``, a 0-d sum over the micro-batch, of the head's output ``out`` in one device's
    layout and the micro-batch's tensors (B, ...) named in ``carried``, in this order, each carried whole
    through the stream. ``targets`` (among them): those that are not model inputs. ``head_kwargs``: the
    head's extra keyword arguments (``logprobs=True``)."""

    targets: tuple = ()
    fn: Optional[Callable] = None
    head_kwargs: dict = field(default_factory=dict)
    carried: tuple = ()


def _stream_mask(keep: Optional[torch.Tensor], positions: Optional[torch.Tensor], rows: int, tokens: int,
                 device) -> torch.Tensor:
    """The stream's mask entry, long: the (B, S) attention mask, or (B, ``tokens``) ones where the batch has
    none (``tokens`` 1: no key is masked); with ``positions`` (B, T) or (1, T), (B, 2, S): keep over the
    positions, left-padded with -1 where the keys outnumber the tokens (a generation step's cache). Its
    shape depends only on which inputs the batch has, as torch's schedules need."""
    T = positions.shape[-1] if positions is not None else tokens
    keep = keep.long() if keep is not None else torch.ones(rows, T, dtype=torch.long, device=device)
    if positions is None:
        return keep
    positions = F.pad(positions.long().expand(rows, -1), (keep.shape[1] - T, 0), value=-1)
    return torch.stack([keep, positions], 1)


def _unstack(mask: torch.Tensor) -> tuple:
    """``(keep, positions)`` of a stream's mask entry (:func:`_stream_mask`): keep (B, S) long, positions
    (B, T) long or None."""
    if mask.dim() == 2:
        return mask, None
    positions = mask[:, 1]
    return mask[:, 0], positions[:, int((positions[0] == -1).sum()):]


class StageModule(nn.Module):
    """One pipeline stage of a zoo model: ``embed`` (first), its blocks, ``head`` and loss (last).

    Its parameters are only the stage's own (its blocks, and the end modules
    of the first / last stage); the zoo model is referenced, not owned, so
    two stages of one rank (interleaved, ZBV) share it without sharing
    parameters. ``forward`` takes the batch tensors in ``input_keys`` order
    on the first stage and the stream ``(x, residual, mask, labels)`` (then
    the :class:`Objective`'s carried tensors and the router statistics, where there
    are) on the others; the last stage returns the micro-batch's mean loss, or
    the objective's sum.
    """

    def __init__(self, model: nn.Module, spec, info: StageInfo, keys_from=None, batch_split=None,
                 sequence_split=None) -> None:
        super().__init__()
        self.batch_split = batch_split  # 2D/3D: the first stage cuts each micro-batch into this rank's block
        object.__setattr__(self, "model", model)  # referenced: its parameters are not this module's
        self.spec, self.info = spec, info
        self._keys_from = keys_from or info  # the first stage's info, where the batch keys are recorded
        seq = getattr(model, spec.blocks)
        self.blocks = nn.ModuleDict({str(i): seq[i] for i in info.blocks})
        ends = (spec.first if info.stage == 0 else ()) + (spec.last if info.stage == info.stages - 1 else ())
        self.ends = nn.ModuleDict({n: getattr(model, n) for n in dict.fromkeys(ends)
                                   if isinstance(getattr(model, n, None), nn.Module)})
        self._embed_args = tuple(inspect.signature(model.embed).parameters)
        self.inferring = False  # set while torch's stage infers shapes (see :func:`_flag_inference`)
        self.objective = Objective()  # a training step's (set by :meth:`Pipeline.run` for its schedule)
        seq = sequence_split
        self._seq = seq if isinstance(seq, TensorSequenceSplit) else None  # tp_sequence: blocks on T / tp tokens
        self.sp = seq if isinstance(seq, SequenceSplit) else None  # sp: blocks on this rank's zigzag chunks
        routing = Routing.of(model)
        # a mixture of experts whose aux loss joins the loss (the config's, the same on every rank): the router
        # statistics of earlier stages travel with the stream; otherwise the stream is the dense model's
        self.routing = routing if routing is not None and routing.routed else None  # (Plan refuses MoE + tp_sequence)
        # a head that reads each row's last token (the spec's pooled_last): the (B,) indices follow the labels
        self.width = 5 if spec.pooled_last else 4  # the stream's entries before the carried tensors

    @property
    def seq(self) -> Optional[TensorSequenceSplit]:
        """tp_sequence's split while it shards the blocks' tokens; None without it, and while generation runs
        the model as plain 1D tp (:meth:`~.sequence_split.TensorSequenceSplit.unsplit`)."""
        return self._seq if self._seq is not None and self._seq.active else None

    def start(self, batch: dict) -> tuple:
        """The first stage's stream from a micro-batch: ``(x, residual, mask, labels)`` (labels None when the
        batch has none), and each row's last token where the head reads it (``pooled_last``)."""
        if self.batch_split is not None:
            size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
            batch = self.batch_split.cut_inputs(batch, size, 0)
        keep, positions = batch.get("attention_mask"), batch.get("position_ids")
        if isinstance(keep, Mask):  # 3D: the cores' rows, cut by the batch split
            keep, positions = keep.keep, keep.positions
        last = (self.model.last_tokens(batch["input_ids"]),) if self.width > 4 else ()
        if self.sp is not None:  # sequence parallelism: this rank's chunks travel, with the whole (B, T) mask
            x, whole, local, labels, _ = self.sp.enter(batch)
            mask = _stream_mask(whole, positions, x.shape[0], whole.shape[1], x.device)
            return (x, torch.zeros_like(x), mask, local if local is not None else labels) + last
        x = self.model.embed(**{k: batch[k] for k in self._embed_args if k in batch})
        # no key masked: (B, 1) ones ((B, T) under tp_sequence: the last stage reads T from it)
        mask = _stream_mask(keep, positions, x.shape[0], x.shape[1] if self.seq is not None else 1, x.device)
        if self.seq is not None:  # Megatron sequence parallelism: this rank's T / tp tokens travel
            x = comm.scatter_to(F.pad(x, (0, 0, 0, (-x.shape[1]) % self.seq.tp)), self.seq.group, 1)
        return (x, torch.zeros_like(x), mask, batch.get("labels")) + last

    def core_mask(self, mask: torch.Tensor, tokens: int) -> Optional[Mask]:
        """The attention cores' :class:`~.mask.Mask` from the stream's mask entry; ``tokens``: this stage's
        tokens per row (a sequence split's share)."""
        keep, positions = _unstack(mask)
        if self.sp is not None:  # the whole rows' mask, cut to this rank's chunks by the sequence split
            whole = Mask(keep.to(torch.bool), positions, None if positions is None else doc_ids_from_positions(positions))
            return self.sp.local_mask(whole, tokens * self.sp.sp)
        core = Mask.of(keep, positions, keep.shape[0])
        if self.seq is not None and tokens * self.seq.tp > keep.shape[1]:  # attention sees the padded sequence
            core = (core or Mask(keep=keep.to(torch.bool))).pad(tokens * self.seq.tp)
        return core

    def run_blocks(self, x, residual, mask, carried: tuple = ()):
        """The stage's blocks: ``(x, residual, recorder)``; with a routing, the recorder holds the router
        statistics of the stream's ``carried`` ones (:meth:`.moe_stream.Routing.carry`) plus this stage's."""
        core = self.core_mask(mask, x.shape[1])
        rec = None
        if self.routing is not None:
            rec = self.routing.recorder(self.router_keep(mask, x.shape[1]), self.reduce(), carried)
        with recording_of(rec):
            for block in self.blocks.values():
                x, r = block(x, residual, core)
                residual = r if r is not None else torch.zeros_like(x)
        return x, residual, rec

    def router_keep(self, mask: torch.Tensor, tokens: int) -> Optional[torch.Tensor]:
        """(B * ``tokens``,) the stage's tokens that count in the router statistics (padding does not), in the
        order the sparse layers see them; None where the batch had no attention mask."""
        keep, _ = _unstack(mask)
        if self.sp is not None:
            return self.sp.local_keep(keep, tokens)
        return None if keep.shape[1] < tokens else keep[:, -tokens:].reshape(-1)

    def stream_in(self, inputs: tuple) -> tuple:
        """A later stage's inputs split: ``(x, residual, mask, labels[, last])`` and the carried router
        statistics."""
        return tuple(inputs[:self.width]), tuple(inputs[self.width:])

    def head(self, x, residual, mask, labels, last=None, logprobs: bool = False):
        """The model's head on the last stage (under tp_sequence after the sequence is gathered); ``last``:
        each row's last token (``pooled_last``); ``logprobs``: its per-token outputs too (the model's
        ``logprobs``)."""
        T = mask.shape[-1]  # the whole sequence (under sp and tp_sequence the mask is (B, T))
        if self.seq is not None:
            x = comm.gather_from(x, self.seq.group, 1)[:, :T]
            residual = comm.gather_from(residual, self.seq.group, 1)[:, :T]
        if self.sp is not None:  # the loss summed over sp, outputs gathered in order when read
            token = labels is not None and labels.dim() == 2
            return self.sp.leave(x, residual, labels if token else None, labels, T, logprobs=logprobs, last=last)
        kwargs = {"last": last} if last is not None else {}
        return self.model.head(x, residual, labels, **kwargs, **({"logprobs": True} if logprobs else {}))

    def forward(self, *inputs, evaluate=None, logprobs: bool = False):
        """The schedule's call: the batch tensors (first stage) or the stream in; the stream or the
        micro-batch's loss (last stage: the model's mean loss, or the :class:`Objective`'s sum) out.
        ``evaluate``: :meth:`Pipeline.forward_only`'s call instead, :meth:`forward_only` of that micro-batch
        or stream."""
        if evaluate is not None:
            return self.forward_only(evaluate, logprobs)
        info = self.info
        if info.stage == 0:
            batch, targets = self.batch_targets(dict(zip(self._keys_from.input_keys, inputs)))
            x, residual, mask, labels, *last = self.start(batch)
            carried = self.routing.start(x.device) if self.routing is not None else ()
        else:
            inputs, targets = self.stream_targets(inputs)
            (x, residual, mask, labels, *last), carried = self.stream_in(inputs)
            x, residual = _ContiguousGrad.apply(x), _ContiguousGrad.apply(residual)
            if self.inferring:
                # torch's stage runs non-first stages on uninitialised tensors to infer output shapes (before
                # the first training step); labels and masks there are noise, so that pass ignores and keeps all
                labels = torch.full_like(labels, -100)
                mask = torch.stack([torch.ones_like(mask[:, 0]), torch.zeros_like(mask[:, 1])], 1) if mask.dim() == 3 \
                    else torch.ones_like(mask)  # (positions all 0: each token its own document)
                carried = tuple(torch.zeros_like(t) for t in carried)
                targets = tuple(torch.zeros_like(t) for t in targets)
                last = [torch.zeros_like(t) for t in last]  # (row indices: position 0 is in every row)
            labels = None if labels.dim() == 2 and labels.shape[1] == 0 else labels  # (B, 0): no labels
        x, residual, rec = self.run_blocks(x, residual, mask, carried)
        if info.stage < info.stages - 1:
            carried = self.routing.carry(rec) if rec is not None else ()
            if labels is None:  # a batch without labels (a task's own loss): a (B, 0) stand-in travels
                labels = torch.zeros(x.shape[0], 0, dtype=torch.long, device=x.device)
            return self.stream_out((x, residual, mask, labels, *last), targets, carried)
        out = self.head(x, residual, mask, labels, *last, **self.objective.head_kwargs)
        return self.last_loss(out, targets, rec)

    def batch_targets(self, batch: dict) -> tuple:
        """The first stage's micro-batch split: ``(the model's inputs, the objective's carried tensors)``; the
        targets are not model inputs (with ``logprobs`` and no labels the input ids are the labels, as the
        model's forward makes them)."""
        carried = tuple(batch[k] for k in self.objective.carried)
        batch = {k: v for k, v in batch.items() if k not in self.objective.targets}
        if self.objective.head_kwargs.get("logprobs"):
            batch, _ = logprob_targets(batch)
        return batch, carried

    def stream_targets(self, inputs: tuple) -> tuple:
        """A later stage's inputs without the objective's carried tensors (which follow the labels), and those."""
        n, w = len(self.objective.carried), self.width
        return tuple(inputs[:w]) + tuple(inputs[w + n:]), tuple(inputs[w:w + n])

    def stream_out(self, base: tuple, targets: tuple, carried: tuple) -> tuple:
        """The stream a stage hands on: ``(x, residual, mask, labels[, last], *targets, *router statistics)``.

        Outputs are handed on (to a stage on this rank, under ZBV and
        interleaving, without a copy) and detached in place there: each must
        be a tensor of its own, not a view, an input or a tensor that autograd
        saved (a norm saves its residual stream), and contiguous (p2p buffers
        copy its strides). ``x``, ``residual`` and the statistics' probsum
        always ask for a gradient: torch sizes the next stage's receive
        buffers, their requires_grad included, from these outputs, and a
        frozen first stage (LoRA's embedding) would leave the next one's
        inputs without it; ZBV's split backward then finds no path from that
        stage's inputs to its adapters and gives them no gradient (the same
        for the probsum of a stage without a sparse layer).
        """
        out = tuple(t.clone(memory_format=torch.contiguous_format) for t in base + targets + carried)
        if torch.is_grad_enabled():
            for t in out[:2] + out[len(base + targets) + 1:]:  # (carried: stats without a gradient, probsum)
                if not t.requires_grad:
                    t.requires_grad_(True)
        return out

    def last_loss(self, out, targets: tuple, rec) -> torch.Tensor:
        """The last stage's result for the schedule's loss function: the micro-batch's mean loss, or the
        objective's sum of ``out`` in one device's layout (the 2D/3D batch blocks gathered when read); with
        a routing, stacked with ``coef *`` the micro-batch's aux loss, which has a weight of its own. The
        objective's ``fn`` runs once per micro-batch of a step, never on the shape pass's noise, so it may
        record what it computes: there the head's own loss (without labels, its logits' sum), times 0, stands
        in (the same inputs reach it, so torch's backward pass over the noise infers the same input gradients)."""
        objective = self.objective
        if objective.fn is None:
            loss = out.loss
        elif self.inferring:  # (without labels, the head's outputs times 0: a classifier's few logits)
            loss = ((out.loss if out.loss is not None else out.logits).float().sum() * 0.0).reshape(())
        else:
            whole = self.batch_split.whole(out) if self.batch_split is not None else out
            loss = objective.fn(whole, dict(zip(objective.carried, targets))).float().reshape(())
        if rec is None:
            return loss
        return torch.stack([loss, self.routing.aux_term(rec).to(loss.dtype)])

    def forward_only(self, stream, logprobs: bool = False):
        """One stage of a forward without the schedule: ``stream`` is a micro-batch (first stage) or the
        previous stage's ``(x, residual, mask, labels)``; returns the next stream, or (last stage) the model's
        Output (with ``logprobs``, its per-token outputs), its loss without an aux loss, and the recorder of
        the router statistics (None: dense)."""
        if self.info.stage == 0:
            x, residual, mask, labels, *last = self.start(stream)
            carried = self.routing.start(x.device) if self.routing is not None else ()
        else:
            (x, residual, mask, labels, *last), carried = self.stream_in(stream)
        x, residual, rec = self.run_blocks(x, residual, mask, carried)
        if self.info.stage < self.info.stages - 1:
            return (x, residual, mask, labels, *last) + (self.routing.carry(rec) if rec is not None else ())
        out = self.head(x, residual, mask, labels, *last, logprobs=logprobs)
        return (self.batch_split.whole(out) if self.batch_split is not None else out), rec

    def reduce(self):
        """The router statistics' sum over the ranks sharing a forward's tokens (None: this rank's alone)."""
        return self.sp.reduce_for() if self.sp is not None else balance_reduce_of(self.model)


@dataclass
class PipelineOutput:
    """What a model under pp returns from a forward without gradients, the same on every rank: the fields
    of the zoo model's Output (``loss`` only when the batch had labels)."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    last_hidden_state: Optional[torch.Tensor] = None
    pooler_output: Optional[torch.Tensor] = None
    token_logps: Optional[torch.Tensor] = None  # with logprobs=True: (B, T - 1), as the zoo model's
    token_entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name: str):
        if name in ("router_logits", "aux_loss"):
            raise AttributeError(f"a model under pipeline parallelism does not return {name} (each micro-batch's "
                                 "aux loss is in loss): read it on one device or under sp")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


FIELDS = ("logits", "last_hidden_state", "pooler_output", "token_logps", "token_entropy")


def _weighted(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss function: a micro-batch's mean loss times its weight (its share of the labels); a
    mixture of experts' last stage gives (mean loss, coef * aux loss), each with its own weight."""
    return (loss.nan_to_num(0.0).reshape(-1) * weight.reshape(-1)).sum()  # a micro-batch without labels weighs 0


@contextlib.contextmanager
def _timed_p2p(group):
    """Make the schedules' p2p waits give up after the groups' timeout (:func:`~cuboid.parallel.comm.wait_p2p`)
    and fail as :class:`~cuboid.parallel.comm.CollectiveTimeout` naming rank, peers and ``group`` (``pp``).

    gloo's ``Work.wait()`` without a timeout waits for ever on a peer that
    stalls (collectives, and the blocking sends and receives of the first
    step's shape exchange, time out with their group); every schedule, the
    interleaved/ZBV runtime included, waits through one module-level helper
    and posts through another, swapped here for ones that pass the timeout
    and remember what each batch of work sends and receives, restored after.
    """
    from torch.distributed.pipelining import schedules

    plain_wait, plain_batch = schedules._wait_batch_p2p, schedules._batch_p2p
    posted: dict = {}  # id(list of work) -> (that list, what it sends and receives)

    def batch(p2p_ops, *args, **kwargs):
        work = plain_batch(p2p_ops, *args, **kwargs)
        kinds: dict = {}
        for op in p2p_ops:
            key = ("send of", "to") if op.op is dist.isend else ("recv of", "from")
            kinds[key + (op.peer,)] = kinds.get(key + (op.peer,), 0) + 1
        what = ", ".join(f"{a} {n} tensor{'s' * (n > 1)} {b} rank {peer}" for (a, b, peer), n in kinds.items())
        posted[id(work)] = (work, what or "p2p")
        return work

    def timed(work):
        entry = posted.pop(id(work), None)
        comm.wait_p2p(work, entry[1] if entry is not None and entry[0] is work else "p2p", group)

    schedules._wait_batch_p2p, schedules._batch_p2p = timed, batch
    try:
        yield
    finally:
        schedules._wait_batch_p2p, schedules._batch_p2p = plain_wait, plain_batch


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: a stage's input gradients are sent back to
    the previous stage, which receives them into buffers laid out like them (gloo needs contiguous)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _flag_inference(stage, module: StageModule):
    """Tell ``module`` when torch's ``stage`` runs it for shape inference (on uninitialised inputs).

    torch (2.13) has no public hook for that pass, so its method is wrapped
    on this instance; a torch without it infers nothing at run time and the
    flag simply stays off.
    """
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return stage

    def flagged(*args, **kwargs):
        module.inferring = True
        try:
            return infer(*args, **kwargs)
        finally:
            module.inferring = False

    stage._forward_metadata_inference = flagged
    return stage


class Pipeline:
    """Runs a stage model's forward and backward passes under a ``torch.distributed.pipelining`` schedule.

    ``schedule``: ``gpipe``, ``1f1b`` (one stage per rank), ``interleaved``
    (interleaved 1F1B, two virtual stages per rank) or ``zbv`` (zero-bubble
    V schedule, backward split into input and weight gradients). ``blocks``:
    the block range of every stage. ``batch_split`` (2D/3D: the first stage
    cuts each micro-batch into this rank's block) and ``sequence_split`` (sp,
    ``tp_sequence``: the stages run their blocks on this rank's tokens) are
    the model's (:class:`~.state.ParallelState`). After the schedule, gradients
    of tied parameters (first and last stage) are summed over the embedding
    group and every gradient is averaged over ``dp`` (one flat all-reduce per
    dtype).
    """

    SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")

    def __init__(self, model: nn.Module, spec, mesh, blocks: Sequence[range], *, schedule: str = "1f1b",
                 microbatches: int = 1, batch_split=None, sequence_split=None, shard_group=None) -> None:
        from torch.distributed import pipelining as P

        if schedule not in self.SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; schedules: {', '.join(self.SCHEDULES)}")
        pp = mesh.size("pp")
        if schedule != "gpipe" and microbatches < pp:
            raise ValueError(f"{schedule} needs at least as many micro-batches as stages ({pp}), got "
                             f"{microbatches}; use more micro-batches or the gpipe schedule")
        self.mesh, self.rank, self.pp, self.microbatches = mesh, mesh.coords["pp"], pp, microbatches
        self.schedule = schedule
        self._shapes = None  # the batch shapes torch's stages were set up for
        self.ids = stage_ids(schedule, self.rank, pp)
        total = len(blocks)
        infos = [StageInfo(s, total, blocks[s]) for s in range(total)]
        self.first = infos[0]
        self.model = model
        self.modules = [StageModule(model, spec, infos[s], self.first, batch_split, sequence_split)
                        for s in self.ids]
        self.parts = batch_split.parts if batch_split is not None else 1  # 2D/3D batch blocks per micro-batch
        self.has_first, self.has_last = 0 in self.ids, total - 1 in self.ids
        tied = [n for n in spec.first if n in spec.last]
        self.fsdp = shard_group is not None  # ZeRO-3: FSDP2 units per block and per stage over dp
        if self.fsdp:
            shard_stages(model, self.modules, shard_group, split_backward=schedule == "zbv",
                         experts=expert_modules(model), expert_group=mesh.group("edp"))
        device = next(model.parameters()).device
        stages = [_flag_inference(P.PipelineStage(m, s, total, device, group=mesh.group("pp")), m)
                  for m, s in zip(self.modules, self.ids)]
        kinds = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved": P.ScheduleInterleaved1F1B,
                 "zbv": P.ScheduleZBVZeroBubble}
        one = schedule in ("gpipe", "1f1b")
        self._stages = stages
        self._schedule = kinds[schedule](stages[0] if one else stages, microbatches, loss_fn=_weighted,
                                         scale_grads=False)
        both = [r for r in range(pp) if {0, total - 1} <= set(stage_ids(schedule, r, pp))]  # ZBV's rank 0
        if self.fsdp and tied and both:  # every rank checks that rank's order (torch plans all): all refuse together
            check_tied_reduce(self._schedule, both[0], stage_ids(schedule, both[0], pp))
        # a tied module on a rank with only one end, or with both (ZBV: one object, gradients already add up)
        self.tied = [p for n in tied for p in getattr(model, n).parameters()] \
            if self.has_first != self.has_last else []
        self.last_rank = next(r for r in range(pp) if total - 1 in stage_ids(schedule, r, pp))  # runs the last stage
        self.embedding_group = embedding_group(mesh, self.last_rank) if tied else None
        # tied copies on the last stage's rank: the first stage's rank counts them in a global norm
        self.counted_elsewhere = self.tied if self.has_last else []
        self.params = [p for p in model.parameters()]
        # (x, residual, mask, labels[, last]) + the router statistics
        self.stream_size = self.modules[0].width + (2 if self.modules[0].routing is not None else 0)
        self.zero = None  # ZeRO 1/2 buckets of this rank's stages (set by prepare)

    def run(self, batch: dict, weights: torch.Tensor, aux_weights: Optional[torch.Tensor] = None, *,
            loss: Optional[Callable] = None, targets: Sequence[str] = (), head_kwargs: Optional[dict] = None
            ) -> Optional[torch.Tensor]:
        """Forward and backward of ``batch`` (this dp rank's share) in micro-batches; the rank running the
        last stage returns the sum of the weighted micro-batch losses, the others None. ``weights`` (M,): each
        micro-batch's loss weight; ``aux_weights`` (M,): a mixture of experts' aux loss's (None: ``weights``).

        ``loss``: ``loss(out, micro_batch) -> 0-d`` sum over a micro-batch, called on the last stage instead
        of taking the model's mean loss; ``out`` is what the model's head returns there in one device's layout
        (``model(**inputs, **head_kwargs)``'s fields), ``micro_batch`` the dict of the batch's per-row tensors
        cut to the micro-batch's rows (one device's micro-batch). ``targets``: the keys of ``batch`` that are
        not model inputs (per-row, (B, ...); the same on every rank). ``head_kwargs``: the head's keyword
        arguments (``logprobs=True``).
        """
        objective = self._objective(batch, loss, targets, head_kwargs)
        self._fit_shapes(batch, objective)  # (first: a batch with other keys resets the first stage's input keys)
        args = self._first_args(batch)
        if self.modules[0].routing is not None:  # the last stage gives (loss, coef * aux) per micro-batch
            weights = torch.stack([weights, weights if aux_weights is None else aux_weights], 1)
        losses: list = []
        for module in self.modules:
            module.objective = objective
        try:
            with _timed_p2p(self.mesh.group("pp")):
                if self.has_last:
                    self._schedule.step(*args, target=weights, losses=losses, return_outputs=False)
                else:
                    self._schedule.step(*args, return_outputs=False)
        except Exception as e:
            raise self._failed(e, "") from e
        finally:
            for module in self.modules:
                module.objective = Objective()
        for p in self.tied:  # every rank of the embedding group calls, whatever its stage's head used
            if not p.requires_grad:  # frozen (LoRA's base): the same on every rank, nothing to sum
                continue
            if p.grad is None:  # this end did not use the tied module in this step: it contributes zeros
                p.grad = torch.zeros_like(p)
            # (ZeRO-3: each end holds the same dp rows of the gradient; their sum is the rows' sum)
            comm.all_reduce_(getattr(p.grad, "_local_tensor", p.grad), self.embedding_group)
        self._average_over_dp()
        return torch.stack([l.reshape(()) for l in losses]).sum() if self.has_last else None

    def _failed(self, e: Exception, where: str) -> RuntimeError:
        """The error a failed schedule raises: a :class:`~cuboid.parallel.comm.CollectiveError` (timeout
        or closed peer; torch's own blocking sends and receives included) or a RuntimeError, naming the
        stages and the rank."""
        head = f"pipeline stage(s) {self.ids} on rank {self.mesh.rank} failed{where}: "
        failure = comm.as_collective_error("send/recv", self.mesh.group("pp"), e, known=False)
        if failure is not None:  # its message starts with "rank N: ", said above
            return type(failure)(head + str(failure).split(": ", 1)[-1])
        return RuntimeError(f"{head}{type(e).__name__}: {e}")

    @staticmethod
    def _objective(batch: dict, loss: Optional[Callable], targets: Sequence[str], head_kwargs) -> Objective:
        """:meth:`run`'s :class:`Objective`, its targets checked: per-row tensors of ``batch`` (one sentence
        otherwise, before any rank's schedule starts); with a loss every per-row tensor is carried, in
        sorted order (the same on every rank)."""
        targets = tuple(targets)
        if targets and loss is None:
            raise ValueError(f"targets {list(targets)} travel to a loss on the last stage: give loss=")
        rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        bad = [k for k in targets if not isinstance(batch.get(k), torch.Tensor) or batch[k].dim() == 0
               or batch[k].shape[0] != rows]
        if bad:
            raise ValueError(f"a loss's targets are per-row tensors of the batch ({rows} rows); {bad} are not")
        carried = tuple(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0
                               and v.shape[0] == rows)) if loss is not None else ()
        return Objective(targets, loss, dict(head_kwargs or {}), carried)

    def _fit_shapes(self, batch: dict, objective: Objective) -> None:
        """Have torch's stages infer shapes again when the batch's shapes or the stream's targets changed since
        the last run (a short last evaluation batch, a packed batch after a padded one, another task): their
        p2p buffers are sized by the first run; the first stage's input keys are read again."""
        key = tuple((k, tuple(v.shape)) for k, v in batch.items() if isinstance(v, torch.Tensor))
        key += (objective.targets, objective.carried, tuple(sorted(objective.head_kwargs)))
        if self._shapes is not None and key != self._shapes:
            self.first.input_keys = ()
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                         "_stages_forward_initialized", "_stages_backward_initialized"):
                if hasattr(self._schedule, flag):
                    setattr(self._schedule, flag, False)
            for stage in self._stages:  # a stream of another length (a key the batch gained): torch makes the
                stage.grad_send_info = None  # gradients' send list lazily, once, from the inputs it received
        self._shapes = key

    def _first_args(self, batch: dict) -> tuple:
        """The first stage's positional inputs (the batch's tensors, in the order of the first run)."""
        if not self.first.input_keys:
            self.first.input_keys = tuple(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        return tuple(batch[k] for k in self.first.input_keys) if self.has_first else ()

    def pad(self, batch: dict) -> dict:
        """``batch`` padded to a multiple of micro-batches x 2D/3D batch blocks, with rows that weigh nothing."""
        return pad_batch(batch, self.microbatches * self.parts)

    def model_forward(self, *args, logprobs: bool = False, **kwargs) -> PipelineOutput:
        """``model(**batch)`` under pp (:meth:`~.state.ParallelState.install_forward`): :meth:`forward_only`,
        the same outputs on every rank (``logprobs``: the per-token outputs too, as the zoo model's). Training
        runs through the schedule (``cuboid.train_step``)."""
        if args:
            raise TypeError("a model under pipeline parallelism takes its inputs by name: model(**batch)")
        if torch.is_grad_enabled() and kwargs.get("labels") is not None:
            raise RuntimeError("a model under pipeline parallelism trains through its schedule: use "
                               "cuboid.train_step(model, optimizer, global_batch); a forward with labels runs "
                               "under torch.no_grad() (evaluation), one without labels anywhere (inference, "
                               "no gradients)")
        if not logprobs:
            return self.forward_only(kwargs)
        batch, no_loss = logprob_targets(kwargs)
        out = self.forward_only(batch, logprobs=True)
        if no_loss:
            out.loss = None
        return out

    @torch.no_grad()
    def forward_only(self, batch: dict, last=None, *, logprobs: bool = False) -> PipelineOutput:
        """The model's forward of ``batch`` without gradients, under every schedule: every rank gets the
        last stage's outputs (logits, hidden states, pooled output, with ``logprobs`` the per-token
        log-probabilities and entropies; with labels, the mean loss over the label positions), the same
        everywhere. ``last(logits)``, when given, runs on the last stage and
        only its result is sent, as ``logits`` (generation: the stage samples, the ranks get the tokens).

        Not torch's schedule: micro-batches go through the stages in order,
        each stage receiving its stream from the rank of the stage before (a
        rank holding two stages, interleaved or ZBV, runs both), so every
        schedule has one forward, labels or not. A batch that does not
        divide into the micro-batches (and 2D/3D blocks) is padded with rows
        that weigh nothing; their outputs are cut.
        """
        size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        micro = split_batch(self.pad(batch), self.microbatches)
        group, total = self.mesh.group("pp"), self.first.stages
        owner = [next(r for r in range(self.pp) if s in stage_ids(self.schedule, r, self.pp)) for s in range(total)]
        device = next(self.model.parameters()).device
        outs, recorded = [], []
        try:
            for mb in micro:
                stream = None
                for s in range(total):
                    if owner[s] != self.rank:
                        continue
                    if s > 0 and owner[s - 1] != self.rank:  # the stream comes from another rank
                        stream = comm.recv_described(self.stream_size, group, owner[s - 1], device)
                    module = self.modules[self.ids.index(s)]
                    # through the module's call, so that ZeRO-3's FSDP2 hooks meet the stage's root unit first
                    result = module(evaluate=mb if s == 0 else stream, logprobs=logprobs)
                    if s == total - 1:
                        result, rec = result
                        recorded += [rec] if rec is not None else []
                        outs.append(self._resolved(result, mb) if last is None else
                                    dict(dict.fromkeys(FIELDS), logits=last(result.logits), loss_sum=0.0, targets=0))
                    elif owner[s + 1] != self.rank:
                        comm.send_described(list(result), group, owner[s + 1])
                    else:
                        stream = result
            aux = self._whole_aux(recorded) if batch.get("labels") is not None else 0.0
        except Exception as e:
            raise self._failed(e, " in a forward") from e
        finally:
            if self.fsdp:  # every unit (blocks too: under ZBV they keep their parameters gathered after a forward)
                from torch.distributed.fsdp import FSDPModule

                for unit in (u for module in self.modules for u in module.modules() if isinstance(u, FSDPModule)):
                    unit.reshard()
        return self._from_last(outs, size, device, aux)

    def _whole_aux(self, recorded: list) -> float:
        """``coef *`` the aux loss of the statistics summed over the micro-batches' recorders (the last stage's):
        one device's forward of the whole batch (0 on other ranks and for dense models)."""
        if not recorded:
            return 0.0
        module = self.modules[-1]
        stats = torch.stack([torch.cat([r.counts, r.tokens.reshape(1)]) for r in recorded]).sum(0)
        probsum = torch.stack([r.probsum for r in recorded]).sum(0)
        return float(module.routing.aux_term(module.routing.recorder(None, module.reduce(), (stats, probsum))))

    def _resolved(self, out, mb: dict) -> dict:
        """The last stage's Output of one micro-batch as plain tensors (reading deferred fields gathers
        over tp: every rank of the last stage reads them, in one order)."""
        fields = {name: getattr(out, name) for name in FIELDS}
        fields = {k: (v.detach() if v is not None else None) for k, v in fields.items()}
        n = self.model.num_targets(mb) if mb.get("labels") is not None else 0
        loss = float(out.loss) * n if n and out.loss is not None else 0.0
        return dict(fields, loss_sum=loss, targets=n)

    def _from_last(self, outs: list, size: int, device, aux: float = 0.0) -> PipelineOutput:
        """The last stage's micro-batch outputs, joined, on every rank of ``pp`` (broadcast from its rank);
        ``aux``: a mixture of experts' ``coef * aux loss`` of the whole batch, added to the loss."""
        group, src = self.mesh.group("pp"), self.last_rank
        if self.rank == src:
            joined = [torch.cat([o[name] for o in outs]) if outs[0][name] is not None else None for name in FIELDS]
            stats = torch.tensor([sum(o["loss_sum"] for o in outs), sum(o["targets"] for o in outs), aux],
                                 dtype=torch.float64, device=device)
            header = comm.describe(joined, device)
        else:
            joined, stats = None, torch.zeros(3, dtype=torch.float64, device=device)
            header = torch.zeros(len(FIELDS) * comm.HEADER, dtype=torch.int64, device=device)
        header = comm.broadcast_(header, group, src).cpu()
        if joined is None:
            joined = comm.empty_described(header, device)
        joined = [comm.broadcast_(t.contiguous(), group, src) if t is not None else None for t in joined]
        stats = comm.broadcast_(stats, group, src).cpu()
        values = {name: (t[:size] if t is not None else None) for name, t in zip(FIELDS, joined)}
        loss = torch.tensor(stats[0].item() / stats[1].item() + stats[2].item()) if stats[1] else None
        return PipelineOutput(loss=loss, **values)

    def _average_over_dp(self) -> None:
        """Every gradient averaged over ``dp`` (``dp x sp``); expert-parallel layers' over ``edp`` only (the
        ranks holding the same experts; none where ``edp`` is one rank: their gradients are complete)."""
        axis = "dpsp" if self.mesh.size("sp") > 1 else "dp"  # every sp rank holds every weight of its stages
        group = self.mesh.group(axis)
        if group is None or self.zero is not None or self.fsdp:  # ZeRO reduce-scatters (1, 2: at the step)
            return
        experts = {id(p) for p in expert_parameters(self.model)}
        average_grads([p for p in self.params if id(p) not in experts], group)
        if experts and self.mesh.group("edp") is not None:
            average_grads([p for p in self.params if id(p) in experts], self.mesh.group("edp"))
