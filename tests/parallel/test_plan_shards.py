"""The planner reads a rank's parameters off one model per tensor and expert split (``_Shards.params``) rather
than building every pipeline stage's model: the same parameters (names, order, shapes, dtypes, ties) and the
same estimates, plan after plan on one shared set of models, as building each stage's (``cuttable`` answering
False, as it does for a folder or another builder)."""
from __future__ import annotations

import pytest


def _described(params: dict) -> list:
    return [(n, type(p).__name__, tuple(p.shape), p.dtype, p.requires_grad, p.is_meta) for n, p in params.items()]


@pytest.mark.parametrize("name,world,half", [("deepseek-v3-debug", 8, True), ("llama-debug", 8, False),
                                             ("gpt-debug", 4, False)])
def test_reused_shards_price_as_built_ones(name, world, half, monkeypatch):
    """Every plan of ``world`` ranks (pipelines of every schedule, expert splits, 2D/2.5D/3D grids; gpt-debug's
    tied embedding on both ends; ``half``: bf16 weights), and one with the plan's own ``stage_blocks``: each
    rank's parameters and each estimate equal those of the models built per stage."""
    import torch

    from cuboid.loading.planner import _Shards, candidate_plans, default_seq, estimate
    from cuboid.parallel import Plan, cost

    hw = cost.load_hardware("h100")
    dtype = torch.bfloat16 if half else None
    reused, built = _Shards(name, dtype), _Shards(name, dtype)
    monkeypatch.setattr(built, "cuttable", lambda: False)  # every rank's parameters from its own stage's model
    config = reused.build.config
    batch, seq = 4 * world, default_seq(config)
    plans = candidate_plans(config, world, batch, dtype="bf16")
    assert reused.cuttable() and not built.cuttable()
    assert {p.schedule for p in plans if p.pp > 1} == {"gpipe", "1f1b", "interleaved", "zbv"}
    if config.n_layers >= 2:
        plans.append(Plan(pp=2, dp=world // 2, microbatches=2, stage_blocks=(config.n_layers - 1, 1), dtype="bf16"))
    for plan in plans:
        assert reused.layout(plan)[2] == built.layout(plan)[2], plan.describe()
        for rank in range(plan.world_size):
            assert _described(reused.params(plan, rank)) == _described(built.params(plan, rank)), (plan, rank)
        fast = estimate(reused.build, plan, hw, batch, seq, shards=reused)
        slow = estimate(built.build, plan, hw, batch, seq, shards=built)
        assert fast.to_dict() == slow.to_dict(), plan.describe()
    assert len(reused.wholes) < len(built.cache)
