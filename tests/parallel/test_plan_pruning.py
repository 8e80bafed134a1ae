"""``cuboid plans`` prices only what can change what it shows (issue 52: ``--model deepseek-v3 --gpus 256``
enumerates 13,802 plans): the floors it skips plans by (:mod:`cuboid.parallel.cost.bound`) never pass what a
full pricing says of any plan, and the pruned ranking is the exhaustive one on a mixture of experts small
enough to price every plan of (deepseek-v3-debug on 4 ranks; the file about 50 s at a load of 25 on 2 cores)."""
from __future__ import annotations

import json
import re

import pytest

BATCH, SEQ = 16, 64


@pytest.mark.parametrize("name,half", [("deepseek-v3-debug", False), ("deepseek-v3-debug", True),
                                       ("qwen3-moe-debug", False), ("gpt-debug", False)])
def test_floors_never_pass_the_priced_figures(name, half):
    """Every plan of 4 ranks, plain, selectively and fully checkpointed, with fp32 weights under autocast or
    (``half``) bf16 weights with fp32 masters: the memory floor (states, weight copies, DDP's buckets, the
    pipeline's buffers, the optimizer step) is at most the priced peak, the step floor at most the priced
    step, and a plan whose memory floor passes a device fits on none."""
    import torch

    from cuboid.loading.planner import _Shards, candidate_plans, estimate
    from cuboid.parallel import Mesh, Plan, cost
    from cuboid.parallel.cost.bound import ModelCounts, memory_floor, step_floor
    from cuboid.zoo import spec_of

    hw = cost.load_hardware("h100")
    shards = _Shards(name, torch.bfloat16 if half else None)
    whole = shards.build(Plan(), Mesh.layout(Plan(), 0))
    counts = ModelCounts.of(whole, spec_of(whole))
    assert len(counts.blocks) == len(counts.shapes) == whole.config.n_layers
    sparse = bool(getattr(whole.config, "n_experts", 0))
    assert (counts.experts[0] > 0) == sparse
    dtype = next(whole.parameters()).dtype
    plans = candidate_plans(whole.config, 4, BATCH, dtype="bf16")
    assert any(p.pp > 1 for p in plans) and any(p.zero == 3 for p in plans) and any(p.ep > 1 for p in plans) == sparse
    tight = []
    for plan in plans:
        for p in (plan, plan.replace(checkpoint="selective"), plan.replace(checkpoint="full")):
            e = estimate(shards.build, p, hw, BATCH, SEQ, shards=shards)
            need = memory_floor(counts, whole.config, p, BATCH, SEQ, cost.layout_of(p, dtype))
            least = step_floor(whole.config, p, hw, BATCH, SEQ, dtype, counts)
            assert 0 < need <= e.memory * (1 + 1e-9), (p.describe(), need, e.memory)
            assert 0 < least <= e.step_s * (1 + 1e-9), (p.describe(), least, e.step_s)
            tight.append(least / e.step_s)
    assert max(tight) > 0.5  # the floor says something: within a factor 2 of some priced step


def test_pruned_ranking_is_the_exhaustive_one(capsys):
    """With a device that some plans' states or activations cannot fit and a short table, the plans shown,
    their order and figures are those of pricing every plan, and one line says how many were not priced."""
    from cuboid.cli import main

    args = ["plans", "--model", "deepseek-v3-debug", "--gpus", "4", "--batch", str(BATCH), "--seq", str(SEQ),
            "--gpu-memory", "4MB", "--headroom", "0", "--top", "24"]
    assert main(args) == 0
    pruned = capsys.readouterr().out
    assert main(args + ["--exhaustive"]) == 0
    full = capsys.readouterr().out
    assert main(args + ["--json"]) == 0  # --json prices every plan
    rows = json.loads(capsys.readouterr().out)
    fits = [r for r in rows if r["fits"]]
    assert 24 < len(fits) < len(rows)  # more fit than the table shows, and some do not

    def table(out):
        return [line for line in out.splitlines() if re.match(r"\d+ +\S+=", line)]

    assert len(table(pruned)) == 24 and table(pruned) == table(full)
    assert [line.split()[1] for line in table(full)] == [r["plan"] for r in fits[:24]]
    line = next(line for line in pruned.splitlines() if line.startswith("not priced: "))
    assert "step-time floor" in line and "--exhaustive" in line and "not priced" not in full
