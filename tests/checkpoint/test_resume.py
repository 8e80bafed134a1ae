"""Exact resume: 6 steps straight == 3 steps + save + a fresh process that loads and runs 3 more."""
import json

import torch
from safetensors.torch import load_file

from cuboid.zoo import checkpoint

from .common import make_training, params, seed_all, spawn, train, wait


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    seed_all(7)
    model, opt, sched = make_training()
    train(model, opt, sched, 0, 6)
    straight = params(model)

    seed_all(7)
    model, opt, sched = make_training()
    step = train(model, opt, sched, 0, 3)
    path = checkpoint.save(model, tmp_path / "ckpt", max_shard_size="100KB", optimizer=opt, scheduler=sched,
                           state={"step": step, "data": {"epoch": 0, "index": step}})
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3 and len(state["rng"]) == 1
    assert state["plan"] == {"name": "single", "dp": 1} and state["config"]["dropout"] == 0.1
    checkpoint.verify(path)

    (rc, out), = wait([spawn("resume", path, tmp_path / "resumed.safetensors")])
    assert rc == 0, out
    resumed = load_file(tmp_path / "resumed.safetensors")
    assert resumed.keys() == straight.keys()
    for name, t in straight.items():
        assert torch.equal(resumed[name], t), name
    # and the checkpoint really mattered: without the restored RNG the run differs
    assert not torch.equal(params(model)["blocks.0.mlp.fc.weight"], straight["blocks.0.mlp.fc.weight"])
