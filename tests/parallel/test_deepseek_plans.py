"""Plan parity for DeepSeek-V3 (multi-head latent attention, group-limited sigmoid routing with a non-zero
correction bias, a shared expert, a dense first layer): deepseek-v3-debug on 2 ranks under dp x ep with ZeRO-3,
tp=2 (1D: q_b and kv_b cut by heads, the latent projections whole), all-to-all sp x ep and pp=2, through
:func:`test_plans.plan_parity_worker` (the public path against one device's run); in the same world, the
routers' bias update after a dp=2 x ep=2 step and a pp=2 step equals one device's on the global batch, and the
cost model's bytes equal a counted step's (tests/parallel/cost_checks.py) under tp, dp x ep, sp and pp."""
from .launch import run_world
from .cost_checks import check_cost
from .test_plans import check, plan_parity_worker

DEEPSEEK = ("deepseek-v3-debug",)
PLANS = ["dp=2,ep=2,zero=3", "tp=2", "sp=2,sp_mode=all_to_all,ep=2", "pp=2,microbatches=2"]
RATE = 0.01
BIAS_PLANS = ("dp=2,ep=2", "pp=2,microbatches=2")
# the cost model's bytes against a counted step (MLA's sp exchanges, no router statistics, the shared expert's tp)
COST_PLANS = ["tp=2", "dp=2,ep=2", "sp=2", "pp=2,microbatches=2"]


def bias_update(plan):
    """Each router's correction bias (by module name; under pp this stage's) before and after one
    ``cuboid.train_step`` (SGD) and :func:`update_routing_bias` under ``plan`` on a fixed global batch of 8 rows."""
    import torch

    import cuboid
    from cuboid.zoo.deepseek.moe import GroupRouter, update_routing_bias

    ids = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(7))
    model = cuboid.load("deepseek-v3-debug", plan, seed=0).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    cuboid.train_step(model, opt, {"input_ids": ids, "labels": ids})
    found = {n: m for n, m in model.named_modules() if isinstance(m, GroupRouter)}
    before = {n: r.full_tensor("bias").clone() for n, r in found.items()}
    update_routing_bias(model, RATE)
    return before, {n: r.full_tensor("bias") for n, r in found.items()}


def deepseek_worker(world: int, plans=None):
    from cuboid.parallel import Plan

    from .cost_checks import cost_worker

    report = plan_parity_worker(plans or PLANS, rotate=True, families=DEEPSEEK)
    biases = bias_update(Plan()), {p: bias_update(Plan.parse(p)) for p in BIAS_PLANS}
    return report, *biases, cost_worker(COST_PLANS, "deepseek-v3-debug", {})


def test_deepseek_v3_plans_on_2_ranks():
    """dp x ep with ZeRO-3, tp1d, all-to-all sp x ep and pp=2: one device's losses, outputs and parameters; the
    bias update after a dp=2 x ep=2 step (the loads summed over the ranks) and after a pp=2 step (two micro-batches,
    each stage its routers) is one device's, and it moved; the cost model's bytes are a counted step's."""
    import torch

    results = run_world(deepseek_worker, 2, 2, timeout=900)
    check([r[0] for r in results])
    check_cost([r[3] for r in results])
    assert {k.split("/")[0] for k in results[0][0]} == set(PLANS)
    for _, (before, one), planned, _ in results:
        assert set(planned) == set(BIAS_PLANS)
        for start, after in planned.values():  # this rank's routers (a pipeline stage holds some)
            assert start and all(torch.equal(start[n], before[n]) for n in start)
            assert all(torch.equal(after[n], one[n]) for n in after)
        assert all((one[n] - before[n]).abs().max() == RATE for n in one)  # every router moved
