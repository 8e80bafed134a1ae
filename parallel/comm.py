"""Every collective of cuboid goes through here: paired autograd Functions that count bytes.

Two kinds of calls, both taking an explicit process group:

- **autograd pairs** (Megatron ``mappings.py`` without its global state), each
  named for what it does forward and what its backward is:

  ==========================================  ===================  ==================
  function                                    forward              backward
  ==========================================  ===================  ==================
  ``copy_to(x, group)``                       identity             all-reduce
  ``reduce_from(x, group)``                   all-reduce           identity
  ``scatter_to(x, group, dim)``               keep own chunk       all-gather
  ``gather_from(x, group, dim)``              all-gather           keep own chunk
  ``reduce_scatter_to(x, group, dim)``        reduce-scatter       all-gather
  ``all_gather_to(x, group, dim)``            all-gather           reduce-scatter
  ``all_to_all(x, group, scatter_dim,         all-to-all           all-to-all
  gather_dim)``                                                    (dims swapped)
  ==========================================  ===================  ==================

  ``gather_from``/``scatter_to`` are the tensor-parallel pair whose backward
  discards (the gradient of a replicated value is already complete);
  ``all_gather_to``/``reduce_scatter_to`` are the pair whose backward sums
  (sequence parallelism, ZeRO-3), the gradient of each copy being partial.

- **plain helpers** (no autograd) for optimizer norms, checkpoint gathering and
  the like: :func:`all_reduce_`, :func:`broadcast_`, :func:`all_gather_list`,
  :func:`ring_shift`.

A group of ``None`` or of one rank makes every call a no-op that records
nothing. (``None`` means *no group*, as on a :class:`~cuboid.parallel.Mesh`
axis of size one; pass ``torch.distributed.group.WORLD`` for the whole world.)
Outputs are allocated on the input's device. Chunks along ``dim`` must divide
evenly; an uneven split is a ``ValueError``.

**Byte convention.** Each call adds to every open :func:`count` tally the bytes
*this rank sends* under the textbook ring / pipelined algorithms, whatever the
backend really does, for a group of ``p`` ranks, with ``n`` the size in bytes
of the *full* tensor named below:

==================  ============================  ===================================
op key              n is                          bytes sent per rank
==================  ============================  ===================================
``all_reduce``      the tensor reduced            ``2 (p - 1) / p * n``
``all_gather``      the gathered output           ``(p - 1) / p * n``
``reduce_scatter``  the (unscattered) input       ``(p - 1) / p * n``
``all_to_all``      the input (= output size)     ``(p - 1) / p * n``
``broadcast``       the tensor broadcast          ``(p - 1) / p * n`` (the per-rank
                                                  mean of a chain: all but the
                                                  last rank forward n)
``send``            the tensor sent (ring shift)  ``n``
==================  ============================  ===================================

The autograd pairs record under the collective they run (``copy_to``'s
backward records an ``all_reduce``). Values are floats (exact whenever the
formula gives a whole number). Groups are keyed by a human name given with
:func:`name_group` (the mesh names its groups ``dp``, ``tp``, ``tp_row``, ...);
an unnamed group is ``group[r0,r1,...]`` (its global ranks).

    with comm.count() as tally:
        loss.backward()
    tally.bytes("all_reduce", "tp"), tally.per_group(), tally.total

**Failures** (:mod:`.timeouts`, re-exported here). Groups made by :func:`new_group` wait :func:`timeout_s` seconds
(``CUBOID_TIMEOUT_S``, default 300) for their peers. A failed call here, in
DDP's bucket hook (:func:`ddp_comm_hook`) or FSDP2's comms (:func:`guard_fsdp`)
raises :class:`CollectiveError` naming this rank, the op and the group
(:class:`CollectiveTimeout` when a peer stalled): never retried, it should end
the process so that the elastic launcher restarts the workers.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .groups import group_name, name_group
from .timeouts import (CollectiveError, CollectiveTimeout, as_collective_error, forget_groups, guard_fsdp, guarded,
                       new_group, release_groups_at_exit, set_timeout, timeout_s, wait_p2p)

__all__ = ["copy_to", "reduce_from", "scatter_to", "gather_from", "reduce_scatter_to", "all_gather_to",
           "all_to_all", "all_reduce_", "broadcast_", "all_gather_list", "ring_shift", "count", "Tally",
           "name_group", "group_name", "group_size", "group_rank", "reduce_scatter_", "all_gather_",
           "CollectiveError", "CollectiveTimeout", "timeout_s", "set_timeout", "new_group", "guarded",
           "as_collective_error", "forget_groups", "release_groups_at_exit", "send_", "recv_", "guard_fsdp",
           "ddp_comm_hook", "wait_p2p"]


# ----------------------------------------------------------------- group names


def group_size(group) -> int:
    """Ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def active(group) -> int:
    """The group size, or 0 when calls on ``group`` are no-ops."""
    p = group_size(group)
    return p if p > 1 else 0


# ----------------------------------------------------------------- byte tallies


class Tally:
    """Bytes sent and calls made by this rank, per (op, group name)."""

    def __init__(self) -> None:
        self._bytes: dict = defaultdict(float)
        self._calls: dict = defaultdict(int)

    def add(self, op: str, group: str, nbytes: float) -> None:
        self._bytes[(op, group)] += nbytes
        self._calls[(op, group)] += 1

    def bytes(self, op: Optional[str] = None, group: Optional[str] = None) -> float:
        """Bytes sent, summed over the ops/groups that match (``None`` matches all)."""
        return sum(v for (o, g), v in self._bytes.items()
                   if (op is None or o == op) and (group is None or g == group))

    def calls(self, op: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(v for (o, g), v in self._calls.items()
                   if (op is None or o == op) and (group is None or g == group))

    def per_op(self) -> dict:
        out: dict = defaultdict(float)
        for (o, _), v in self._bytes.items():
            out[o] += v
        return dict(out)

    def per_group(self) -> dict:
        out: dict = defaultdict(float)
        for (_, g), v in self._bytes.items():
            out[g] += v
        return dict(out)

    def items(self) -> dict:
        """{(op, group): (calls, bytes)}."""
        return {k: (self._calls[k], v) for k, v in self._bytes.items()}

    @property
    def total(self) -> float:
        return sum(self._bytes.values())

    def __repr__(self) -> str:
        rows = ", ".join(f"{o}@{g}: {c} calls {v:.0f} B" for (o, g), (c, v) in sorted(self.items().items()))
        return f"Tally({rows or 'empty'})"


_TALLIES: list[Tally] = []


@contextlib.contextmanager
def count() -> Iterator[Tally]:
    """Count the traffic of this rank inside the block; nestable (outer tallies see inner traffic)."""
    tally = Tally()
    _TALLIES.append(tally)
    patched = _count_torch_engines() if len(_TALLIES) == 1 else contextlib.nullcontext()
    try:
        with patched:
            yield tally
    finally:
        _TALLIES.remove(tally)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """No :func:`count` tally sees the traffic inside the block (a recompute replays collectives without
    sending anything)."""
    saved = list(_TALLIES)
    _TALLIES.clear()
    try:
        yield
    finally:
        _TALLIES[:] = saved


@contextlib.contextmanager
def _count_torch_engines() -> Iterator[None]:
    """Count the traffic of torch's engines under the same convention: FSDP2's collectives
    (``dist.all_gather_single``/``reduce_scatter_single``) and the pipelining schedules' sends
    (``schedules._batch_p2p``); cuboid's own calls hold the unpatched functions. DDP's bucket
    all-reduces are counted by :func:`ddp_comm_hook`."""
    with _count_pipeline_sends():
        with _count_fsdp():
            yield


@contextlib.contextmanager
def _count_pipeline_sends() -> Iterator[None]:
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:  # pragma: no cover - torch without pipelining
        yield
        return
    plain = schedules._batch_p2p

    def counted(p2p_ops, *args, **kwargs):
        for op in p2p_ops:
            if op.op is dist.isend:
                record("send", op.group, _nbytes(op.tensor))
        return plain(p2p_ops, *args, **kwargs)

    schedules._batch_p2p = counted
    try:
        yield
    finally:
        schedules._batch_p2p = plain


def ddp_comm_hook(group, bucket):  # no return annotation: DDP checks it against the real type
    """DDP's bucket average over ``group`` (what its built-in all-reduce does: divide, then sum), counted
    as an ``all_reduce`` like :func:`all_reduce_`. Register it with ``model.register_comm_hook(group, ...)``.
    A failed all-reduce fails backward with a RuntimeError quoting the :class:`CollectiveError` (DDP's
    reducer keeps the message, not the type)."""
    buf = bucket.buffer()
    p = group_size(group) if group is not None else dist.get_world_size()
    record("all_reduce", group, 2 * (p - 1) / p * _nbytes(buf))
    buf.div_(p)
    with guarded("all_reduce (DDP gradient bucket)", group):
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def done(f):
        try:
            return f.value()[0]
        except RuntimeError as e:
            raise as_collective_error("all_reduce (DDP gradient bucket)", group, e) from e

    return fut.then(done)


@contextlib.contextmanager
def _count_fsdp() -> Iterator[None]:
    names = ("all_gather_single", "reduce_scatter_single")
    saved = {n: getattr(dist, n, None) for n in names}

    def gather(output_tensor, input_tensor, group=None, async_op=False, **kw):
        p = group_size(group) if group is not None else dist.get_world_size()
        record("all_gather", group, (p - 1) / p * _nbytes(output_tensor))
        return saved["all_gather_single"](output_tensor, input_tensor, group=group, async_op=async_op, **kw)

    def scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, **kw):
        p = group_size(group) if group is not None else dist.get_world_size()
        record("reduce_scatter", group, (p - 1) / p * _nbytes(input))
        return saved["reduce_scatter_single"](output, input, op=op, group=group, async_op=async_op, **kw)

    if saved["all_gather_single"] is None:
        yield
        return
    dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = saved["all_gather_single"], saved["reduce_scatter_single"]


def record(op: str, group, nbytes: float) -> None:
    if _TALLIES:
        name = group_name(group)
        for t in _TALLIES:
            t.add(op, name, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------- plain collectives

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (``sum | max | min | product``); returns ``t``."""
    p = active(group)
    if not p:
        return t
    if not t.is_contiguous():
        raise ValueError("all_reduce_ needs a contiguous tensor (it reduces in place)")
    record("all_reduce", group, 2 * (p - 1) / p * _nbytes(t))
    with guarded("all_reduce", group):
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def broadcast_(t: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Overwrite ``t`` with the copy of the group's rank ``src`` (an index *inside* the group)."""
    p = active(group)
    if not p:
        return t
    record("broadcast", group, (p - 1) / p * _nbytes(t))
    with guarded("broadcast", group):
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t


def send_(tensors: list, group, dst: int) -> None:
    """Send ``tensors`` (contiguous) to the group's rank ``dst`` (an index inside the group); returns once
    they are sent. The receiver calls :func:`recv_` with tensors of the same shapes and dtypes."""
    works = []
    for t in tensors:
        record("send", group, _nbytes(t))
        with guarded("send", group):
            works.append(dist.isend(t, dist.get_global_rank(group, dst), group=group))
    wait_p2p(works, f"send of {len(tensors)} tensor(s) to group rank {dst}", group)


def recv_(tensors: list, group, src: int) -> list:
    """Receive into ``tensors`` from the group's rank ``src`` (:func:`send_`'s pair); returns them."""
    works = []
    for t in tensors:
        with guarded("recv", group):
            works.append(dist.irecv(t, dist.get_global_rank(group, src), group=group))
    wait_p2p(works, f"recv of {len(tensors)} tensor(s) from group rank {src}", group)
    return tensors


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
HEADER = 6  # int64 per tensor in a description: ndim (-1: none), four sizes, dtype code


def describe(tensors, device=None) -> torch.Tensor:
    """What a receiver needs to allocate ``tensors`` (None allowed, at most 4 dims each): :data:`HEADER`
    int64 per tensor, on ``device`` (the first tensor's by default)."""
    rows = []
    for t in tensors:
        if t is None:
            rows.append([-1, 0, 0, 0, 0, 0])
            continue
        if t.dim() > 4:
            raise ValueError(f"a described tensor has at most 4 dims, got {tuple(t.shape)}")
        rows.append([t.dim(), *t.shape, *[0] * (4 - t.dim()), _DTYPES.index(t.dtype)])
    if device is None:
        device = next((t.device for t in tensors if t is not None), "cpu")
    return torch.tensor(rows, dtype=torch.int64, device=device).flatten()


def empty_described(header: torch.Tensor, device) -> list:
    """Uninitialised tensors (None where the sender had none) as :func:`describe` described them."""
    out = []
    for row in header.view(-1, HEADER).tolist():
        out.append(None if row[0] < 0 else torch.empty(row[1:1 + row[0]], dtype=_DTYPES[row[5]], device=device))
    return out


def send_described(tensors: list, group, dst: int) -> None:
    """:func:`send_` of ``tensors`` (None allowed) preceded by their description, to a receiver that does
    not know their shapes (:func:`recv_described`)."""
    send_([describe(tensors)], group, dst)
    send_([t.contiguous() for t in tensors if t is not None], group, dst)


def recv_described(count: int, group, src: int, device) -> list:
    """The ``count`` tensors (None where the sender had none) that :func:`send_described` sent from ``src``."""
    header = recv_([torch.empty(count * HEADER, dtype=torch.int64, device=device)], group, src)[0]
    tensors = empty_described(header.cpu(), device)
    recv_([t for t in tensors if t is not None], group, src)
    return tensors


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on all ranks), in group order; ``[t]`` when no-op."""
    p = active(group)
    if not p:
        return [t]
    flat = t.contiguous().reshape(-1)
    out = torch.empty(p * flat.numel(), dtype=t.dtype, device=t.device)
    record("all_gather", group, (p - 1) * _nbytes(t))
    with guarded("all_gather", group):
        _gather_single(out, flat, group=group)
    return list(out.view(p, *t.shape).unbind(0))


def reduce_scatter_(t: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of the flat ``t``, this rank's 1/p chunk of it (a new tensor); ``t`` if no-op."""
    p = active(group)
    if not p:
        return t.clone()
    if t.dim() != 1 or t.numel() % p:
        raise ValueError(f"reduce_scatter_ takes a flat tensor whose size divides over {p} ranks, got {tuple(t.shape)}")
    out = torch.empty(t.numel() // p, dtype=t.dtype, device=t.device)
    record("reduce_scatter", group, (p - 1) / p * _nbytes(t))
    with guarded("reduce_scatter", group):
        _reduce_scatter_single(out, t.contiguous(), group=group)
    return out


def all_gather_(out: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """Fill the flat ``out`` with every rank's flat ``t`` in group order (``out`` is p times ``t``)."""
    p = active(group)
    if not p:
        out.copy_(t)
        return out
    if out.numel() != p * t.numel() or not out.is_contiguous():
        raise ValueError(f"all_gather_: out has {out.numel()} elements, not {p} x {t.numel()}")
    record("all_gather", group, (p - 1) / p * _nbytes(out))
    with guarded("all_gather", group):
        _gather_single(out, t.contiguous(), group=group)
    return out


def ring_shift(t: torch.Tensor, group, shift: int = 1) -> torch.Tensor:
    """Send ``t`` to the rank ``shift`` ahead in the group and return the one ``shift`` behind's."""
    p = active(group)
    if not p:
        return t
    r = group_rank(group)
    to, frm = dist.get_global_rank(group, (r + shift) % p), dist.get_global_rank(group, (r - shift) % p)
    t = t.contiguous()
    out = torch.empty_like(t)
    record("send", group, _nbytes(t))
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, to, group), dist.P2POp(dist.irecv, out, frm, group)])
    wait_p2p(works, f"ring_shift (send to rank {to}, recv from rank {frm})", group)
    return out


def _check_split(x: torch.Tensor, dim: int, p: int, what: str) -> int:
    if x.shape[dim] % p:
        raise ValueError(f"{what}: dim {dim} of size {x.shape[dim]} does not split over {p} ranks")
    return x.shape[dim] // p


def _gather(x: torch.Tensor, group, p: int, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((p * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    record("all_gather", group, (p - 1) * _nbytes(moved))
    with guarded("all_gather", group):
        _gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group, p: int, dim: int) -> torch.Tensor:
    """Sum over ranks, keeping this rank's chunk along ``dim``."""
    _check_split(x, dim, p, "reduce_scatter")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // p,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    record("reduce_scatter", group, (p - 1) / p * _nbytes(moved))
    with guarded("reduce_scatter", group):
        _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def _chunk(x: torch.Tensor, group, p: int, dim: int) -> torch.Tensor:
    n = _check_split(x, dim, p, "scatter")
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


def _all_to_all(x: torch.Tensor, group, p: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    _check_split(x, scatter_dim, p, "all_to_all")
    send = torch.stack(x.chunk(p, dim=scatter_dim), 0).contiguous()  # (p, ...) chunk i goes to rank i
    recv = torch.empty_like(send)
    record("all_to_all", group, (p - 1) / p * _nbytes(send))
    with guarded("all_to_all", group):
        dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


# ----------------------------------------------------------------- autograd pairs


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.contiguous().clone(), ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Along(torch.autograd.Function):
    """One collective along a dim forward and its pair backward; ``there`` and ``back`` take
    ``(x, group, p, dim)`` (:func:`_chunk`, :func:`_gather`, :func:`_reduce_scatter`)."""

    @staticmethod
    def forward(ctx, x, group, p, dim, there, back):
        ctx.args, ctx.back = (group, p, dim), back
        return there(x, group, p, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g, *ctx.args), None, None, None, None, None


def _along(x: torch.Tensor, group, dim: int, there, back) -> torch.Tensor:
    p = active(group)
    return _Along.apply(x, group, p, dim % x.ndim, there, back) if p else x


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, p, scatter_dim, gather_dim):
        ctx.args = (group, p, gather_dim, scatter_dim)
        return _all_to_all(x, group, p, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, *ctx.args), None, None, None, None


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, group) if active(group) else x


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a parallel region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFrom.apply(x, group) if active(group) else x


def scatter_to(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of a replicated ``x`` along ``dim``; backward all-gathers."""
    return _along(x, group, dim, _chunk, _gather)


def gather_from(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' chunks along ``dim`` into a replicated tensor; backward keeps own chunk."""
    return _along(x, group, dim, _gather, _chunk)


def reduce_scatter_to(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Sum partial ``x`` over ranks and keep own chunk along ``dim``; backward all-gathers."""
    return _along(x, group, dim, _reduce_scatter, _gather)


def all_gather_to(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` whose backward reduce-scatters (each copy's gradient is partial)."""
    return _along(x, group, dim, _gather, _reduce_scatter)


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim``, send chunk i to rank i, concatenate what arrives along ``gather_dim``."""
    p = active(group)
    return _AllToAll.apply(x, group, p, scatter_dim % x.ndim, gather_dim % x.ndim) if p else x
