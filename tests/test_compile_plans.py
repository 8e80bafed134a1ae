"""The plan's ``compile`` field under dp=2, ZeRO-3, 1D tensor parallelism and pp=2: blocks compiled, one device's steps.

One 2-rank gloo world loads each plan with GPT-2 or Llama (debug sizes; each family meets two plans) with
``compile=true``, checks that every block it holds runs compiled (:func:`cuboid.parallel.compile.compiled_blocks`), takes two ``cuboid.train_step`` steps with
SGD and compares the losses and the parameters with one device's eager run (rel_norm of tests/parallel/test_plans,
which drops the largest 0.1% of differences). Blocks compile with ``aot_eager`` here (Dynamo and AOTAutograd trace
as under inductor; inductor's C++ code generation takes minutes on two CPU cores).
"""
from __future__ import annotations

import pytest
import torch

from tests.parallel.launch import run_world
from tests.parallel.test_plans import global_batch, rel_norm

CASES = (("dp=2", "gpt-debug"), ("dp=2,zero=3", "llama-debug"), ("tp=2", "llama-debug"),
         ("pp=2,microbatches=2", "gpt-debug"))
STEPS = 2


def _reference(name: str) -> dict:
    import cuboid

    model = cuboid.load(name, seed=0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [cuboid.train_step(model, opt, global_batch(name, model)).loss for _ in range(STEPS)]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _run_compiled(spec: str, name: str, want: dict) -> dict:
    """Plan ``spec`` with compile=true on family ``name``: which blocks compiled, the Dynamo graphs and breaks,
    and the worst relative differences from one device's run ``want``."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Plan
    from cuboid.parallel import compile as pc
    from cuboid.parallel.spec import blocks_of
    from cuboid.parallel.state import state_of

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = cuboid.load(name, Plan.parse(spec).replace(compile=True), seed=0).train()
    compiled = pc.compiled_blocks(model, blocks_of(state_of(model).spec))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [cuboid.train_step(model, opt, global_batch(name, model)).loss for _ in range(STEPS)]
    pairs = [(full, mod.full_tensor(local)) for full, mod, local, _ in zoo.common.sharded_parameters(model)]
    got = torch.cat([t.flatten() for _, t in pairs])
    ref = torch.cat([want["params"][n].flatten() for n, _ in pairs])
    return {"compiled": compiled,
            "graphs": counters["stats"]["unique_graphs"],  # Dynamo graphs made (0: nothing ran compiled)
            "breaks": sum(counters["graph_break"].values()),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want["losses"])),
            "params": rel_norm(got, ref)}


def compile_plans_worker(cases) -> dict:
    import cuboid.kernels as kernels
    from cuboid.parallel import compile as pc

    pc.BACKEND = "aot_eager"
    report, refs = {}, {}
    with kernels.use_backend("torch"):
        for spec, name in cases:
            if name not in refs:
                refs[name] = _reference(name)
            report[f"{spec}/{name}"] = _run_compiled(spec, name, refs[name])
    return report


def test_compile_plans_match_one_device():
    reports = run_world(compile_plans_worker, 2, CASES, timeout=600.0)
    for rank, report in enumerate(reports):
        assert set(report) == {f"{p}/{f}" for p, f in CASES}
        for key, errs in report.items():
            assert errs["compiled"] and all(errs["compiled"]), f"rank {rank} {key}: blocks not compiled {errs}"
            assert errs["graphs"] > 0, f"rank {rank} {key}: no compiled graph ran {errs}"
            assert errs["breaks"] == 0, f"rank {rank} {key}: graph breaks inside the compiled blocks {errs}"
            assert errs["loss"] < 1e-5, f"rank {rank} {key}: {errs}"
            assert errs["params"] < 1e-6, f"rank {rank} {key}: {errs}"
