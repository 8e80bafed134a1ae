"""The drop-in contract's other promises, in one 8-rank world.

- Training never gathers whole logits: the bytes a training step sends
  (``comm.count``) under 1D (dp2 x tp4), 2D (dp2 x tp4) and 3D (tp8) have no
  term in batch x vocabulary. Measured at two vocabularies and two batch
  sizes, the growth with the vocabulary (weights and the vocab-parallel
  loss's per-row statistics) is the same at both batch sizes.
- An fp16 grad scaler's inf check is agreed by every rank: an inf in one
  tensor-parallel shard's gradient makes every rank skip the step.
"""
import torch

from .launch import run_world


def _step_bytes(plan, vocab, batch_size):
    import cuboid
    from cuboid.parallel import comm
    from cuboid.parallel.optim import AdamW

    model = cuboid.load("gpt-debug", plan, seed=0, vocab_size=vocab).train()
    opt = AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    cuboid.train_step(model, opt, batch)  # warm-up (lazy DDP init)
    with comm.count() as tally:
        cuboid.train_step(model, opt, batch)
    return tally.total


def _scaler_skips_together(plan):
    import cuboid
    from cuboid.parallel.optim import AdamW

    model = cuboid.load("gpt-debug", plan, seed=0).train()
    opt = AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ids = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    if torch.distributed.get_rank() == 0:  # (tp: a shard of rank 0's rows; pp: a layer of the first stage only)
        model.blocks[0].mlp.fc.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = [p.detach().clone() for p in model.parameters()]
    cuboid.train_step(model, opt, batch, scaler=scaler)
    moved = sum(int(not torch.equal(a, p.detach())) for a, p in zip(before, model.parameters()))
    return moved, scaler.get_scale()


def contract_worker():
    from cuboid.parallel import Plan

    report = {}
    for label, plan in (("tp1d", Plan(dp=2, tp=4)), ("tp2d", Plan(dp=2, tp=4, tp_mode="2d")),
                        ("tp3d", Plan(tp=8, tp_mode="3d"))):
        b = {(v, n): _step_bytes(plan, v, n) for v in (512, 1024) for n in (8, 16)}
        report[label] = b
    report["scaler"] = _scaler_skips_together(Plan(dp=2, tp=4))
    return report


def test_contract_on_8_ranks():
    reports = run_world(contract_worker, 8, timeout=400)
    for rank, report in enumerate(reports):
        moved, scale = report["scaler"]
        assert moved == 0, (rank, "a rank stepped while another shard overflowed", moved)
        assert scale == 512.0, (rank, "the scale was not backed off on every rank", scale)
        for label in ("tp1d", "tp2d", "tp3d"):
            b = report[label]
            grow_small, grow_big = b[(1024, 8)] - b[(512, 8)], b[(1024, 16)] - b[(512, 16)]
            # a gathered (B, T, V) would add (p-1)/p * 4 * 8 * 16 * 512 bytes per doubling of B:
            # 0.1 MB and more; what may differ is the loss's O(B T) statistics, not V-dependent
            assert abs(grow_big - grow_small) < 1e-6 * b[(1024, 16)] + 1.0, (rank, label, b)
            assert b[(512, 16)] > b[(512, 8)], (rank, label, "traffic should grow with the batch", b)
