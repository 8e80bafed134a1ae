"""ZeRO composed with sequence parallelism, with Megatron's tp_sequence, and with fp16 loss scaling: one
4-rank world, through the public path.

- Plan parity (test_plans' worker and checks: loss, outputs over 2 or 3 steps at 1e-5, parameters with the
  trimmed norm, here at 1e-6) of dp2 x sp2 with ZeRO 1, 2 and 3 for ring and all-to-all attention
  (ZeRO shards over the dp x sp group ``dpsp``), ZeRO-3 with recomputed blocks, and of
  dp2 x tp2 with ``tp_sequence`` and ZeRO 1, 2 and 3, for GPT, BERT and ViT.
- Bytes sent and held under sp x ZeRO equal the cost model's, and show the states cut dp * sp ways:
  ZeRO's reduce-scatter and all-gather run over ``dpsp``, nothing over ``dp`` alone.
- fp16 autocast with ``torch.amp.GradScaler("cpu")`` under ZeRO 1/2/3 (and dp2 x sp2 x ZeRO-2) against
  one device running the same scaler: the tolerance is four times the fp16 noise floor, measured in the
  same world as the distance between two single-device runs that differ only in splitting the batch
  into two micro-batches (fp16 autocast rounds each matmul's output to 11 bits, so any change of
  summation order moves results by ~1e-4..1e-3; a systematic error, such as gradients left scaled or
  unscaled twice, moves them by orders of magnitude more).
- A step whose gradients overflow is skipped on every rank: with a huge scale (every rank overflows),
  and with one inf element injected into one rank's gradient, which after ZeRO's reduce-scatter only
  its owner sees (the other ranks' local flags are clean): parameters and optimizer state stay
  unchanged on every rank and the scale is halved; the next clean step moves the parameters.
"""
import torch

from .launch import run_world
from .test_data_parallel import global_batch
from .test_plans import FAMILIES, check, gathered, plan_parity_worker, rel_norm

SP_ZERO = ["dp=2,sp=2,zero=1", "dp=2,sp=2,sp_mode=all_to_all,zero=1",
           "dp=2,sp=2,zero=2", "dp=2,sp=2,sp_mode=all_to_all,zero=2",
           "dp=2,sp=2,zero=3", "dp=2,sp=2,sp_mode=all_to_all,zero=3"]
SP_ZERO_LAMB = ["dp=2,sp=2,zero=1", "dp=2,sp=2,sp_mode=all_to_all,zero=2", "dp=2,sp=2,zero=3"]
SP_ZERO_CKPT = ["dp=2,sp=2,zero=3,activation_checkpoint=true"]
TP_SEQ_ZERO = ["dp=2,tp=2,tp_sequence=true,zero=1", "dp=2,tp=2,tp_sequence=true,zero=2",
               "dp=2,tp=2,tp_sequence=true,zero=3"]
COST_PLANS = ["dp=2,sp=2", "dp=2,sp=2,zero=1", "dp=2,sp=2,sp_mode=all_to_all,zero=2", "dp=2,sp=2,zero=3"]
FP16_PLANS = ["dp=4,zero=1,dtype=fp16", "dp=4,zero=2,dtype=fp16", "dp=4,zero=3,dtype=fp16",
              "dp=2,sp=2,zero=2,dtype=fp16"]
FP16_TOL = 1e-3  # about two fp16 units of roundoff (2^-11): autocast rounds every matmul's output to fp16
FP16_STEPS = 3


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)  # the scale grows in the test


def _flat(pairs):
    return torch.cat([t.detach().float().flatten() for _, t in pairs])


def _fp16_floor(name):
    """The fp16 noise floor: one device, the same batches, one micro-batch against two (loss, params)."""
    import cuboid
    from cuboid.parallel.optim import AdamW

    runs = []
    for parts in (1, 2):
        ref = cuboid.load(name, seed=0).train()
        opt, scaler = AdamW(ref.parameters(), lr=1e-2, eps=1e-3), _scaler()
        steps = [cuboid.train_step(ref, opt, global_batch(name, ref), microbatches=parts, max_grad_norm=1.0,
                                   dtype="fp16", scaler=scaler) for _ in range(FP16_STEPS)]
        runs.append((steps, dict(ref.named_parameters())))
    (s1, p1), (s2, p2) = runs
    loss = max(abs(a.loss - b.loss) / abs(a.loss) for a, b in zip(s1, s2))
    norm = max(abs(a.grad_norm - b.grad_norm) / abs(a.grad_norm) for a, b in zip(s1, s2))
    params = rel_norm(torch.cat([p2[k].detach().flatten() for k in p1]), torch.cat([p1[k].detach().flatten() for k in p1]))
    return {"loss": loss, "grad_norm": norm, "params": params}


def _fp16_parity(plan_text, name):
    """train_step with a GradScaler under ``plan_text`` (dtype fp16) against one device with its own scaler,
    and against the same plan without ZeRO (whose scaler path needs no pieces)."""
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.optim import AdamW

    plan = Plan.parse(plan_text)
    plain = plan.replace(zero=0)
    ref = cuboid.load(name, seed=0).train()
    model = cuboid.load(name, plan, seed=0, mesh=Mesh.build(plan)).train()
    model0 = cuboid.load(name, plain, seed=0, mesh=Mesh.build(plain)).train()
    opts = [AdamW(m.parameters(), lr=1e-2, eps=1e-3) for m in (ref, model, model0)]
    scalers = [_scaler() for _ in range(3)]
    err = {"loss": 0.0, "grad_norm": 0.0}
    err0 = dict(err)
    scales = []
    for _ in range(FP16_STEPS):
        batch = global_batch(name, ref)
        a, b, c = (cuboid.train_step(m, o, batch, max_grad_norm=1.0, dtype="fp16", scaler=s)
                   for m, o, s in zip((ref, model, model0), opts, scalers))
        for what in err:  # grad_norm: of the unscaled gradients (clipping and Adam would hide scaled ones)
            err[what] = max(err[what], abs(getattr(a, what) - getattr(b, what)) / abs(getattr(a, what)))
            err0[what] = max(err0[what], abs(getattr(c, what) - getattr(b, what)) / abs(getattr(c, what)))
        scales.append(tuple(s.get_scale() for s in scalers))
    refs = dict(ref.named_parameters())
    pairs = gathered(model)
    err["params"] = rel_norm(_flat(pairs), torch.cat([refs[n].detach().flatten() for n, _ in pairs]))
    err0["params"] = rel_norm(_flat(pairs), _flat(gathered(model0)))
    init = dict(cuboid.load(name, seed=0).named_parameters())
    moved = rel_norm(_flat(pairs), torch.cat([init[n].detach().flatten() for n, _ in pairs]))
    return {"single": err, "plain": err0, "scales": scales, "moved": moved}


def _qkv(model):
    """The first block's packed q/k/v linear of a zoo model (GPT: attn.qkv)."""
    mods = dict(model.named_modules())
    return next(m for n, m in mods.items() if n.startswith("blocks.0.") and n.endswith("qkv"))


def _skipped(plan_text):
    """Overflowing steps are skipped on every rank; what each rank's own inf check saw before the sync."""
    import cuboid
    import cuboid.train.step as step_mod
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.optim import AdamW

    plan = Plan.parse(plan_text)
    mesh = Mesh.build(plan)
    model = cuboid.load("gpt-debug", plan, seed=0, mesh=mesh).train()
    opt = AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    batch = global_batch("gpt", model)
    local_flags = []
    plain_sync = step_mod.sync_found_inf

    def recording_sync(scaler, optimizer, mesh):  # this rank's flags before they are made to agree
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local_flags.append(float(sum(f.item() for f in found.values())))
        plain_sync(scaler, optimizer, mesh)

    step_mod.sync_found_inf = recording_sync
    out = {}
    try:
        before = _flat(gathered(model))
        huge = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # fp16 gradients overflow on every rank
        r = cuboid.train_step(model, opt, batch, max_grad_norm=1.0, scaler=huge)
        out["huge"] = {"unchanged": bool(torch.equal(_flat(gathered(model)), before)), "state": len(opt.state),
                       "scale": huge.get_scale(), "local": local_flags[-1], "loss_finite": bool(r.loss == r.loss)}

        qkv = _qkv(model)
        fired = []

        def inject(grad):  # one element of rank 0's gradient: after the reduce-scatter only its owner sees it
            if fired:  # the hook stays on the tensor: fire once
                return grad
            grad = grad.clone()
            grad.view(-1)[grad.numel() // 2 + 1] = float("inf")
            fired.append(1)
            return grad

        def arm(mod, args):
            if mesh.rank == 0 and not fired:
                mod.weight.register_hook(inject)  # the weight the forward uses (ZeRO-3: FSDP2's unsharded one)

        handle = qkv.register_forward_pre_hook(arm)
        scaler = _scaler()
        cuboid.train_step(model, opt, batch, max_grad_norm=1.0, scaler=scaler)
        handle.remove()
        out["inject"] = {"unchanged": bool(torch.equal(_flat(gathered(model)), before)), "state": len(opt.state),
                         "scale": scaler.get_scale(), "local": local_flags[-1], "fired": len(fired)}
        cuboid.train_step(model, opt, batch, max_grad_norm=1.0, scaler=scaler)
        out["next"] = {"moved": rel_norm(_flat(gathered(model)), before), "scale": scaler.get_scale(),
                       "local": local_flags[-1]}
    finally:
        step_mod.sync_found_inf = plain_sync
    return out


def compose_worker():
    import time

    import torch.distributed as dist

    from .cost_checks import cost_worker

    times, report = {}, {}
    t = time.perf_counter()
    report["parity"] = plan_parity_worker(SP_ZERO + SP_ZERO_CKPT, ("adamw",))
    report["parity"].update(plan_parity_worker(SP_ZERO_LAMB, ("lamb",)))
    times["sp_zero"] = time.perf_counter() - t
    t = time.perf_counter()
    report["parity"].update(plan_parity_worker(TP_SEQ_ZERO, ("adamw",)))
    times["tp_sequence_zero"] = time.perf_counter() - t
    t = time.perf_counter()
    report["cost"] = cost_worker(COST_PLANS)
    times["cost"] = time.perf_counter() - t
    t = time.perf_counter()
    report["floor"] = {n: _fp16_floor(n) for n in ("gpt-debug", "vit-debug")}
    report["fp16"] = {f"{p}/{n}": _fp16_parity(p, n) for p in FP16_PLANS for n in ("gpt-debug", "vit-debug")}
    times["fp16"] = time.perf_counter() - t
    t = time.perf_counter()
    report["skip"] = {p: _skipped(p) for p in FP16_PLANS}
    times["skip"] = time.perf_counter() - t
    report["times"] = times
    dist.barrier()
    return report


def test_zero_with_sequence_parallelism_tp_sequence_and_fp16_scaling_on_4_ranks():
    from .cost_checks import check_cost

    reports = run_world(compose_worker, 4, timeout=900)
    check([r["parity"] for r in reports])
    check_cost([r["cost"] for r in reports])
    n_parity = (len(SP_ZERO) + len(SP_ZERO_CKPT) + len(SP_ZERO_LAMB) + len(TP_SEQ_ZERO)) * len(FAMILIES)
    for rank, r in enumerate(reports):
        assert len(r["parity"]) == n_parity, (rank, sorted(r["parity"]))
        for key, errs in r["parity"].items():
            assert errs["params"] < 1e-6, (rank, key, errs)
        # ZeRO under sp shards over dp x sp: its collectives run over dpsp, nothing more over dp alone than
        # train_step's two scalars, and each rank holds a quarter of the optimizer state plain dp2 x sp2
        # holds (padding aside)
        cost = r["cost"]
        plain_dp = cost["dp=2,sp=2"]["sent"][0]["dp"]
        for plan in COST_PLANS[1:]:
            measured, _ = cost[plan]["sent"]
            assert measured["dpsp"] > 0 and measured["dp"] == plain_dp == 16, (rank, plan, measured)
            ratio = cost[plan]["states"]["optimizer"][0] / cost["dp=2,sp=2"]["states"]["optimizer"][0]
            assert abs(ratio - 0.25) < 0.01, (rank, plan, ratio)  # (ZeRO-3: the last ranks hold fewer rows)
        for key, v in r["fp16"].items():
            floor = r["floor"][key.split("/")[1]]
            for what in ("loss", "grad_norm", "params"):
                assert floor[what] < FP16_TOL / 4, (rank, key, "the fp16 floor is not below the tolerance", floor)
                assert v["single"][what] < FP16_TOL, (rank, key, what, v, floor)
                assert v["plain"][what] < FP16_TOL / 10, (rank, key, what, "ZeRO moved the fp16 run", v)
            assert all(len(set(s)) == 1 for s in v["scales"]), (rank, key, v["scales"])
            assert v["scales"][-1][0] > 2.0 ** 10, (rank, key, "the scale never grew", v["scales"])
            assert v["moved"] > 100 * FP16_TOL, (rank, key, v)
        for plan, v in r["skip"].items():
            for what in ("huge", "inject"):
                assert v[what]["unchanged"] and v[what]["state"] == 0, (rank, plan, what, v)
            assert v["huge"]["scale"] == 2.0 ** 39 and v["huge"]["local"] > 0, (rank, plan, v)
            assert v["inject"]["scale"] == 2.0 ** 9, (rank, plan, v)
            assert v["inject"]["fired"] == (1 if rank == 0 else 0), (rank, plan, v)
            assert v["next"]["moved"] > 1e-4 and v["next"]["local"] == 0, (rank, plan, v)
    for plan in FP16_PLANS:  # exactly one rank (the owner of the injected element) saw the inf itself
        assert sum(r["skip"][plan]["inject"]["local"] > 0 for r in reports) == 1, (
            plan, [r["skip"][plan]["inject"] for r in reports])
    print("times (s) on rank 0:", {k: round(v, 1) for k, v in reports[0]["times"].items()})
