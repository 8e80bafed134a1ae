"""Plan parity through the public path: every ready plan, every zoo family, as a user would write it.

Inside one world per size, each ready plan's model is loaded with
``cuboid.load(name, plan)`` next to the single-device model of the same seed
(built in the same process), optimizers are built the plain way
(``Opt(model.parameters(), ...)``, no reducer), and three steps are taken on
a fixed global batch, alternating the two public ways to train:

- the natural loop: ``share = cuboid.rank_share(model, batch)``,
  ``model(**share).loss.backward()``, ``clip_grad_norm_``, ``opt.step()``
  (on a batch whose dp shares hold equal label counts, as the contract asks);
- ``cuboid.train_step(model, opt, batch, max_grad_norm=1.0)`` (on a batch
  whose shares hold different label counts).

Checked: initial parameters equal one device's exactly; every step's loss,
the logits, hidden states and pooled output of a share (single-device
shapes and values, logits read lazily) and of an odd-sized eval batch (the
2D/3D batch split pads it), and every parameter after the steps (gathered).
Tolerance 1e-5 relative. Parameters are compared with one norm over all of
them, dropping the largest 0.1% of element differences: with Adam-type
steps a few elements whose exact gradient is zero move by rounding noise on
any plan (a systematic error, such as an unreduced LAMB trust ratio, moves
every element and is caught). AdamW and LAMB run with eps=1e-3 for the same
reason (see test_data_parallel.py).
"""
import torch

from .launch import run_world
from .test_data_parallel import global_batch

STEPS = 3
FAMILIES = ("gpt-debug", "bert-debug", "vit-debug")


def even_batch(name, model, size=8):
    """A global batch whose dp shares (2 or 4 of them) hold equal label counts."""
    batch = global_batch(name, model, size)
    if "labels" in batch and batch["labels"].dim() == 2:
        pads = torch.arange(size) % 2 * 3  # rows alternate 0 and 3 padded positions
        cols = torch.arange(batch["input_ids"].shape[1])
        mask = (cols.unsqueeze(0) < batch["input_ids"].shape[1] - pads.unsqueeze(1)).long()
        labels = batch["input_ids"].masked_fill(mask == 0, -100)
        if name.startswith("bert"):
            keep = torch.rand(1, labels.shape[1], generator=torch.Generator().manual_seed(3)) < 0.4
            keep[0, 0] = True
            labels = labels.masked_fill(~keep, -100)
        batch.update(attention_mask=mask, labels=labels)
    return batch


def rel_norm(a: torch.Tensor, b: torch.Tensor, drop: float = 0.001) -> float:
    """||a - b|| / ||b|| over flattened tensors, without the largest ``drop`` fraction of |a - b|."""
    d = (a.double() - b.double()).abs().flatten()
    keep = d.numel() - int(d.numel() * drop)
    d = d.sort().values[:keep]
    return (d.norm() / b.double().norm().clamp(min=1e-30)).item()


def rel_max(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def gathered(model):
    """(full name, full tensor) of every parameter of a (sharded) zoo model; a collective."""
    from cuboid import zoo

    return [(full, mod.full_tensor(local)) for full, mod, local, _ in zoo.common.sharded_parameters(model)]


def params_err(model, ref) -> float:
    refs = dict(ref.named_parameters())
    pairs = gathered(model)
    a = torch.cat([t.flatten() for _, t in pairs])
    b = torch.cat([refs[n].detach().flatten() for n, _ in pairs])
    return rel_norm(a, b)


def outputs_err(out, ref_out, rows=None) -> float:
    """Largest relative error of logits / hidden states / pooled output; shapes must match one device's."""
    err = 0.0
    for field in ("logits", "last_hidden_state", "pooler_output"):
        a, b = getattr(out, field), getattr(ref_out, field)
        if b is None:
            assert a is None, field
            continue
        b = b if rows is None else b[rows]
        assert tuple(a.shape) == tuple(b.shape), (field, tuple(a.shape), tuple(b.shape))
        err = max(err, rel_max(a.detach(), b.detach()))
    return err


def make_optimizer(kind, params):
    from cuboid.parallel.optim import LAMB, LARS, AdamW

    if kind == "adamw":
        return AdamW(params, lr=1e-2, eps=1e-3)
    if kind == "lamb":
        return LAMB(params, lr=1e-2, eps=1e-3, weight_decay=0.01)
    return LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-3)


def plan_parity_worker(plans, optimizers=("adamw", "lamb", "lars")):
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, Plan, comm
    from cuboid.parallel.optim import clip_grad_norm_
    from cuboid.zoo import READY_PLANS

    report = {}
    for plan_name in plans:
        plan = Plan.parse(plan_name, READY_PLANS)
        mesh = Mesh.build(plan)
        dp = mesh.size("dp")
        for name in FAMILIES:
            extra = {"vocab_size": 510} if name != "vit-debug" else {}  # 510 does not divide tp=4: padding
            for kind in optimizers:
                ref = cuboid.load(name, seed=0, **extra).train()
                model = cuboid.load(name, plan, seed=0, mesh=mesh, **extra).train()
                assert model.plan == plan and model.mesh is mesh
                init_err = params_err(model, ref)
                opt_ref, opt = make_optimizer(kind, ref.parameters()), make_optimizer(kind, model.parameters())
                errs = {"init": init_err, "loss": 0.0, "outputs": 0.0}
                for step in range(STEPS):
                    if step % 2 == 0:  # the natural loop
                        batch = even_batch(name, ref)
                        share = cuboid.rank_share(model, batch)
                        rows = slice(mesh.coords["dp"] * len(share["labels"]), None)
                        rows = slice(rows.start, rows.start + len(share["labels"]))
                        out, ref_out = model(**share), ref(**batch)
                        out.loss.backward()
                        ref_out.loss.backward()
                        loss = out.loss.detach().clone().reshape(1)
                        comm.all_reduce_(loss, mesh.group("dp"))
                        errs["loss"] = max(errs["loss"], abs(loss.item() / dp - ref_out.loss.item())
                                           / abs(ref_out.loss.item()))
                        if step == 0:
                            errs["outputs"] = max(errs["outputs"], outputs_err(out, ref_out, rows))
                        clip_grad_norm_(model.parameters(), 1.0)
                        clip_grad_norm_(ref.parameters(), 1.0)
                        for o in (opt, opt_ref):
                            o.step()
                            o.zero_grad()
                    else:
                        batch = global_batch(name, ref)
                        a = cuboid.train_step(ref, opt_ref, batch, max_grad_norm=1.0)
                        b = cuboid.train_step(model, opt, batch, max_grad_norm=1.0)
                        errs["loss"] = max(errs["loss"], abs(a.loss - b.loss) / abs(a.loss))
                errs["params"] = params_err(model, ref)
                # an odd-sized batch, the same on every rank, without grad: logits as one device
                odd = {k: v[:5] for k, v in global_batch(name, ref).items()}
                model.eval(), ref.eval()
                with torch.no_grad():
                    out, ref_out = model(**odd), ref(**odd)
                    errs["eval_outputs"] = outputs_err(out, ref_out)
                    errs["eval_loss"] = abs(out.loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item())
                report[f"{plan_name}/{name}/{kind}"] = errs
        dist.barrier()
    return report


def check(reports):
    assert reports
    for rank, report in enumerate(reports):
        assert report
        for key, errs in report.items():
            assert errs["init"] == 0.0, (rank, key, "initialisation differs", errs)
            for what in ("loss", "outputs", "params", "eval_outputs", "eval_loss"):
                assert errs[what] < 1e-5, (rank, key, what, errs)


SP2 = ["sp2", "sp2-a2a", "sp=2,activation_checkpoint=true", "tp2-seq"]  # ring, all-to-all, recomputed ring, Megatron
SP4 = ["sp4", "sp2-tp2", "dp2-sp2"]


def two_rank_worker():
    report = plan_parity_worker(["dp2", "dp2-ckpt", "tp1d"])
    report.update(plan_parity_worker(SP2, ("adamw", "lamb")))  # sequences of 12 split in 4 zigzag chunks
    return report


def four_rank_worker():
    report = plan_parity_worker(["dp4", "tp1d-4", "dp2-tp2", "tp2d"])
    report.update(plan_parity_worker(SP4, ("adamw", "lamb")))  # sp4: 12 tokens padded to 16 inside
    return report


def test_dp_tp1d_and_sequence_parallel_on_2_ranks():
    reports = run_world(two_rank_worker, 2, timeout=600)
    check(reports)
    assert len(reports[0]) == 3 * 3 * 3 + len(SP2) * 3 * 2


def test_dp_tp_2d_and_sequence_parallel_on_4_ranks():
    reports = run_world(four_rank_worker, 4, timeout=900)
    check(reports)
    assert len(reports[0]) == 4 * 3 * 3 + len(SP4) * 3 * 2


EIGHT_RANK_COST = ["tp2.5d", "tp=8,tp_mode=3d,activation_checkpoint=true"]  # the cost model, in this world


def eight_rank_worker():
    from .cost_checks import cost_worker

    report = plan_parity_worker(["tp2.5d", "tp3d"])
    # ZeRO over the dp group of a 2D grid: each dp rank's pieces of its grid blocks
    report.update(plan_parity_worker(["dp=2,tp=4,tp_mode=2d,zero=2", "dp=2,tp=4,tp_mode=2d,zero=3"],
                                     ("adamw", "lamb")))
    return report, cost_worker(EIGHT_RANK_COST)


def test_tp2p5d_tp3d_and_zero_over_2d_on_8_ranks():
    """Plan parity, and (test_cost's check, run here to share the world) bytes sent and held under 2.5D and
    3D equal the cost model's."""
    from .cost_checks import check_cost

    results = run_world(eight_rank_worker, 8, timeout=1200)
    reports = [r for r, _ in results]
    check(reports)
    assert len(reports[0]) == 2 * 3 * 3 + 2 * 3 * 2
    check_cost([c for _, c in results])
    assert all(len(c) == len(EIGHT_RANK_COST) for _, c in results)
