"""Plan parity for data parallelism: dp=2 and dp=4 take the single-process step.

Each world is started once and checks GPT (causal LM with padding, so ranks
hold different numbers of label positions), BERT (masked LM, sparse labels)
and ViT (classification), with and without gradient accumulation, against a
single-device run of the same model, seed and global batch computed inside
every rank. Tolerance: 1e-5 relative (fp32).

AdamW runs with eps=1e-3: Adam divides by sqrt(v), so an entry whose exact
gradient is zero (the key bias, which softmax ignores) gets rounding noise of
~1e-9 that eps=1e-8 turns into a full +-lr step, differently in any two
summation orders. With eps=1e-3 a real gradient difference still moves the
parameters by lr * dg / eps, far above the tolerance, while noise does not.
"""
import copy

import pytest
import torch

from .launch import run_world

STEPS = 3


def global_batch(name, model, size=8):
    g = torch.Generator().manual_seed(7)
    c = model.config
    if name.startswith("vit"):
        return {"pixel_values": torch.randn(size, 3, c.image_size, c.image_size, generator=g),
                "labels": torch.randint(0, c.num_labels, (size,), generator=g)}
    ids = torch.randint(0, c.vocab_size, (size, 12), generator=g)
    mask = torch.ones_like(ids)
    for row in range(size):
        mask[row, 12 - row:] = 0  # row r has r padded positions: uneven label counts per rank
    labels = ids.masked_fill(mask == 0, -100)
    if name.startswith("llama") and c.head == "cls":  # a label per row
        labels = torch.randint(0, c.num_labels, (size,), generator=g)
    if name.startswith("bert"):
        keep = torch.rand(ids.shape, generator=g) < 0.3
        labels = labels.masked_fill(~keep, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def dp_parity_worker():
    import cuboid
    from cuboid.parallel import Mesh, Plan, prepare
    from cuboid.parallel.optim import AdamW
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ["WORLD_SIZE"])
    plan = Plan(dp=world)
    mesh = Mesh.build(plan)
    report = {}
    for name in ("gpt-debug", "bert-debug", "vit-debug"):
        for accumulate in (1, 2):
            ref = cuboid.load(name, seed=0).train()
            model = copy.deepcopy(ref)
            batch = global_batch(name, ref)
            dp_model = prepare(model, plan, mesh)  # a single-device model prepared again for dp
            assert dp_model is model and model.parallel.plan == plan
            opt_ref, opt = (AdamW(m.parameters(), lr=1e-2, eps=1e-3) for m in (ref, model))
            loss_err = 0.0
            for _ in range(STEPS):
                r_ref = cuboid.train_step(ref, opt_ref, batch, max_grad_norm=1.0)
                r_dp = cuboid.train_step(dp_model, opt, batch, microbatches=accumulate, max_grad_norm=1.0)
                assert r_ref.targets == r_dp.targets
                loss_err = max(loss_err, abs(r_dp.loss - r_ref.loss) / abs(r_ref.loss))
            param_err = max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))
            moved = max(rel(p, q) for p, q in zip(model.parameters(), cuboid.load(name, seed=0).parameters()))
            report[f"{name}/acc{accumulate}"] = (loss_err, param_err, moved)
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_process(world):
    reports = run_world(dp_parity_worker, world, timeout=300)
    for rank, report in enumerate(reports):
        for key, (loss_err, param_err, moved) in report.items():
            assert loss_err < 1e-5, (rank, key, loss_err)
            assert param_err < 1e-5, (rank, key, param_err)
            assert moved > 1e-3, (rank, key, "parameters did not change")
