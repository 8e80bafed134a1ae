"""Plan parity for the ready tensor-parallel plans (1D, 2D, 2.5D, 3D, dp x tp), on every zoo family.

Inside one world per size: each plan's model is built with ``cuboid.load(name,
plan)`` (meta -> shard -> materialise its own slices) and trained 3 steps on a
fixed global batch next to the single-device model of the same seed, built in
the same process. Loss per step and every parameter afterwards (gathered with
``full_tensor``) agree within 1e-5 relative (fp32). AdamW runs with eps=1e-3
(see test_data_parallel.py); LAMB on one plan checks the trust-ratio norms are
reduced across shards.
"""
import torch

from .launch import run_world
from .test_data_parallel import global_batch, rel

STEPS = 3


def plan_parity_worker(plans):
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan, input_splitter, norm_reducer, parallelize
    from cuboid.parallel.optim import LAMB, AdamW
    from cuboid.step import rank_share, train_step

    report = {}
    for plan_name, optimizers in plans:
        plan = Plan.parse(plan_name, zoo.READY_PLANS)
        mesh = Mesh.build(plan)
        for name in ("gpt-debug", "bert-debug", "vit-debug"):
            for opt_name in optimizers:
                make = (lambda ps, r=None: AdamW(ps, lr=1e-2, eps=1e-3)) if opt_name == "adamw" else \
                    (lambda ps, r=None: LAMB(ps, lr=1e-2, eps=1e-3, weight_decay=0.01, norm_reducer=r))
                # vocab 510 does not divide tp=4: exercises the padding
                extra = {"vocab_size": 510} if name != "vit-debug" else {}
                ref = cuboid.load(name, seed=0, **extra).train()
                model = cuboid.load(name, plan, seed=0, mesh=mesh, **extra).train()
                init_err = max(rel(mod.full_tensor(local), dict(ref.named_parameters())[full])
                               for full, mod, local, _ in zoo.common.sharded_parameters(model))
                reducer = norm_reducer(model, mesh)
                splitter = input_splitter(plan, mesh)
                train = parallelize(model, plan, mesh, zoo.spec_of(model))
                opt_ref, opt = make(ref.parameters()), make(model.parameters(), reducer)
                batch = global_batch(name, ref)
                loss_err = 0.0
                for _ in range(STEPS):
                    a = train_step(ref, opt_ref, [batch], None, max_grad_norm=1.0)
                    b = train_step(train, opt, [rank_share(batch, mesh)], mesh, max_grad_norm=1.0,
                                   norm_reducer=reducer, split_inputs=splitter)
                    loss_err = max(loss_err, abs(a.loss - b.loss) / abs(a.loss))
                refs = dict(ref.named_parameters())
                param_err = max(rel(mod.full_tensor(local), refs[full])
                                for full, mod, local, _ in zoo.common.sharded_parameters(model))
                # the reducer turns per-shard squared norms into the whole tensors' (what LAMB and clipping see)
                norm_err = 0.0
                if reducer is not None:
                    params = [p for _, _, _, p in zoo.common.sharded_parameters(model)]
                    for p in params:
                        p.grad = p.detach().clone()
                    local_sq = torch.stack([p.detach().float().pow(2).sum() for p in params]).reshape(1, -1)
                    reduced = reducer.for_params(params)(local_sq)
                    whole = torch.stack([
                                         mod.full_tensor(local).float().pow(2).sum()
                                         for f, mod, local, _ in zoo.common.sharded_parameters(model)])
                    norm_err = ((reduced.reshape(-1) - whole).abs() / whole.clamp(min=1e-12)).max().item()
                report[f"{plan_name}/{name}/{opt_name}"] = (init_err, loss_err, param_err, norm_err)
    return report


def check(reports):
    assert reports
    for rank, report in enumerate(reports):
        assert report
        for key, (init_err, loss_err, param_err, norm_err) in report.items():
            assert init_err == 0.0, (rank, key, "initialisation differs", init_err)
            assert loss_err < 1e-5, (rank, key, loss_err)
            # LAMB divides by ||u|| per tensor: on a bias that started at zero that ratio
            # amplifies fp32 rounding to ~1e-5 (measured); a missing cross-shard norm
            # reduction gives errors of 1e-1 there, and norm_err catches it directly
            assert param_err < (3e-5 if key.endswith("lamb") else 1e-5), (rank, key, param_err)
            assert norm_err < 1e-5, (rank, key, "sharded norms not reduced", norm_err)


def test_tp1d_on_2_ranks():
    check(run_world(plan_parity_worker, 2, [("tp1d", ("adamw", "lamb"))], timeout=300))


def test_tp1d_4_dp2_tp2_and_tp2d_on_4_ranks():
    check(run_world(plan_parity_worker, 4, [("tp1d-4", ("adamw",)), ("dp2-tp2", ("adamw",)),
                                            ("tp2d", ("adamw", "lamb"))], timeout=400))


def test_tp2p5d_and_tp3d_on_8_ranks():
    check(run_world(plan_parity_worker, 8, [("tp2.5d", ("adamw", "lamb")), ("tp3d", ("adamw", "lamb"))],
                    timeout=600))
