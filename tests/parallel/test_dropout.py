"""Dropout under tensor parallelism: masks follow the activation layout (one 4-rank world).

- 1D (tp1d-4, dp2-tp2, and tp1d-4 with activation checkpointing): every
  dropout acts on a replicated activation, so every tp rank must drop the
  same elements; with the same seed they are exactly the elements one device
  drops, so loss, logits and gradients in train mode equal one device's
  (with checkpointing, the recomputed block must draw the same masks, or the
  gradients differ).
- 2D (tp2d): each rank holds a distinct block, so masks must differ between
  ranks (independent draws), drop about p of the elements, and training with
  dropout 0.1 must go like one device's (loss falls by a similar amount).
"""
import torch

from .launch import run_world
from .test_data_parallel import global_batch

P = 0.1


def _masks(model):
    """Capture, per Dropout layer, which elements its last forward dropped."""
    from cuboid.parallel.layers import Dropout

    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Dropout):
            mod.register_forward_hook(lambda m, i, o, n=name: seen.__setitem__(n, (o == 0) & (i[0] != 0)))
    return seen


def dropout_worker():
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Plan, comm
    from cuboid.parallel.optim import AdamW

    report = {}
    for plan in (Plan(tp=4), Plan(dp=2, tp=2), Plan(tp=4, checkpoint="full")):
        for name in ("gpt-debug", "bert-debug", "vit-debug"):
            ref = cuboid.load(name, seed=0, dropout=P).train()
            model = cuboid.load(name, plan, seed=0, dropout=P).train()
            masks = _masks(model)
            share = cuboid.rank_share(model, global_batch(name, ref))
            torch.manual_seed(11)
            r = ref(**share)
            r.loss.backward()
            torch.manual_seed(11)
            out = model(**share)
            out.loss.backward()
            loss_err = abs(out.loss.item() - r.loss.item()) / r.loss.item()
            logit_err = ((out.logits - r.logits).abs().max() / r.logits.abs().max()).item()
            refs = dict(ref.named_parameters())
            grad_err = 0.0
            if plan.dp == 1:  # with dp the gradients are averaged over different shares
                from cuboid import zoo

                for full, mod, local, p in zoo.common.sharded_parameters(model):
                    g, rg = mod.full_tensor_like(local, p.grad), refs[full].grad
                    grad_err = max(grad_err, ((g - rg).abs().max() / rg.abs().max().clamp(min=1e-12)).item())
            # the tp replicas of every dropped activation dropped the same elements
            differ = 0
            for key in sorted(masks):
                got = comm.all_gather_list(masks[key].to(torch.uint8).contiguous(), model.parallel.mesh.group("tp"))
                differ += sum(int(not torch.equal(got[0], m)) for m in got[1:])
            report[f"{plan.describe()}/{name}"] = dict(loss=loss_err, logits=logit_err, grad=grad_err,
                                                     differ=differ, layers=len(masks))
    # 2D: independent masks per block, about p dropped, and training goes like one device
    for name in ("gpt-debug", "vit-debug"):
        ref = cuboid.load(name, seed=0, dropout=P).train()
        model = cuboid.load(name, "tp2d", seed=0, dropout=P).train()
        masks = _masks(model)
        batch = global_batch(name, ref)
        curves = []
        for m in (ref, model):
            opt = AdamW(m.parameters(), lr=3e-3)
            torch.manual_seed(5)
            curves.append([cuboid.train_step(m, opt, batch).loss for _ in range(12)])
        key = sorted(masks)[-1]
        mine = masks[key].to(torch.uint8).contiguous()
        got = comm.all_gather_list(mine, model.parallel.mesh.group("tp"))
        same = sum(int(torch.equal(got[0], m)) for m in got[1:])
        report[f"tp2d/{name}"] = dict(curves=curves, same=same, frac=mine.float().mean().item())
    dist.barrier()
    return report


def test_dropout_masks_follow_the_layout():
    reports = run_world(dropout_worker, 4, timeout=400)
    for rank, report in enumerate(reports):
        for key, r in report.items():
            if key.startswith("tp2d/"):
                (single, sharded) = r["curves"]
                assert r["same"] == 0, (rank, key, "blocks drew the same mask", r)
                assert 0.05 < r["frac"] < 0.15, (rank, key, r["frac"])
                drop_one, drop_tp = single[0] - single[-1], sharded[0] - sharded[-1]
                assert drop_one > 0.2 and drop_tp > 0.2, (rank, key, single, sharded)
                assert abs(sharded[-1] - single[-1]) < 0.15 * single[-1], (rank, key, single, sharded)
                continue
            assert r["layers"] > 0, (rank, key)
            assert r["differ"] == 0, (rank, key, "tp replicas dropped different elements", r)
            assert r["loss"] < 1e-5 and r["logits"] < 1e-5 and r["grad"] < 1e-4, (rank, key, r)
