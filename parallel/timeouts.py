"""Timeouts and failures of collectives: every group waits a bounded time, a failure names rank, op, group.

:mod:`.comm` re-exports these names. Groups made by
:func:`new_group` wait :func:`timeout_s` seconds (``CUBOID_TIMEOUT_S``,
default 300; ``--timeout-s`` sets it); a failed or stalled collective or p2p
is raised as a :class:`CollectiveError` / :class:`CollectiveTimeout` whose
message names this rank, the operation and the group.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
from typing import Optional

import torch
import torch.distributed as dist

from .groups import group_name, is_named


class CollectiveError(RuntimeError):
    """A collective or p2p of this rank failed; the message names the rank, the operation and the group."""


class CollectiveTimeout(CollectiveError):
    """A collective or p2p waited past its group's timeout: a peer stalled or died."""


_TIMEOUT_S: list = []  # [seconds] once set


def set_timeout(seconds: float) -> None:
    """The timeout of the groups made from now on (``init_distributed`` sets the world's)."""
    if not seconds > 0:
        raise ValueError(f"a process group timeout must be a positive number of seconds, got {seconds}")
    _TIMEOUT_S[:] = [float(seconds)]


def timeout_s() -> float:
    """Seconds a collective or p2p waits for its peers: as set, else ``CUBOID_TIMEOUT_S``, else 300."""
    return _TIMEOUT_S[0] if _TIMEOUT_S else float(os.environ.get("CUBOID_TIMEOUT_S", "300"))


_MADE: dict = {}  # (ranks, name, timeout) -> (the world it was made in, group)


def new_group(ranks: list, name: Optional[str] = None):
    """``dist.new_group(ranks)`` with :func:`timeout_s` (torch's default is the backend's, 30 minutes for
    gloo, not the world's) and ``name`` as its description (NCCL's watchdog prints it); every rank of the
    world calls it, in the same order.

    A group is made once per (ranks, name, timeout) in a world and reused by
    every later call: each gloo group holds threads and sockets, and a process
    that loads many models (sweeps, notebooks, the planner) would otherwise
    gain them with every load. Every rank decides the same way, since every
    rank makes the same calls in the same order.
    """
    key = (tuple(int(r) for r in ranks), name, timeout_s())
    world = dist.group.WORLD
    made = _MADE.get(key)
    if made is not None and made[0] is world:
        return made[1]
    group = dist.new_group(list(key[0]), timeout=datetime.timedelta(seconds=key[2]), group_desc=name)
    _MADE[key] = (world, group)
    release_groups_at_exit()
    return group


_RELEASE_REGISTERED: list = []


def release_groups_at_exit() -> None:
    """Destroy the process groups and let go of the kept ones when the interpreter exits (registered once).

    A gloo group destructed during the interpreter's teardown (one still
    referenced from a module's globals, as :data:`_MADE` does) can abort the
    process ("terminate called without an active exception", SIGABRT), even
    in a run that just returns. An exit handler runs while the interpreter is
    still whole. A program that destroyed its groups itself
    loses nothing: the handler then only drops the kept references.
    """
    if not _RELEASE_REGISTERED:
        atexit.register(_release_groups)
        _RELEASE_REGISTERED.append(True)


def _release_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_groups()
    gc.collect()


def forget_groups() -> None:
    """Make the next :func:`new_group` calls make new groups (the ones made so far stay usable).

    Every rank must call it at the same point. For a process that goes on
    after a :class:`CollectiveError` (a test of failures; a training job
    should end and be restarted): the failed group is broken for good.
    """
    _MADE.clear()


def _group_timeout(group) -> float:
    """The timeout ``group`` was made with, in seconds (:func:`timeout_s` when its backend does not say)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - NCCL, or another torch
        return timeout_s()


def as_collective_error(op: str, group, exc: BaseException, *, known: bool = True) -> Optional[CollectiveError]:
    """``exc``, raised by ``op`` over ``group`` (None: the world), as a :class:`CollectiveError` naming this
    rank, the op and the group (:class:`CollectiveTimeout` for a timeout). ``known=False``: the call may
    not have been a collective, so None unless the message says timeout or a closed connection."""
    if isinstance(exc, CollectiveError):
        return exc
    text, world = str(exc), dist.group.WORLD if dist.is_initialized() else None
    low = text.lower()
    timeout = "timed out" in low or "timeout" in low
    closed = any(k in low for k in ("closed by peer", "connection reset", "broken pipe"))
    if not (known or timeout or closed):
        return None
    group = world if group is None else group
    try:
        ranks = " (ranks " + ",".join(map(str, dist.get_process_group_ranks(group))) + ")"
    except Exception:  # noqa: BLE001 - ranks are only a label
        ranks = ""
    name = "world" if group is world and not is_named(group) else group_name(group)
    where = f"rank {dist.get_rank() if world is not None else 0}: {op} over group '{name}'{ranks}"
    if timeout:
        return CollectiveTimeout(f"{where} timed out after {_group_timeout(group):g} s: a peer stalled or died")
    why = "a peer closed its connection (it died or gave up)" if closed else text.splitlines()[0] if text \
        else type(exc).__name__
    return CollectiveError(f"{where} failed: {why}")


def wait_p2p(works, op: str, group) -> None:
    """Wait for p2p ``works`` as :class:`guarded` says. On gloo each waits at most :func:`timeout_s` (its
    plain wait on a p2p never times out); NCCL's plain wait, stream-ordered, is kept (with a timeout it
    would block the CPU until the transfer ends) and its watchdog ends a stall."""
    timeout = datetime.timedelta(seconds=timeout_s()) if dist.get_backend(group) == "gloo" else None
    with guarded(op, group):
        for w in works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)


class guarded:
    """``with guarded(op, group): <call>`` re-raises the call's RuntimeError as :func:`as_collective_error`
    says; free when the call succeeds."""

    __slots__ = ("op", "group")

    def __init__(self, op: str, group) -> None:
        self.op, self.group = op, group

    def __enter__(self) -> "guarded":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, RuntimeError) and not issubclass(kind, CollectiveError):
            raise as_collective_error(self.op, self.group, exc) from exc
        return False


_FSDP_COMMS: list = []  # (all-gather, reduce-scatter), made once


def guard_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """Give every ``fully_shard`` unit of ``model`` (ZeRO-3) torch's default FSDP2 comms wrapped in
    :class:`guarded`: FSDP2 runs them synchronously, so a failure surfaces in the call."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    if not _FSDP_COMMS:
        class GuardedAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                with guarded("all_gather (ZeRO-3 parameters)", group):
                    return super().__call__(output_tensor, input_tensor, group, async_op)

        class GuardedReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                with guarded("reduce_scatter (ZeRO-3 gradients)", group):
                    return super().__call__(output_tensor, input_tensor, group, op, async_op)

        _FSDP_COMMS[:] = [GuardedAllGather(), GuardedReduceScatter()]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(_FSDP_COMMS[0])
            m.set_custom_reduce_scatter(_FSDP_COMMS[1])
    return model
