"""Child processes of the checkpoint tests: `python _child.py MODE ARGS...`.

crash PATH STAGE SEED      save a seed-SEED model to PATH, SIGKILL itself at STAGE
                           ("begin", "file#N" = after the N-th file, "written",
                           "moved-old", "committed"); exit 3 if STAGE never came
resume PATH OUT            fresh process: load PATH + training state, train 3 steps,
                           write the parameters to OUT (safetensors)
dp RANK WORLD PORT DIR     data-parallel save/load on gloo over 127.0.0.1
tp RANK WORLD PORT DIR     the same with 1D tensor parallelism (packed qkv, padded vocab)
"""
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import save_file

import cuboid
from cuboid.kernels import use_backend
from cuboid.zoo import checkpoint
from cuboid.zoo.checkpoint import folder as folder_mod
from tests.checkpoint.common import assert_same, make_training, params, train


def crash(path, stage, seed):
    count = {"files": 0}

    def hook(s):
        if s.startswith("file:"):
            count["files"] += 1
            s = f"file#{count['files']}"
        if s == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    folder_mod.hook = hook
    model = cuboid.load("gpt-debug", seed=int(seed))
    checkpoint.save(model, path, max_shard_size="100KB", state={"step": int(seed)})
    sys.exit(3)


def resume(path, out):
    model, opt, sched = make_training(seed=99)  # a different init: everything must come from the checkpoint
    checkpoint.load(model, path)
    info = checkpoint.load_training_state(path, model, opt, sched)
    assert info["rng_restored"] and info["state"]["data"] == {"epoch": 0, "index": 3}, info
    train(model, opt, sched, info["state"]["step"], 3)
    save_file(params(model), out)


def dp(rank, world, port, out):
    import torch.distributed as dist

    rank, world, out = int(rank), int(world), Path(out)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    log = out / f"hook-rank{rank}.log"
    folder_mod.hook = lambda s: log.open("a").write(s + "\n")
    model = cuboid.load("gpt-debug", seed=0)  # a full replica on every rank
    checkpoint.save(model, out / "dp", max_shard_size="100KB")
    fresh = cuboid.load("gpt-debug", seed=3)
    checkpoint.load(fresh, out / "dp")
    assert_same(params(fresh), params(model))

    # training state: every rank's own RNG comes back
    model, opt, sched = make_training(seed=0)
    torch.manual_seed(0)
    ids = torch.arange(32).reshape(2, 16)
    model(ids, labels=ids).loss.backward()
    opt.step()
    torch.manual_seed(100 + rank)
    checkpoint.save(model, out / "dp-train", optimizer=opt, scheduler=sched, state={"step": 1})
    after_save = torch.rand(4)
    info = checkpoint.load_training_state(out / "dp-train", model, opt, sched)
    assert info["rng_restored"] and torch.equal(torch.rand(4), after_save)
    dist.barrier()
    dist.destroy_process_group()
    (out / f"ok-rank{rank}").write_text("ok")


def tp_model_and_optimizer(shard=None):
    """gpt-debug (vocab 509: padded on tp=2) after one AdamW step with grad = p / 2, optionally tp-sharded."""
    from cuboid.parallel.optim import AdamW

    model = cuboid.load("gpt-debug", seed=0, vocab_size=509)
    if shard is not None:
        model = shard(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = p.detach() / 2
    opt.step()
    return model, opt


def tp(rank, world, port, out):
    import torch.distributed as dist
    from cuboid import zoo
    from cuboid.parallel.optim import AdamW
    from cuboid.parallel.tensor import shard_1d
    from cuboid.zoo.common import sharded_parameters

    rank, world, out = int(rank), int(world), Path(out)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)))
    shard = lambda m: shard_1d(m, zoo.SPECS["gpt"], group)  # noqa: E731
    model, opt = tp_model_and_optimizer(shard)
    assert model.blocks[0].attn.qkv.weight.shape[0] == 3 * 64 // world  # really sharded
    checkpoint.save(model, out / "tp", max_shard_size="100KB", optimizer=opt, state={"step": 1})
    # load into a fresh sharded model and optimizer: every full tensor comes back
    fresh = shard(cuboid.load("gpt-debug", seed=3, vocab_size=509))
    opt2 = AdamW(fresh.parameters(), lr=5.0)
    checkpoint.load(fresh, out / "tp")
    checkpoint.load_training_state(out / "tp", fresh, opt2)
    for (name, mod, local, p), (_, mod2, _, q) in zip(sharded_parameters(model), sharded_parameters(fresh)):
        assert torch.equal(mod.full_tensor(local), mod2.full_tensor(local)), name
        assert torch.equal(p, q), name  # including the zero pad rows
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], opt2.state[q][key]
            assert torch.equal(a, b), (name, key)  # this rank's part of the state, pad rows included
    dist.barrier()
    dist.destroy_process_group()
    (out / f"ok-rank{rank}").write_text("ok")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    with use_backend("torch"):
        {"crash": crash, "resume": resume, "dp": dp, "tp": tp}[mode](*args)
