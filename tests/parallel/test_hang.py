"""A peer that stalls is an error, not a hang: CollectiveTimeout names the rank, the group and the operation.

One 2-rank world of plain processes, started as torchrun starts workers (this
file run as ``python -m tests.parallel.test_hang``), runs the cases in turn.
For each, both ranks load gpt-debug under the case's plan (fresh groups, made
with ``TIMEOUT``) and take two steps; then rank 1 stalls (sleeps past the
timeout) and rank 0 enters the operation under test:

- ``tp``: a training forward under tp1d, whose first all-reduce over the
  ``tp`` group (``comm.reduce_from``) waits for rank 1;
- ``zero3``: a training forward under dp=2 with ZeRO-3, whose FSDP2 parameter
  all-gather waits over ``dp`` (``comm.guard_fsdp``);
- ``pp``: a 1F1B step under pp2, whose first stage waits on its p2p with the
  last stage over ``pp`` (``pipeline._timed_p2p``);
- ``ddp``: a backward under dp2, whose gradient bucket all-reduce (DDP's comm
  hook, ``comm.ddp_comm_hook``) waits over ``dp``.

Rank 0 must fail with :class:`~cuboid.parallel.comm.CollectiveTimeout` naming
``rank 0``, the group and the op, after the timeout and within the timeout
plus 30 s. It catches the error and meets rank 1 on the world group (whose
timeout is long, so that a slow start on a loaded machine is not mistaken for
a stall) before the next case, except in the last case: there the error is
left unhandled, as in a training script, and the process must exit non-zero
as promptly (the elastic agent then restarts the workers); rank 1 is killed
then, as the agent would.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from ..checkpoint.common import REPO, child_env
from .launch import free_port, rank_env

TIMEOUT = 5.0  # seconds, the mesh groups' timeout in these worlds
SLACK = 30.0   # the bound: detected within the timeout plus this
CASES = {  # case -> (plan, the group, what rank 0's error must say: a regular expression), in the order run
    "tp": ("tp1d", "tp", r"rank 0: all_reduce over group 'tp' \(ranks 0,1\)"),
    "zero3": ("dp=2,zero=3", "dp", r"rank 0: all_gather \(ZeRO-3 parameters\) over group 'dp' \(ranks 0,1\)"),
    "pp": ("pp2", "pp", r"pipeline stage\(s\) \[0\] on rank 0 failed: (send|recv) of \d+ tensors? (to|from) "
                        r"rank 1 over group 'pp' \(ranks 0,1\)"),
    "ddp": ("dp2", "dp", r"rank 0: all_reduce \(DDP gradient bucket\) over group 'dp' \(ranks 0,1\)"),
}


def child(rank: int) -> None:
    """One rank of the world (run in its own process, with torchrun's environment): every case in turn."""
    import torch
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import comm, init_distributed, timeouts
    from cuboid.parallel.optim import AdamW

    from .test_data_parallel import global_batch

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)  # the world: generous, for start-up and between cases
    comm.set_timeout(TIMEOUT)        # the mesh's groups (and the pipeline's p2p waits)
    kept = []  # every case's model stays alive: no teardown of a broken group before the end
    for i, (case, (plan, group, _)) in enumerate(CASES.items()):
        last = i == len(CASES) - 1
        model = cuboid.load("gpt-debug", plan, seed=0).train()
        assert timeouts._group_timeout(model.parallel.mesh.group(group)) == TIMEOUT  # made with cuboid's timeout
        opt = AdamW(model.parameters(), lr=1e-3)
        batch = global_batch("gpt", model)
        kept.append((model, opt))
        for _ in range(2):  # DDP rebuilds its buckets in the second forward (a broadcast): past that here
            cuboid.train_step(model, opt, batch)
        if rank == 1:
            time.sleep(TIMEOUT + 1)  # the stall (rank 0 waits for it); in the last case the parent kills it first
            dist.barrier()
            comm.forget_groups()  # this case's groups are broken (rank 0 gave up on them): the next makes its own
            continue
        share = cuboid.rank_share(model, batch)
        print(f"ENTER {case} {time.time():.3f}", flush=True)
        try:
            if case == "ddp":  # forward without collectives; the backward's bucket all-reduce waits
                model(**share).loss.backward()
            elif case == "pp":
                cuboid.train_step(model, opt, batch)
            else:  # tp, zero3: the forward's first collective waits
                model(**share)
        except Exception as e:
            print(f"RAISED {case} {time.time():.3f} {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            if last:
                raise  # unhandled, as in a training script: the process must end non-zero
        else:
            print(f"NO ERROR {case}", flush=True)
        dist.barrier()
        comm.forget_groups()


def _run_world() -> dict:
    """Start the two ranks, wait for rank 0 to exit (bounded), kill rank 1; rank 0's output and exit time."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.test_hang"], cwd=str(REPO),
                              env={**child_env(), **rank_env(r, 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        stdout, stderr = procs[0].communicate(timeout=180)
        return dict(rc=procs[0].returncode, stdout=stdout, stderr=stderr, exited=time.time())
    except subprocess.TimeoutExpired:
        procs[0].kill()
        stdout, stderr = procs[0].communicate()
        return dict(rc=None, stdout=stdout, stderr=stderr, exited=None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def _stamp(stdout: str, tag: str, case: str):
    m = re.search(rf"^{tag} {case} (\d+\.\d+)(.*)$", stdout, re.M)
    return (float(m.group(1)), m.group(2)) if m else (None, "")


def test_a_stalled_peer_ends_in_collective_timeout_naming_rank_group_and_op():
    r = _run_world()
    out = f"rank 0's output:\n{r['stdout']}{r['stderr'][-3000:]}"
    assert r["rc"] is not None, f"rank 0 did not exit within the test's deadline; {out}"
    report = {}
    for case, (_, _, expected) in CASES.items():
        (enter, _), (raised, message) = _stamp(r["stdout"], "ENTER", case), _stamp(r["stdout"], "RAISED", case)
        assert enter is not None and raised is not None, f"{case}: rank 0 did not fail in the stalled op; {out}"
        message = message.strip()
        if case == "ddp":  # DDP re-raises its comm hook's error as a RuntimeError that quotes it
            message = message.split("error when running the callback: ", 1)[-1]
        assert message.startswith("CollectiveTimeout: "), f"{case}: {message}"
        expected += rf" timed out after {TIMEOUT:g} s: a peer stalled or died"
        assert re.search(expected, message), f"{case}: {message}"
        detect = raised - enter
        assert TIMEOUT - 0.5 <= detect <= TIMEOUT + SLACK, f"{case}: detected after {detect:.1f} s"
        report[case] = round(detect, 1)
    assert r["rc"] != 0, f"rank 0 exited with 0 after the unhandled error; {out}"
    assert "CollectiveTimeout" in r["stderr"], out
    exit_after = r["exited"] - enter  # from entering the last case's op
    assert exit_after <= TIMEOUT + SLACK, f"rank 0 exited {exit_after:.1f} s after entering the stalled op"
    print(f"time to detect a hang, s: {report}; rank 0 exited {exit_after:.1f} s after entering the last op")


def test_failures_are_classified_in_one_sentence():
    """Without a world (one process): the conversion alone, on gloo's own messages."""
    from cuboid.parallel import comm

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    with pytest.raises(comm.CollectiveTimeout, match=r"^rank 0: broadcast over group 'world' timed out after "
                                                     r"[\d.]+ s: a peer stalled or died$") as info:
        with comm.guarded("broadcast", None):
            raise RuntimeError(gloo)
    assert str(info.value.__cause__) == gloo  # torch's own message stays on the chain
    closed = comm.as_collective_error("all_gather", None, RuntimeError("[pair.cc:553] Connection closed by peer"))
    assert type(closed) is comm.CollectiveError and str(closed).endswith("failed: a peer closed its connection "
                                                                         "(it died or gave up)")
    other = comm.as_collective_error("all_to_all", None, RuntimeError("Tensors must be contiguous\nmore"))
    assert str(other) == "rank 0: all_to_all over group 'world' failed: Tensors must be contiguous"
    assert comm.as_collective_error("send/recv", None, RuntimeError("a shape bug"), known=False) is None
    with pytest.raises(ValueError, match="positive number of seconds"):
        comm.set_timeout(0)


if __name__ == "__main__":  # a rank of one case's world (see _run_world)
    import os

    child(int(os.environ["RANK"]))


def _one_rank_dies(code: int):
    """Rank 1 leaves without a word (as a killed or crashed process does); rank 0 waits far past the test."""
    import os

    if int(os.environ["RANK"]) == 1:
        os._exit(code)
    time.sleep(600)


def test_the_launcher_names_a_rank_that_exits_without_a_result():
    """tests/parallel/launch.py: a rank gone silent ends the world with its rank and exit code, not at the
    timeout (which would say only "timed out")."""
    from .launch import run_world

    with pytest.raises(AssertionError, match=r"rank 1 failed:\nrank 1's process exited with code 3 before it "
                                             r"returned or raised"):
        run_world(_one_rank_dies, 2, 3, timeout=300)
