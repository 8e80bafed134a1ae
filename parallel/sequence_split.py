"""Sequence parallelism at the model level: each ``sp`` rank runs the blocks on its chunks of every sequence.

Installed by :func:`~cuboid.parallel.prepare` when ``plan.sp > 1``: the
model's ``forward`` becomes :meth:`SequenceSplit.forward`
(:meth:`~cuboid.parallel.state.ParallelState.install_forward`), which runs the zoo
model's own ``embed`` / blocks / ``head`` (the model code is unchanged):

1. ``embed`` runs on the whole sequence (ids or pixels are small; ViT's
   sequence exists only after its patch embedding), so position ids, token
   types and ViT's class token are those of one device;
2. the embedded sequence is padded to a multiple of ``2 sp`` (padded keys are
   masked, padded labels ignored) and cut in the zigzag layout
   (:func:`~cuboid.parallel.sequence.zigzag_split`: rank ``i`` holds chunks
   ``i`` and ``2 sp - 1 - i``, which balances causal attention);
3. the blocks run on the rank's ``T / sp`` tokens; their attention core (a
   :class:`~cuboid.parallel.layers.Attention` layer) has been swapped for
   ring or all-to-all attention over ``sp``. The blocks' mask is built on the
   whole rows (key mask, ``position_ids``, document ids of packed rows),
   padded and cut like the tokens (:meth:`SequenceSplit.local_mask`); it
   carries the whole rows' document ids too, which ring attention needs to
   know every chunk's documents (and skip chunk pairs that share none);
4. ``head`` runs on the rank's tokens: token labels are aligned before the cut
   (a causal LM's target of position ``t`` is token ``t + 1``, possibly on
   another rank; the spec's ``shifted_labels`` says so), and heads that read
   position 0 (BERT's and ViT's pooler; the spec's ``pooled_first``) get the
   true first token, broadcast from sp rank 0, in front of the rank's tokens;
5. the loss is the single-device one: token losses are weighted by the
   rank's share of the label positions and summed over ``sp``; an
   example-level loss (classification, the same on every sp rank) by
   ``1 / sp``. Gradients are averaged over the ``dp x sp`` group by the data
   parallel wrapper (or by ZeRO, which shards over that group), so the loss's
   backward is scaled by ``sp`` (the mean over ``dp`` of the sum over ``sp``). Logits and hidden states are gathered
   over ``sp`` (and put back in order) only when read;
6. a mixture of experts records the router statistics of the rank's tokens (the padding excluded); their aux
   loss is that of the statistics summed over ``sp`` (:class:`~.experts.BalanceReduce` over ``sp``, or the plan's
   ``balance_reduce`` over ``dp x sp``), added to the loss as on one device; ``router_logits`` are gathered
   over ``sp`` when read (:class:`~.moe_stream.GatheredLogits`).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .experts import BalanceReduce
from .head import logprob_targets
from .mask import Mask
from .moe_stream import Routing, recording_of
from .state import balance_reduce_of
from .sequence import (ZigzagDocs, all_to_all_attention, ring_attention, zigzag_merge, zigzag_positions,
                       zigzag_split)


@dataclass(frozen=True, eq=False)
class SequenceMask(Mask):
    """A :class:`~cuboid.parallel.mask.Mask` of this sp rank's zigzag tokens (``keep``, ``positions``,
    ``docs`` cut like the tokens) with ``row_docs``, the whole rows' document ids as the sp attention takes
    them: a :class:`~cuboid.parallel.sequence.ZigzagDocs` under ring attention (built once per forward,
    its one host read), the (B, T) ids under all-to-all; None without documents."""

    row_docs: Any = None


class SequenceAttention(nn.Module):
    """The attention core over the ``sp`` group: ``ring`` or ``all_to_all``, on zigzag-laid-out tokens
    (rotary embeddings, when the model gives them, at the positions of ``mask``, else at those tokens'
    positions in the whole sequence); ``mask`` a :class:`SequenceMask` (:meth:`SequenceSplit.local_mask`);
    ``window`` the swapped core's sliding window (:class:`~cuboid.parallel.layers.Attention`)."""

    role = "attention"

    def __init__(self, group, mode: str, window: Optional[int] = None) -> None:
        super().__init__()
        self.group, self.mode, self.window = group, mode, window

    def forward(self, q, k, v, *, causal: bool, mask: Optional[Mask] = None, rope=None, sinks=None):
        if mask is not None and mask.docs is not None and not isinstance(mask, SequenceMask):
            raise TypeError("sequence-parallel attention takes packed rows as a SequenceMask (the whole rows' "
                            "document ids with this rank's): build it with SequenceSplit.local_mask")
        if rope is not None:
            if mask is not None and mask.positions is not None:  # the batch's positions, cut like the tokens
                q, k = rope(q, k, mask.positions)
            else:  # this rank's tokens sit at its zigzag chunks' positions
                sp, rank = comm.group_size(self.group), comm.group_rank(self.group)
                T = q.shape[2] * sp
                q, k = rope(q, k, zigzag_positions(T, sp, rank, q.device), ("zigzag", T, sp, rank))
        keep = None if mask is None else mask.keep
        docs = None if mask is None else mask.row_docs
        more = {} if sinks is None else {"sinks": sinks}  # gpt-oss's (H,) sink logits, this rank's heads
        if self.mode == "ring":
            return ring_attention(q, k, v, self.group, causal=causal, key_padding_mask=keep, doc_ids=docs,
                                  window=self.window, **more)
        return all_to_all_attention(q, k, v, self.group, causal=causal, key_padding_mask=keep, layout="zigzag",
                                    doc_ids=docs, window=self.window, **more)

    def extra_repr(self) -> str:
        return f"mode={self.mode}" + ("" if self.window is None else f", window={self.window}")


class _SumOverSp(torch.autograd.Function):
    """Forward: the sum over ``sp`` of each rank's loss term. Backward: the gradient times ``sp``, because the
    data-parallel wrapper averages gradients over ``dp x sp`` where the step wants the sum over ``sp``."""

    @staticmethod
    def forward(ctx, t, group, sp):
        ctx.sp = sp
        out = t.detach().clone().contiguous()
        comm.all_reduce_(out, group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.sp, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _FromFirstRank(torch.autograd.Function):
    """Forward: sp rank 0's tensor on every rank. Backward: the gradients summed on rank 0 (zero elsewhere)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.detach().clone().contiguous()
        comm.broadcast_(out, group, 0)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce_(g, ctx.group)
        return (g if comm.group_rank(ctx.group) == 0 else torch.zeros_like(g)), None


def _embed_whole(model: nn.Module, embed_args: tuple, batch: dict, what: str) -> tuple:
    """The model's ``embed`` of the whole batch, (B, T, C), and the (B, T) bool mask of kept tokens."""
    unknown = set(batch) - set(embed_args) - {"attention_mask", "labels", "position_ids"}
    if unknown:
        raise TypeError(f"{type(model).__name__} under {what} got unexpected inputs {sorted(unknown)}")
    x = model.embed(**{k: batch[k] for k in embed_args if batch.get(k) is not None})  # (B, T, C)
    B, T, _ = x.shape
    mask = batch.get("attention_mask")
    keep = mask.to(torch.bool) if mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
    if keep.shape != (B, T):
        raise ValueError(f"attention_mask {tuple(keep.shape)} does not match the sequence {(B, T)}")
    return x, keep


class SequenceSplit:
    """The forward of a zoo model under sequence parallelism (see the module docstring)."""

    def __init__(self, model: nn.Module, spec, mesh) -> None:
        self.model, self.spec, self.mesh = model, spec, mesh
        self.group, self.sp, self.rank = mesh.group("sp"), mesh.size("sp"), mesh.coords.get("sp", 0)
        self.mode = "ring"  # the attention cores' (swap_attention)
        self._embed_args = tuple(inspect.signature(model.embed).parameters)
        self.shifted = bool(getattr(spec, "shifted_labels", False))
        self.pooled_first = bool(getattr(spec, "pooled_first", False))
        self.routing = Routing.of(model)  # a mixture of experts: its router statistics are recorded
        # under sp alone, the recorder's reduce: the aux loss of the statistics summed over sp
        self.balance = BalanceReduce(self.group) if self.routing is not None else None

    def swap_attention(self, mode: str) -> int:
        """Replace every attention core of the model by the sp one; returns how many."""
        self.mode = mode
        n = 0
        for mod in list(self.model.modules()):
            for name, child in list(mod.named_children()):
                if getattr(child, "role", None) == "attention" and not isinstance(child, SequenceAttention):
                    setattr(mod, name, SequenceAttention(self.group, mode, getattr(child, "window", None)))
                    n += 1
        return n

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        return zigzag_split(t, self.sp, self.rank, 1)

    def _gather(self, t: torch.Tensor, cut, length: int) -> torch.Tensor:
        """Every rank's (B, T/sp, ...) tokens back in sequence order, extra positions cut, to ``length``."""
        t = cut(t)
        parts = comm.gather_from(t.contiguous(), self.group, 1).chunk(self.sp, dim=1)
        return zigzag_merge(list(parts), self.sp, 1)[:, :length]

    def enter(self, batch: dict) -> tuple:
        """The embeddings of the whole batch, cut: ``(x, keep, local_labels, labels, n)`` with ``x`` this rank's
        (B, T_pad / sp, C) tokens, ``keep`` the whole (B, T) mask of kept tokens, ``local_labels`` this rank's
        aligned token labels (None for example labels or none), ``labels`` the batch's and ``n`` the token
        label positions of the whole batch."""
        labels = batch.get("labels")
        x, keep = _embed_whole(self.model, self._embed_args, batch, "sequence parallelism")
        token_labels = labels if labels is not None and labels.dim() == 2 else None
        if token_labels is not None and self.shifted:  # position t learns token t + 1 (maybe another rank's)
            token_labels = torch.cat([token_labels[:, 1:], torch.full_like(token_labels[:, :1], -100)], 1)
        pad = (-x.shape[1]) % (2 * self.sp)
        x = self._split(F.pad(x, (0, 0, 0, pad)))
        local = self._split(F.pad(token_labels, (0, pad), value=-100)) if token_labels is not None else None
        return x, keep, local, labels, int((token_labels != -100).sum()) if token_labels is not None else 0

    def local_mask(self, whole: Mask, tokens: int) -> Optional[SequenceMask]:
        """This rank's attention cores' mask from the ``whole`` rows' :class:`~cuboid.parallel.mask.Mask`
        ((B, T) fields, document ids counted on whole rows), padded to ``tokens`` (the padded tail masked,
        its own document) and cut like the tokens; None when no key is masked and no position is given
        (the same choice on every sp rank). Packed rows under ring attention: one host read (the
        :class:`~cuboid.parallel.sequence.ZigzagDocs` table), once per forward for every layer."""
        whole = whole.pad(tokens)
        keep = whole.keep
        if keep is not None and bool(keep.all()):
            keep = None
        if keep is None and whole.positions is None:
            return None
        row_docs = whole.docs
        if row_docs is not None and self.mode == "ring":
            row_docs = ZigzagDocs(row_docs, self.sp)
        return SequenceMask(*(None if t is None else self._split(t) for t in (keep, whole.positions, whole.docs)),
                            row_docs=row_docs)

    def whole_mask(self, keep: torch.Tensor, position_ids: Optional[torch.Tensor]) -> Mask:
        """The whole rows' Mask of a batch: ``keep`` (B, T) bool and HF's ``position_ids`` ((B, T) or
        (1, T), restarting at 0 at each document), document ids counted on the whole rows."""
        if position_ids is None:
            return Mask(keep=keep)
        whole = Mask.of(None, position_ids, keep.shape[0])
        return Mask(keep, whole.positions, whole.docs)

    def leave(self, x, residual, local_labels, labels, length: int, n_total: Optional[int] = None,
              logprobs: bool = False, last: Optional[torch.Tensor] = None):
        """The model's head on this rank's tokens: the single-device loss (summed over sp) and outputs
        gathered in order, ``length`` tokens, when read. ``n_total``: the batch's token label positions
        (None: counted here, a sum over sp). ``logprobs``: the per-token outputs too, gathered likewise to
        (B, ``length`` - 1) (:meth:`_gather_tokens`). ``last`` (B,): each row's last token, which the head
        reads (the spec's ``pooled_last``): :meth:`_leave_at_last`."""
        if last is not None:
            return self._leave_at_last(x, residual, labels, length, last)
        model = self.model
        front = back = 0
        if self.pooled_first:  # the true first token (rank 0's position 0) in front of this rank's tokens
            x = torch.cat([_FromFirstRank.apply(x[:, :1], self.group), x], 1)
            if residual is not None:
                residual = torch.cat([_FromFirstRank.apply(residual[:, :1], self.group), residual], 1)
            if local_labels is not None:
                local_labels = F.pad(local_labels, (1, 0), value=-100)
            front = 1
        elif self.shifted:  # the head pairs position p with label p + 1: one position more, labels moved by one
            x = F.pad(x, (0, 0, 0, 1))
            if residual is not None:
                residual = F.pad(residual, (0, 0, 0, 1))
            if local_labels is not None:
                local_labels = F.pad(local_labels, (1, 0), value=-100)
            back = 1
        token = labels is not None and labels.dim() == 2
        out = model.head(x, residual, local_labels if token else labels, **({"logprobs": True} if logprobs else {}))
        if labels is not None and out.loss is not None:
            if token:  # this rank's share of the label positions
                n_local = int((local_labels != -100).sum())
                if n_total is None:  # (every sp rank counts alike)
                    counts = torch.tensor([float(n_local)], dtype=torch.float64, device=x.device)
                    n_total = int(comm.all_reduce_(counts, self.group).item())
                term = out.loss.nan_to_num(0.0) * 0.0 if n_local == 0 else out.loss * (n_local / max(n_total, 1))
            else:
                term = out.loss / self.sp
            out.loss = _SumOverSp.apply(term, self.group, self.sp)

        def cut(t):
            return t[:, front:t.shape[1] - back]

        fields = ["last_hidden_state"] + (["logits"] if token or labels is None else [])
        for name in fields:
            value = out.raw(name)  # as stored: a deferred field stays unmade
            if value is None or (name == "logits" and not self.spec.per_token):
                continue
            out.defer(name, lambda t, _cut=cut: self._gather(t, _cut, length))
        for name in ("token_logps", "token_entropy") if logprobs else ():
            out.defer(name, lambda t: self._gather_tokens(t, length - 1))
        return out

    def _leave_at_last(self, x, residual, labels, length: int, last: torch.Tensor):
        """A classifier on each row's ``last`` token (which may be any rank's): the whole rows gathered in order
        on every sp rank (backward keeps this rank's positions' gradient, times sp, as
        :meth:`_gather_tokens`), the head on them as on one device; its example-level loss, the same on every
        rank, counted once over sp (``1 / sp`` each, summed)."""
        whole = [None if t is None else self._gather(_ScaleGrad.apply(t, self.sp), lambda u: u, length)
                 for t in (x, residual)]
        out = self.model.head(*whole, labels, last=last)
        if labels is not None and out.loss is not None:
            out.loss = _SumOverSp.apply(out.loss / self.sp, self.group, self.sp)
        return out

    def _gather_tokens(self, t: torch.Tensor, length: int) -> torch.Tensor:
        """Per-token outputs (B, T_pad / sp) of this rank's positions (the head paired each with its aligned
        label) -> (B, ``length``) in sequence order. Backward keeps this rank's positions' gradient, times sp:
        the data-parallel wrapper averages gradients over ``dp x sp``, where each sp rank's part is a share of
        one device's (as :class:`_SumOverSp`)."""
        return self._gather(_ScaleGrad.apply(t, self.sp), lambda u: u, length)

    def local_keep(self, keep: torch.Tensor, tokens: int) -> torch.Tensor:
        """(B * ``tokens``,) this rank's tokens that count in the router statistics, in the order the sparse
        layers see them, from the whole (B, T) ``keep``: the padding to ``tokens * sp`` does not count."""
        keep = F.pad(keep.to(torch.bool), (0, tokens * self.sp - keep.shape[1]), value=False)
        return self._split(keep).reshape(-1)

    def last_of(self, batch: dict) -> Optional[torch.Tensor]:
        """(B,) each row's last token that is not padding, where the head reads it (the spec's ``pooled_last``),
        from the whole rows' ``input_ids``; None otherwise."""
        return self.model.last_tokens(batch["input_ids"]) if self.spec.pooled_last else None

    def reduce_for(self) -> Callable:
        """The statistics' reduction: the plan's ``balance_reduce`` on the model (``dp x sp``, set by prepare
        where data parallelism spreads a forward's tokens too), else the sum over ``sp`` (:attr:`balance`)."""
        return balance_reduce_of(self.model) or self.balance

    def gather_router(self, logits: torch.Tensor, tokens: int, length: int) -> torch.Tensor:
        """One layer's router logits (B * ``tokens``, E) of this rank's tokens -> one device's (B * ``length``,
        E), the rows in sequence order."""
        whole = self._gather(logits.reshape(-1, tokens, logits.shape[-1]), lambda t: t, length)
        return whole.reshape(-1, whole.shape[-1])

    def forward(self, output_router_logits: Optional[bool] = None, logprobs: bool = False, **batch):
        """The model's forward under sp; ``logprobs`` as the zoo model's (its targets: the labels, or the
        input ids without labels, and then no loss)."""
        no_loss = False
        if logprobs:
            batch, no_loss = logprob_targets(batch)
        out = self._forward(output_router_logits, logprobs, batch)
        if no_loss:
            out.loss = None
        return out

    def _forward(self, output_router_logits: Optional[bool], logprobs: bool, batch: dict):
        x, keep, local_labels, labels, n_total = self.enter(batch)
        mask = self.local_mask(self.whole_mask(keep, batch.get("position_ids")), x.shape[1] * self.sp)
        rec, routed = None, output_router_logits
        if self.routing is not None:
            routed = self.routing.routed if routed is None else routed
            rec = self.routing.recorder(self.local_keep(keep, x.shape[1]), self.reduce_for(), keep_logits=routed)
        residual = None
        with recording_of(rec):
            for block in getattr(self.model, self.spec.blocks):
                x, residual = block(x, residual, mask)
        tokens, length = x.shape[1], keep.shape[1]
        out = self.leave(x, residual, local_labels, labels, length, n_total, logprobs, self.last_of(batch))
        if rec is None:
            return out
        return self.routing.finish(out, rec, labels, routed, gather=lambda t: self.gather_router(t, tokens, length))


class TensorSequenceSplit:
    """Megatron-style sequence parallelism inside the 1D ``tp`` group (Korthikanti et al., arXiv 2205.05198).

    The model's forward becomes: ``embed`` on the whole sequence (replicated,
    as under plain 1D), the sequence padded to a multiple of ``tp`` and cut
    into ``tp`` contiguous chunks, the blocks run with their norms, dropout
    and residual stream on this rank's ``T / tp`` tokens (the column linears
    all-gather their input along the sequence instead of copying it, the row
    linears reduce-scatter their output instead of all-reducing it, and the
    norms' and row biases' gradients are summed over ``tp``), then the
    sequence is gathered and ``head`` runs as under plain 1D. Traffic per
    block equals plain 1D's (all-gather + reduce-scatter = all-reduce); the
    activations between the linears shrink by ``tp``.
    """

    def __init__(self, model: nn.Module, spec, mesh) -> None:
        self.model, self.spec, self.mesh = model, spec, mesh
        self.group, self.tp = mesh.group("tp"), mesh.size("tp")
        self._embed_args = tuple(inspect.signature(model.embed).parameters)
        self.active = True  # False inside :meth:`unsplit` (the pipeline's stages read it too)
        for mod, name, _ in self._sharded():
            setattr(mod, name, 1 if name == "seq_dim" else self.group)

    def _sharded(self) -> list:
        """(module, attribute, value) of every setting that shards the blocks' tokens over ``tp``."""
        from .layers import LayerNorm, RMSNorm
        from .tensor.d1 import ColumnLinear, RowLinear

        out = []
        for block in getattr(self.model, self.spec.blocks):
            for mod in block.modules():
                if isinstance(mod, (ColumnLinear, RowLinear)):
                    out.append((mod, "seq_dim", mod.seq_dim))
                elif isinstance(mod, (LayerNorm, RMSNorm)):
                    out.append((mod, "seq_group", mod.seq_group))
        return out

    @contextlib.contextmanager
    def unsplit(self):
        """The model as under plain 1D tensor parallelism while inside: the linears copy and all-reduce, the
        norms see whole sequences, and ``model(**batch)`` is the model's own forward (under pp the pipeline's,
        whose stages then run plain 1D). Generation decodes one
        token a step against a cache of whole sequences, which has no sequence to shard; the weights are
        plain 1D's either way."""
        settings = self._sharded()
        # the split's own forward off the instance (under pp the pipeline's stays: its stages read ``active``)
        forward = self.model.__dict__.pop("forward") if self.model.__dict__.get("forward") == self.forward else None
        for mod, name, _ in settings:
            setattr(mod, name, None)
        self.active = False
        try:
            yield self.model
        finally:
            self.active = True
            for mod, name, value in settings:
                setattr(mod, name, value)
            if forward is not None:
                self.model.forward = forward

    def forward(self, logprobs: bool = False, **batch):
        model = self.model
        no_loss = False
        if logprobs:
            batch, no_loss = logprob_targets(batch)
        x, keep = _embed_whole(model, self._embed_args, batch, "sequence-sharded tensor parallelism")
        B, T, _ = x.shape
        pad = (-T) % self.tp
        mask = self.mask(keep, batch.get("position_ids"), T + pad)
        x = comm.scatter_to(F.pad(x, (0, 0, 0, pad)), self.group, 1)  # (B, T / tp, C): this rank's tokens
        residual = None
        for block in getattr(model, self.spec.blocks):
            x, residual = block(x, residual, mask)
        x = comm.gather_from(x, self.group, 1)[:, :T]
        if residual is not None:
            residual = comm.gather_from(residual, self.group, 1)[:, :T]
        head = {"logprobs": True} if logprobs else {}
        if self.spec.pooled_last:  # a classifier on each row's last token that is not padding
            head["last"] = model.last_tokens(batch["input_ids"])
        out = model.head(x, residual, batch.get("labels"), **head)
        if no_loss:
            out.loss = None
        return out

    @staticmethod
    def mask(keep: torch.Tensor, position_ids: Optional[torch.Tensor], tokens: int) -> Optional[Mask]:
        """The attention cores' Mask: they see the whole (gathered) sequence, padded to ``tokens`` (padded keys
        masked, the padded tail its own document); ``keep`` (B, T) bool, ``position_ids`` HF's (packed rows);
        None when no key is masked and no position is given."""
        whole = Mask.of(keep, position_ids, keep.shape[0])
        if tokens > keep.shape[1]:
            whole = (whole or Mask(keep=keep)).pad(tokens)
        return whole


def bytes_per_step(*, n_layers: int, heads: int, head_dim: int, batch: int, seq: int, sp: int, mode: str = "ring",
                   masked: bool = False, elem: int = 4, dim: int = 0, first_token: int = 0,
                   recompute: bool = False, kv_heads: Optional[int] = None) -> dict:
    """Bytes one rank sends over ``sp`` in one training step (forward + backward), per op, in
    :mod:`cuboid.parallel.comm`'s convention; what a test measures with ``comm.count``.

    ``heads`` are the heads this rank's attention runs (``n_heads / tp`` under
    1D), ``seq`` the sequence length before padding to ``2 sp``, ``elem`` the
    bytes of q/k/v elements, ``masked`` whether a key padding mask travels
    (an attention mask with zeros, or padding), ``kv_heads`` the key/value
    heads of grouped-query attention (None: ``heads``), ``first_token`` how many
    (B, 1, dim) tensors a pooled head takes from sp rank 0 (BERT 1, ViT 2:
    its pre-LN residual too), ``recompute`` activation checkpointing (the
    forward's attention traffic runs again in backward). Not counted: the
    data-parallel gradient all-reduce over ``dp x sp`` (torch's reducer).
    Ring per layer: forward ``(sp - 1)(2 n e + m)``, backward ``(sp - 1) 2 n e
    + sp 2 n 4`` (dK/dV travel in fp32); all-to-all per layer ``8 (sp - 1) / sp
    n e`` plus ``(sp - 1) m`` for the mask's all-gather; ``n = B H (T/sp) D``,
    ``m = B T / sp`` mask bytes. Under grouped-query attention the ring's ``n``
    counts the key/value heads, and all-to-all moves ``2 n + 2 n_kv`` each way.
    """
    t = seq + (-seq) % (2 * sp)
    n = batch * heads * (t // sp) * head_dim
    nkv = batch * (kv_heads or heads) * (t // sp) * head_dim  # the ring passes only the key/value heads
    m = batch * t // sp if masked else 0
    out: dict = {}

    def add(op, value):
        out[op] = out.get(op, 0.0) + value

    forward_layers = n_layers * (2 if recompute else 1)
    if mode == "ring":
        add("send", forward_layers * (sp - 1) * (2 * nkv * elem + m)
            + n_layers * ((sp - 1) * 2 * nkv * elem + sp * 2 * nkv * 4))
    else:  # q, k, v and the output each way
        per = 2 * (sp - 1) / sp * (2 * n + 2 * nkv) * elem
        add("all_to_all", n_layers * per + (forward_layers - n_layers) * per / 2)
        add("all_gather", forward_layers * (sp - 1) * m)
    add("all_reduce", 2 * (sp - 1) / sp * 4)  # the loss's sum over sp (fp32 scalar)
    if first_token:
        add("broadcast", first_token * (sp - 1) / sp * batch * dim * elem)
        add("all_reduce", first_token * 2 * (sp - 1) / sp * batch * dim * elem)
    return out
