"""The tied LM head and the logits it makes.

:class:`TiedHead` is the head of a token table (``h @ W.T (+ bias)`` with the
table as W): its loss goes through the fused linear cross-entropy, a chunk of
rows at a time and vocab-parallel under the tensor modes, so training never
holds whole logits; the logits themselves are a :class:`Deferred`, made when
read from the forward's ``h`` and the head's weight as it was then
(:class:`_Kept`: copied only if an optimizer steps before they are read).
:class:`cuboid.parallel.layers.Embedding` is the one-device head; each tensor
mode's vocab table overrides its hooks (``_head_input``, ``_head_weight``,
``_head_group``, ``_vocab_slice``, ``_head_mean``, ``gather_logits``).

Also here: the mean cross-entropy of logits (:func:`cross_entropy`, chunked
in fp32 for half-precision logits) and the pieces the modes' vocab-parallel
losses share (:func:`flat_rows`, :func:`mean_of`).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

import cuboid.kernels as kernels
from cuboid.parallel import comm

__all__ = ["Deferred", "lazy", "TiedHead", "cross_entropy", "flat_rows", "logprob_targets", "mean_of"]


class Deferred:
    """A value made when it is first read, e.g. whole logits gathered from vocab shards.

    Reading runs collectives under tensor parallelism, so every rank of the
    group must read it (in the same order). The grad mode of the moment it was
    created is kept, so a deferred gather stays differentiable.
    """

    __slots__ = ("fn", "args", "grad")

    def __init__(self, fn, *args) -> None:
        self.fn, self.args, self.grad = fn, args, torch.is_grad_enabled()

    def resolve(self):
        with torch.set_grad_enabled(self.grad):
            return self.fn(*self.args)

    def then(self, fn) -> "Deferred":
        """A deferred ``fn(value)``."""
        return Deferred(lambda: fn(self.resolve()))


def lazy(fn, *args) -> Deferred:
    """``fn(*args)``, computed when read (see :class:`Deferred`)."""
    return Deferred(fn, *args)


def _autocast_state(device: torch.device) -> tuple:
    """(device type or None where autocast does not apply, enabled, dtype) of autocast now."""
    if device.type not in ("cpu", "cuda"):
        return None, False, None
    on = torch.is_autocast_enabled(device.type)
    return device.type, on, torch.get_autocast_dtype(device.type)


class _Kept:
    """A parameter (or a view of one) the lazy logits read, held without a copy.

    The copy is made only if an optimizer is about to step while the logits are still unread (a global
    optimizer step pre-hook copies every live one), so a training loop that reads ``.loss`` alone never
    copies the head's table (for Llama 3's bf16 table that is 1 GiB a step). A value changed in place by
    anything else before it is read is refused at the read, by its version counter, rather than read
    changed.
    """

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version
        _UNCOPIED.add(self)
        if not _STEP_HOOK:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _STEP_HOOK.append(register_optimizer_step_pre_hook(_copy_kept_before_step))

    def copy(self) -> None:
        if self.tensor._version == self.version:
            self.tensor = self.tensor.clone()
            self.version = self.tensor._version

    def value(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("the logits of this output are made when read, from the head's weight as it was in "
                               "the forward, and that weight has since been changed in place outside an optimizer "
                               "step: read .logits before changing the weights")
        return self.tensor


_UNCOPIED: "weakref.WeakSet[_Kept]" = weakref.WeakSet()  # _Kept values of unread logits not copied yet
_STEP_HOOK: list = []


def _copy_kept_before_step(optimizer, args, kwargs) -> None:
    for kept in list(_UNCOPIED):
        kept.copy()
    _UNCOPIED.clear()


def _kept(t: torch.Tensor, param: Optional[torch.Tensor], amp: tuple, copy_now: bool):
    """``t`` as the lazy logits keep it. A temporary (a mode's gathered table: ``param`` given, another storage)
    is kept as is, cast to the autocast dtype when autocast is on; ``t`` that may be a parameter (``param``
    None, or its storage) is kept as a :class:`_Kept`, or, with ``copy_now`` (its storage is released after
    use: ZeRO-3), copied (cast under autocast) now. :func:`_kept_value` reads either.

    Traced by ``torch.compile`` a parameter is kept as it is (cast under autocast; copied with ``copy_now``):
    the version counter and the optimizer hook are host-side bookkeeping a graph cannot hold, so compiled
    logits are made from the head's weight as it is when they are read (read them before the optimizer step)."""
    cast = amp[1] and t.is_floating_point() and t.dtype != amp[2]
    if torch.compiler.is_compiling():
        return t.to(amp[2]) if cast else t.clone() if copy_now else t
    temporary = param is not None and t.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    if temporary or copy_now:
        return t.to(amp[2]) if cast else t if temporary else t.clone()
    return _Kept(t)


def _kept_value(t):
    return t.value() if isinstance(t, _Kept) else t


@contextlib.contextmanager
def _nothing():
    yield


class TiedHead:
    """Mixin: the LM head of a token table ``weight`` (num_embeddings, dim), its loss and its logits.

    Tensor modes override the hooks below (the head's operands, the group its
    softmax normaliser is reduced over, the mean over their batch layout, the
    gather of logits), so that the loss is computed on each rank's vocab slice
    without gathering the logits; ``lm_outputs`` is the same for all.
    """

    lm_chunk: Optional[int] = None  # rows per chunk of the fused head's loss (None: the kernel's default)
    # set by ZeRO-3 (FSDP2 frees the gathered table after backward): the lazy logits then copy it in forward
    weights_released_after_use: bool = False

    def lm_outputs(self, h: torch.Tensor, labels: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                *, shift: bool = False, ignore_index: int = -100) -> tuple:
        """The LM head ``h @ W.T (+ bias)`` on (.., dim) ``h``: ``(loss, logits)``.

        With ``labels`` (laid out as ``h``'s rows; ``shift=True``: (B, T) labels, position t predicting label
        t + 1, as a causal LM) the loss is the mean cross-entropy through the fused linear cross-entropy
        (:func:`cuboid.kernels.linear_cross_entropy`): a chunk of rows at a time, vocab-parallel under the
        tensor modes, never holding the whole logits; ``logits`` is then a :class:`Deferred` made when read,
        from ``h`` and the head's weight as they were in this forward (an optimizer step in between copies the
        weight first: :class:`_Kept`; under ZeRO-3 it is copied in forward). Without labels the loss is
        None and the (local) logits are made now, gathered when read. ``bias``: (vocab,) or this rank's
        slice of it (a vocab-split tensor's output).
        """
        x, w = self._head_input(h), self._head_weight()
        if labels is None:
            return None, lazy(self.gather_logits, F.linear(x, w, bias))
        xs, ys, kw = self._fused_operands(x, labels, shift, ignore_index)
        total = kernels.linear_cross_entropy(xs, w, ys, bias, reduction="sum", **kw)
        loss = self._head_mean(total, (ys != ignore_index).sum())
        return loss, self._deferred_logits(h, w, bias)

    def lm_logprobs(self, h: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    ignore_index: int = -100) -> tuple:
        """The causal LM head's per-token outputs on (B, T, dim) ``h`` against (B, T) ``labels`` (position t
        predicting label t + 1): ``(loss, logits, token_logps, token_entropy)``.

        ``token_logps`` (B', T - 1) fp32: ``log p(labels[:, 1:])``, 0 where the label is ``ignore_index``,
        differentiable (any upstream gradient per token); ``token_entropy`` (B', T - 1) the softmax's entropy
        at each position (every position, no gradient). Both from one pass of the fused linear cross-entropy
        (``reduction="none"``), vocab-parallel under the tensor modes, never holding whole logits; B' is the
        rows of ``h`` here (a 2D/3D batch block: the model's batch split gathers them). ``loss`` is the mean
        over the labels of ``-token_logps`` (the same value as :meth:`lm_outputs`' loss), ``logits`` deferred as
        there.
        """
        x, w = self._head_input(h), self._head_weight()
        xs, ys, kw = self._fused_operands(x, labels, True, ignore_index)
        rows, entropy = kernels.linear_cross_entropy(xs, w, ys, bias, reduction="none", return_entropy=True, **kw)
        loss = self._head_mean(rows.sum(), (ys != ignore_index).sum())
        return loss, self._deferred_logits(h, w, bias), -rows, entropy

    def _fused_operands(self, x: torch.Tensor, labels: torch.Tensor, shift: bool, ignore_index: int) -> tuple:
        """(rows of x, their int64 labels, the fused loss's keywords: chunk and vocab-parallel form)."""
        xs, ys = (x[:, :-1], labels[:, 1:]) if shift else (x, labels)
        start, vocab = self._vocab_slice()
        group = self._head_group()
        reduce = None if comm.group_size(group) <= 1 else (lambda t, op: comm.all_reduce_(t, group, op))
        kw = dict(ignore_index=ignore_index, chunk=self.lm_chunk, vocab_start=start, vocab_size=vocab, reduce=reduce)
        return xs, ys.to(torch.long), kw

    def _deferred_logits(self, h: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> Deferred:
        """The whole logits of this forward, made when read (:meth:`_late_logits`) from its kept operands."""
        amp = _autocast_state(h.device)
        w = _kept(w, self.weight, amp, self.weights_released_after_use)
        bias = _kept(bias, None, amp, self.weights_released_after_use) if bias is not None else None
        return lazy(self._late_logits, h, w, bias, amp)

    def lm_logits(self, h: torch.Tensor, bias: Optional[torch.Tensor] = None, gather: bool = True) -> torch.Tensor:
        """``h @ W.T (+ bias)``: (.., dim) -> (.., vocab). ``gather=False`` may return a local slice."""
        logits = F.linear(self._head_input(h), self._head_weight(), bias)
        return self.gather_logits(logits) if gather else logits

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of (possibly local, ``gather=False``) logits against full labels."""
        return cross_entropy(logits, labels, ignore_index)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (.., vocab) logits from what ``lm_logits(gather=False)`` returned."""
        return logits

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The head's left operand made from ``h`` (a mode's copy or gather of it, in the compute dtype)."""
        return h

    def _head_weight(self) -> torch.Tensor:
        """The head's (local vocab, dim) right operand (a mode's gathered table)."""
        return self.weight

    def _head_group(self):
        """The group over which the vocab slices of the logits lie (None: whole here)."""
        return None

    def _vocab_slice(self) -> tuple:
        """(global class of the local logits' first column, real vocabulary size)."""
        return 0, self.num_embeddings

    def _head_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The mean loss from this rank's (sum of row losses, counted rows)."""
        return mean_of(total, count)

    def _late_logits(self, h: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], amp: tuple):
        """Whole logits, made when read, from the forward's ``h`` and head operands, under its autocast."""
        w, bias = _kept_value(w), _kept_value(bias)
        with torch.autocast(amp[0], dtype=amp[2], enabled=amp[1]) if amp[0] else _nothing():
            return self.gather_logits(F.linear(self._head_input(h), w, bias))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy over rows of half-precision (N, V) logits.

    The softmax is computed in fp32 one chunk of rows at a time, in forward and
    again in backward, so no full fp32 copy of the logits is ever held (at
    gpt2 vocab, a (8 x 1024, 50257) fp32 copy is 1.6 GB). Each chunk runs
    torch's native log-softmax kernels.
    """

    @staticmethod
    def forward(ctx, logits, labels, ignore_index: int, chunk: int):
        acc = torch.promote_types(logits.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            total += F.cross_entropy(logits[s:s + chunk].to(acc), labels[s:s + chunk],
                                     ignore_index=ignore_index, reduction="sum")
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            with torch.enable_grad():
                block = logits[s:s + ctx.chunk].to(grad.dtype).requires_grad_()
                loss = F.cross_entropy(block, labels[s:s + ctx.chunk], ignore_index=ctx.ignore_index,
                                       reduction="sum")
                g, = torch.autograd.grad(loss, block, grad)
            out[s:s + ctx.chunk] = g
        return out, None, None, None


def logprob_targets(batch: dict) -> tuple:
    """``(batch, drop_loss)`` for a forward asked for token log-probabilities: their targets are the batch's
    ``labels``, or its ``input_ids`` when it has none (TRL's ``selective_log_softmax(logits[:, :-1],
    input_ids[:, 1:])``), put in as labels; ``drop_loss`` then says the output's loss is not the caller's
    (it asked for none)."""
    if batch.get("labels") is not None:
        return batch, False
    if batch.get("input_ids") is None:
        raise ValueError("logprobs=True needs input_ids or labels: the log-probabilities are of their next tokens")
    return dict(batch, labels=batch["input_ids"]), True


def flat_rows(logits: torch.Tensor, labels: torch.Tensor, vocab: int, ignore_index: int = -100):
    """(N, Vl) logits and (N,) int64 labels from (.., Vl) and (..), checked: one label per row, and every
    label other than ``ignore_index`` in [0, ``vocab``) (an ``IndexError`` naming it otherwise)."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).to(torch.long)
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"cross_entropy: {labels.shape[0]} labels for {logits.shape[0]} rows of logits")
    if labels.is_meta or torch.compiler.is_compiling():  # a host read: a compiled graph leaves it to the loss
        return logits, labels
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise IndexError(f"cross_entropy: label {int(labels[bad][0])} outside [0, {vocab})")
    return logits, labels


def mean_of(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count`` for a loss: NaN when ``count`` is 0 (as ``F.cross_entropy`` when every label is
    ignored), with a zero gradient then (``0 / 0`` would send NaN into every gradient, even when the caller
    multiplies the loss by zero, as a rank or micro-batch without labels does)."""
    count = count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  chunk: Optional[int] = None) -> torch.Tensor:
    """Mean cross-entropy of (..., V) logits against (...) labels, HF style (-100 ignored).

    fp32/fp64 logits use ``F.cross_entropy`` as they are; half-precision logits
    go through a chunked fp32 computation that never materialises a full fp32
    copy (``chunk`` rows at a time; default about 64 MiB of fp32 per chunk).
    NaN when every label is ignored, as ``F.cross_entropy``. Labels outside
    [0, V) other than ``ignore_index`` are an ``IndexError``.
    """
    v = logits.shape[-1]
    logits, labels = flat_rows(logits, labels, v, ignore_index)
    if logits.dtype in (torch.float32, torch.float64) and chunk is None:
        return F.cross_entropy(logits, labels, ignore_index=ignore_index)
    if chunk is None:
        chunk = max(1, min(logits.shape[0], (1 << 24) // max(v, 1)))
    count = (labels != ignore_index).sum()
    return mean_of(_ChunkedCrossEntropy.apply(logits, labels, ignore_index, chunk), count)
