"""Plan parity for DeepSeek-V3 (multi-head latent attention, group-limited sigmoid routing with a non-zero
correction bias, a shared expert, a dense first layer): deepseek-v3-debug on 2 ranks under dp x ep with ZeRO-3,
tp=2 (1D: q_b and kv_b cut by heads, the latent projections whole), all-to-all sp x ep and pp=2, through
:func:`test_plans.plan_parity_worker` (the public path against one device's run); in the same world, the
routers' bias update after a dp=2 x ep=2 step equals one device's on the global batch."""
from .launch import run_world
from .test_plans import check, plan_parity_worker

DEEPSEEK = ("deepseek-v3-debug",)
PLANS = ["dp=2,ep=2,zero=3", "tp=2", "sp=2,sp_mode=all_to_all,ep=2", "pp=2,microbatches=2"]
RATE = 0.01


def bias_update(plan):
    """Each router's correction bias after one SGD step and :func:`update_routing_bias` under ``plan`` on a fixed
    global batch (8 rows of 16 tokens), and the loads it used, gathered whole."""
    import torch

    import cuboid
    from cuboid.zoo.deepseek.moe import routers, update_routing_bias

    ids = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(7))
    model = cuboid.load("deepseek-v3-debug", plan, seed=0).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = cuboid.rank_share(model, {"input_ids": ids, "labels": ids})
    model(**batch).loss.backward()
    opt.step()
    before = [r.full_tensor("bias").clone() for r in routers(model)]
    update_routing_bias(model, RATE)
    return before, [r.full_tensor("bias") for r in routers(model)]


def deepseek_worker(world: int, plans=None):
    from cuboid.parallel import Plan

    from . import test_plans

    # the family runs on every plan here (the generated test's families_of does not list it)
    test_plans.families_of = lambda index, per_plan=None: DEEPSEEK
    report = plan_parity_worker(plans or PLANS, rotate=True, families=DEEPSEEK)
    return report, bias_update(Plan()), bias_update(Plan(dp=2, ep=2))


def test_deepseek_v3_plans_on_2_ranks():
    """dp x ep with ZeRO-3, tp1d, all-to-all sp x ep and pp=2: one device's losses, outputs and parameters; the
    bias update of a dp=2 x ep=2 step (the loads summed over the ranks) is one device's, and it moved."""
    import torch

    results = run_world(deepseek_worker, 2, 2, timeout=900)
    check([r[0] for r in results])
    assert {k.split("/")[0] for k in results[0][0]} == set(PLANS)
    for _, (before, one), (start, planned) in results:
        assert all(torch.equal(a, b) for a, b in zip(before, start))
        assert all(torch.equal(a, b) for a, b in zip(one, planned))
        assert all((a - b).abs().max() == RATE for a, b in zip(one, before))  # every router moved
