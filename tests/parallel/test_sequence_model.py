"""Sequence parallelism at the model level, in one 2-rank world: the bytes a training step sends over
``sp`` equal :func:`cuboid.parallel.sequence_split.bytes_per_step` for ring and all-to-all, with and
without activation checkpointing, for GPT (causal, masked) and BERT (a pooler: the first token comes from
sp rank 0); bf16 parameters with fp32 masters under sp2 against one device's bf16 run. (Plan parity of
every ready sp plan is in test_plans.py.)"""
import pytest

from .launch import run_world
from .test_data_parallel import global_batch
from .test_zero import _bf16_parity


def _step_bytes(plan_text, name):
    import cuboid
    from cuboid.parallel import Mesh, Plan, comm
    from cuboid.parallel.optim import AdamW
    from cuboid.parallel.sequence_split import bytes_per_step
    from cuboid.zoo import READY_PLANS

    plan = Plan.parse(plan_text, READY_PLANS)
    model = cuboid.load(name, plan, seed=0, mesh=Mesh.build(plan)).train()
    opt = AdamW(model.parameters(), lr=1e-3)
    batch = global_batch(name, model)
    c = model.config
    with comm.count() as tally:
        cuboid.train_step(model, opt, batch)
    want = bytes_per_step(n_layers=c.n_layers, heads=c.n_heads, head_dim=c.dim // c.n_heads,
                          batch=batch["input_ids"].shape[0], seq=batch["input_ids"].shape[1], sp=plan.sp,
                          mode=plan.sp_mode, masked=True, dim=c.dim, first_token=1 if name.startswith("bert") else 0,
                          recompute=plan.checkpoint != "none")
    got = {op: tally.bytes(op, "sp") for op in tally.per_op()}
    return {"got": {k: v for k, v in got.items() if v}, "want": want}


def sequence_worker():
    out = {}
    for plan in ("sp2", "sp2-a2a", "sp=2,activation_checkpoint=true", "sp=2,sp_mode=all_to_all,activation_checkpoint=true"):
        for name in ("gpt-debug", "bert-debug"):
            out[f"{plan}/{name}"] = _step_bytes(plan, name)
    out["bf16"] = {n: _bf16_parity(n, "sp2") for n in ("gpt-debug", "vit-debug")}
    return out


def test_sequence_parallel_bytes_and_bf16_on_2_ranks():
    for rank, r in enumerate(run_world(sequence_worker, 2, timeout=400)):
        for key, v in r["bf16"].items():
            assert v["loss"] < 2e-2 and v["params"] < 2e-2, (rank, key, v)
            assert v["master_dtypes"] == {"torch.float32"}, (rank, key, v)
        for key, v in r.items():
            if key == "bf16":
                continue
            assert set(v["got"]) == set(v["want"]), (rank, key, v)
            for op, want in v["want"].items():
                assert v["got"][op] == pytest.approx(want, rel=1e-9), (rank, key, op, v)
