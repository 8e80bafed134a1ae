"""Run a function on N gloo ranks on loopback, bounded in time: the one launcher of the tests and benches.

``run_world(fn, n, *args)`` spawns n processes, each with the torchrun
environment (:func:`rank_env`: RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a
free MASTER_PORT), calls ``fn(*args)`` in each (``fn`` must be importable: a
module-level function), and returns the list of return values by rank. An
exception in any rank, or a timeout, fails the caller with that rank's
traceback; a rank whose process exits without returning or raising (killed,
``os._exit``, a crash) fails it within seconds, naming the rank and its exit
code, rather than at the timeout.

:func:`gather_world` is the same launch for a caller that wants what
finished when something did not (a benchmark reports the cases that ran
before a hang): ``fn`` may be a generator, whose every value travels back as
soon as it is yielded, and the outcome is returned, not raised.

**Warm worlds: one process group per world size.** Starting a world costs
more than most tests run in it (n interpreters importing torch, Dynamo, Triton
and cuboid), so the ranks of a world are forked from one fork server that
imported those once (PRELOAD; the caller's environment is handed to each rank),
started once per size and kept (:class:`_Warm`), and each call is a job sent to
them. The first job that starts a process group (as a user's program does,
from the torchrun environment the job gets) starts the world's; later jobs
find it started, as a program that loads several models does. Between jobs
a rank undoes what a job leaves behind: cuboid's kept subgroups are
forgotten (a job may have broken one on purpose), the collective timeout
unset, the environment, the default dtype and torch.compile's caches reset;
then a monitored barrier on the world's group (a rank that fails it exits,
so the next call starts a new world). A failed job, a timeout or a rank
that exits takes the whole warm world down (its ranks may be stuck in a
collective); the next call starts a new one. One world is kept at a time, and
tests/conftest.py lets it leave at the end of each test file (idle ranks
still take some CPU). ``fresh=True`` (and
``hard_exit``; ``CUBOID_TEST_FRESH_WORLDS=1`` for every call) spawns new
interpreters for that call: for tests that measure a process's memory (a
forked rank starts with the server's imports), kill ranks or leave by
``os._exit``.
"""
from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import time
import traceback
import atexit
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port of a world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> Dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a one-machine world on loopback (gloo, one thread)."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


@dataclass
class Gathered:
    """What :func:`gather_world` got: every value each rank sent, in order, and the first failure."""

    parts: List[list]
    failed_rank: Optional[int] = None  # the rank whose traceback is ``error`` (None: a timeout, or no error)
    error: Optional[str] = None
    finished: List[bool] = field(default_factory=list)  # per rank: fn returned

    def complete(self, n: int) -> bool:
        """Whether every rank sent at least ``n`` values."""
        return all(len(p) >= n for p in self.parts)


def _entry(fn, rank, world, port, queue, args, hard_exit):
    os.environ.update(rank_env(rank, world, port))
    try:
        import torch
        torch.set_num_threads(1)
        from cuboid.kernels import use_backend

        with use_backend("torch"):
            result = fn(*args)
            for value in result if isinstance(result, types.GeneratorType) else [result]:
                queue.put((rank, "part", value))
        queue.put((rank, "done", None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if hard_exit:  # the results are flushed, then the interpreter's teardown is skipped
            queue.close()
            queue.join_thread()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def gather_world(fn, world: int, *args, timeout: float = 180.0, hard_exit: bool = False,
                 fresh: bool = False) -> Gathered:
    """Run ``fn(*args)`` on ``world`` ranks until all return, one fails, or ``timeout`` s pass (a hang).

    A generator ``fn`` sends each yielded value (``Gathered.parts[rank]``); a
    plain one sends its return value as its one part. ``hard_exit``: the ranks
    leave by ``os._exit`` once their results are sent, skipping the
    interpreter's teardown (Triton's nanobind prints leak reports there).
    ``fresh``: new processes for this call, not the warm world (module docstring).
    """
    if not (fresh or hard_exit or os.environ.get("CUBOID_TEST_FRESH_WORLDS") == "1"):
        return _Warm.of(world).run(fn, args, timeout)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, hard_exit), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = Gathered(parts=[[] for _ in range(world)], finished=[False] * world)
    try:
        _receive(out, queue.get, procs, timeout)
    finally:
        for p in procs:
            p.join(timeout=10 if out.error is None else 1)
            if p.is_alive():
                p.kill()
    return out


def _receive(out: Gathered, get, procs, timeout: float) -> None:
    """Fill ``out`` from ``get`` (a queue's, giving (rank, status, value)) until every rank is done, one sent an
    error, one exited without a word (:func:`_exited`) or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    gone: dict = {}  # rank -> when it was first seen exited without its "done"
    try:
        while not all(out.finished):
            try:
                rank, status, value = get(timeout=min(POLL_S, max(0.1, deadline - time.monotonic())))
            except queue_module.Empty:
                if time.monotonic() >= deadline:
                    raise
                out.failed_rank, out.error = _exited(procs, out.finished, gone)
                if out.error is not None:
                    return
                continue
            if status == "error":
                out.failed_rank, out.error = rank, value
                return
            if status == "part":
                out.parts[rank].append(value)
            else:
                out.finished[rank] = True
    except Exception as e:  # queue.Empty on timeout
        out.error = f"timed out after {timeout:.0f} s waiting for ranks ({type(e).__name__})"


POLL_S = 2.0  # how often the parent looks for a rank that exited without a word
GRACE_S = 5.0  # how long an exited rank's last messages may take to arrive before it counts as dead


def _exited(procs, finished, gone: dict) -> tuple:
    """(rank, error) for a rank whose process exited without sending "done" or an error (killed, os._exit, a
    crash in the interpreter) and stayed silent for GRACE_S since: the others would wait for it until the
    timeout. (None, None) while every unfinished rank lives."""
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if finished[rank] or p.exitcode is None:
            continue
        if now - gone.setdefault(rank, now) >= GRACE_S:
            return rank, f"rank {rank}'s process exited with code {p.exitcode} before it returned or raised"
    return None, None


def run_world(fn, world: int, *args, timeout: float = 180.0, fresh: bool = False):
    """``fn(*args)`` on ``world`` ranks; the return values by rank, or an AssertionError naming the failure."""
    out = gather_world(fn, world, *args, timeout=timeout, fresh=fresh)
    if out.error is not None:
        who = "the world" if out.failed_rank is None else f"rank {out.failed_rank}"
        raise AssertionError(f"{who} failed:\n{out.error}")
    return [p[0] for p in out.parts]


def _job_reset(saved_env: dict) -> None:
    """What a job leaves behind in a warm rank, undone (module docstring); exits if the world's group broke."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    from cuboid.parallel import timeouts

    timeouts.forget_groups()
    timeouts._TIMEOUT_S.clear()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_default_dtype(torch.float32)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    if dist.is_initialized():
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - the world's group is unusable: this rank leaves, the world restarts
            sys.stderr.flush()
            os._exit(3)


def _warm_entry(rank, world, jobs, results, env):
    """A warm rank: runs the jobs it is sent, one after another, until it is sent None. ``env``: the caller's
    environment when the world started (a rank forked from the fork server would have the server's)."""
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from cuboid.kernels import use_backend

    saved_env = dict(os.environ)
    world_port = None  # the rendezvous port of the world's process group, once a job started it
    while True:
        job = jobs.get()
        if job is None:
            return
        number, port, fn, args = job
        os.environ.update(rank_env(rank, world, port if world_port is None else world_port))
        try:
            with use_backend("torch"):
                result = fn(*args)
                for value in result if isinstance(result, types.GeneratorType) else [result]:
                    results.put((number, rank, "part", value))
            results.put((number, rank, "done", None))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((number, rank, "error", traceback.format_exc()))
        finally:
            if world_port is None and dist.is_initialized():
                world_port = port
            _job_reset(saved_env)
            sys.stdout.flush()
            sys.stderr.flush()


# What every rank imports, imported once by the fork server that warm ranks are forked from (module docstring)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
           "torch.distributed.pipelining", "cuboid", "cuboid.kernels", "cuboid.parallel", "cuboid.zoo",
           "cuboid.tasks", "tests.parallel.launch")


def _forkserver():
    """The multiprocessing context of warm worlds: forked from one server process that imported PRELOAD (a
    spawned rank imports torch, Dynamo, Triton and cuboid anew: seconds of CPU each, times the ranks)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Warm:
    """The kept ranks of one world size (module docstring): started on first use, stopped at exit or failure."""

    _kept: Dict[int, "_Warm"] = {}

    def __init__(self, world: int) -> None:
        ctx = _forkserver()
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        env = dict(os.environ)
        self.procs = [ctx.Process(target=_warm_entry, args=(r, world, self.jobs[r], self.results, env), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.number = 0

    @classmethod
    def of(cls, world: int) -> "_Warm":
        """The warm world of ``world`` ranks, started if none is kept or one of its ranks has exited. One world is
        kept at a time (idle ranks still take some CPU): a world of another size lets its ranks leave first."""
        for size in [s for s in cls._kept if s != world]:
            cls._kept[size].leave()
        kept = cls._kept.get(world)
        if kept is not None and any(p.exitcode is not None for p in kept.procs):
            kept.stop()
            kept = None
        if kept is None:
            kept = cls._kept[world] = cls(world)
        return kept

    def run(self, fn, args, timeout: float) -> Gathered:
        """One job on every rank, as :func:`gather_world` reports it; a failure stops this world."""
        self.number += 1
        port = free_port()
        for q in self.jobs:
            q.put((self.number, port, fn, args))
        out = Gathered(parts=[[] for _ in range(self.world)], finished=[False] * self.world)
        _receive(out, self._get, self.procs, timeout)
        if out.error is not None:
            self.stop()
        return out

    def _get(self, timeout: float) -> tuple:
        """The next (rank, status, value) of the current job (a failed job stops the world, so no message of an
        earlier one can come; one would be dropped)."""
        while True:
            number, rank, status, value = self.results.get(timeout=timeout)
            if number == self.number:
                return rank, status, value

    def stop(self) -> None:
        """Kill the ranks (a failed job's peers may wait in a collective) and forget this world."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        if _Warm._kept.get(self.world) is self:
            del _Warm._kept[self.world]

    def leave(self) -> None:
        """Let the ranks leave (cuboid's exit handler destroys their process groups), then forget this world."""
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.stop()

    @classmethod
    def stop_all(cls) -> None:
        for kept in list(cls._kept.values()):
            kept.leave()


atexit.register(_Warm.stop_all)
