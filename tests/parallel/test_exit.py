"""A process that started its groups with ``init_distributed`` and returns exits 0, never by SIGABRT.

A gloo process group destroyed during the interpreter's teardown can abort
the process ("terminate called without an active exception", signal 6), so
``init_distributed`` registers an exit handler
(``comm.release_groups_at_exit``) that ends the groups while the interpreter
is whole. Each round here starts two plain processes as torchrun starts
workers; they build a dp=2 mesh, run a few collectives on the world and on
the mesh's group and return; both must exit 0 having printed their line. The
abort is intermittent, so the test runs five rounds.
"""
from __future__ import annotations

import subprocess
import sys

from ..checkpoint.common import REPO, child_env
from .launch import free_port, rank_env

ROUNDS = 5
CHILD = """
import torch, torch.distributed as dist
from cuboid.parallel import Mesh, Plan
mesh = Mesh.build(Plan.parse("dp=2"))
t = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(t)
    dist.all_reduce(t, group=mesh.groups["dp"])
parts = [torch.empty(1000) for _ in range(2)]
dist.all_gather(parts, t)
assert parts[0].equal(parts[1]), "the ranks disagree"
print("returned", dist.get_rank())
"""


def _round() -> list:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], cwd=str(REPO),
                              env={**child_env(), **rank_env(r, 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=120)
            out.append((p.returncode, text))
    except subprocess.TimeoutExpired:
        out.append((None, "did not exit within 120 s"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def test_two_rank_processes_return_with_exit_code_zero():
    for i in range(ROUNDS):
        for rank, (rc, text) in enumerate(_round()):
            assert rc == 0, f"round {i}: rank {rank} exited with {rc} (a negative code is a signal):\n{text[-2000:]}"
            assert f"returned {rank}" in text and "terminate called" not in text, f"round {i}, rank {rank}:\n{text}"
