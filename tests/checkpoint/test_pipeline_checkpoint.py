"""Checkpoints of pipeline-parallel models (gloo on loopback, one world per size).

8 ranks, ``dp2-pp2-tp2``: GPT (tied token embedding on the first and the last
stage, a vocabulary padded on tp=2) and BERT (tied MLM decoder) are saved
with each stage writing its own files; the folder holds every tensor once,
the same tensors, bit for bit, as a single-device save of the same model (so
the index covers the model and ``total_size`` agrees), and loads bit-exactly
on a single device, under dp2 x tp2d, back under ``dp2-pp2-tp2`` (folder
load and ``checkpoint.load``, each rank reading only its stages), and in
``transformers`` (the same state dict as the single-device save's).

2 ranks, ``pp2`` and ``pp2-zbv`` (both ends on one rank, stages out of
block order): exact resume. Two ``train_step``s, save with the optimizer,
one more step; a fresh model and optimizer of the same plan loaded from the
folder (``checkpoint.load`` + ``load_training_state``) take the same third
step, bit for bit, and through ``cuboid.load(folder, plan)`` within 1e-6
(see the test). The pp optimizer state also resumes on a single device
(state matched by name, not by stage order). A writer failing on one stage
fails the save on every rank and leaves the previous checkpoint; a
checkpoint that does not fit is the usual error on every rank; ``to_hf``
(one file) from stages says to use ``checkpoint.save``.
"""
from pathlib import Path

import torch

from tests.parallel.launch import run_world

FAMILIES = (("gpt-debug", {"vocab_size": 509}), ("bert-debug", {"vocab_size": 509}))  # ViT: no tie, time


def _same(a: dict, b: dict) -> list:
    """Names whose tensors differ (or exist on one side only)."""
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in a.keys() & b.keys() if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    return bad


def _full(model) -> dict:
    """Every present parameter as a full tensor (a collective over each tensor group)."""
    from cuboid.zoo.common import sharded_parameters

    return {name: mod.full_tensor(local).detach().clone() for name, mod, local, _ in sharded_parameters(model)}


def _rel(a: dict, b: dict) -> float:
    """The largest relative difference (max |a - b| / max |b|) over the tensors of ``b``."""
    return max(((a[n] - t).abs().max() / t.abs().max().clamp(min=1e-12)).item() for n, t in b.items())


def _stored(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def _hf_inputs(config):
    return {"input_ids": torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))}


def cross_plan_worker(root):
    import json

    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import READY_PLANS, checkpoint

    root = Path(root)
    plan = Plan.parse("dp2-pp2-tp2", READY_PLANS)
    mesh = Mesh.build(plan)
    tp2d = Plan(dp=2, tp=4, tp_mode="2d")
    mesh2d = Mesh.build(tp2d)
    rank = dist.get_rank()
    report = {}
    for name, extra in FAMILIES:
        folder, single_folder = root / name, root / f"{name}-single"
        ref = cuboid.load(name, seed=3, **extra).eval()
        refs = {n: p.detach() for n, p in ref.named_parameters()}
        saved = cuboid.load(name, plan, seed=3, mesh=mesh, **extra)
        held = len(list(saved.parameters()))
        checkpoint.save(saved, folder, max_shard_size="100KB")
        checkpoint.save(ref, single_folder, max_shard_size="100KB")  # every rank a replica, rank 0 writes
        r = {"held": held, "total": len(refs)}
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        single_index = json.loads((single_folder / "model.safetensors.index.json").read_text())
        r["index"] = (sorted(index["weight_map"]) == sorted(single_index["weight_map"])
                      and index["metadata"]["total_size"] == single_index["metadata"]["total_size"])
        r["files"] = len(set(index["weight_map"].values()))
        r["stored"] = _same(_stored(folder), _stored(single_folder))
        checkpoint.verify(folder)

        one = cuboid.load(folder)  # a folder load on one device
        r["single_folder"] = _same({n: p.detach() for n, p in one.named_parameters()}, refs)
        into = cuboid.load(name, seed=0, **extra)
        checkpoint.load(into, folder)
        r["single_load"] = _same({n: p.detach() for n, p in into.named_parameters()}, refs)

        m2d = cuboid.load(folder, tp2d, mesh=mesh2d)
        r["tp2d"] = _same(_full(m2d), refs)

        back = cuboid.load(folder, plan, mesh=mesh)
        mine = _full(back)
        r["pp_folder"] = _same(mine, {n: refs[n] for n in mine})
        r["pp_names"] = sorted(mine) == sorted(_full(saved))
        into = cuboid.load(name, plan, seed=0, mesh=mesh, **extra)
        r["pp_problems"] = checkpoint.load(into, folder)
        mine = _full(into)
        r["pp_load"] = _same(mine, {n: refs[n] for n in mine})

        if rank == 0:  # transformers
            import transformers

            arch = json.loads((folder / "config.json").read_text())["architectures"][0]
            hf = getattr(transformers, arch).from_pretrained(folder).eval()
            hf_single = getattr(transformers, arch).from_pretrained(single_folder).eval()
            r["hf_state"] = _same(hf.state_dict(), hf_single.state_dict())
            inputs = _hf_inputs(ref.config)
            with torch.no_grad():
                a, b = hf(**inputs).logits, ref(**inputs).logits
            r["hf_logits"] = ((a - b).abs().max() / b.abs().max()).item()
        report[name] = r
        dist.barrier()
    return report


def test_dp2_pp2_tp2_checkpoint_loads_everywhere(tmp_path):
    reports = run_world(cross_plan_worker, 8, str(tmp_path), timeout=300)
    for rank, report in enumerate(reports):
        for name, r in report.items():
            assert 0 < r["held"] < r["total"], (rank, name, r)  # really a stage model
            assert r["index"] and r["files"] >= 2 and r["stored"] == [], (rank, name, r)
            for what in ("single_folder", "single_load", "tp2d", "pp_folder", "pp_load"):
                assert r[what] == [], (rank, name, what, r[what])
            assert r["pp_names"], (rank, name)
            assert r["pp_problems"] == {"missing": [], "unexpected": [], "mismatched": []}, (rank, name, r)
            if "hf_state" in r:
                assert r["hf_state"] == [] and r["hf_logits"] < 1e-5, (rank, name, r)
    assert {"gpt-debug", "bert-debug"} <= set(reports[0]) and "hf_state" in reports[0]["gpt-debug"]


# ---------------------------------------------------------------------------------------- resume


def _batch(model, step):
    from tests.parallel.test_data_parallel import global_batch

    batch = global_batch("gpt", model)
    return {k: v.roll(step, 0) for k, v in batch.items()}  # a different batch each step


def resume_worker(root, plans=("pp2-zbv", "pp2")):
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.optim import AdamW
    from cuboid.zoo import READY_PLANS, checkpoint

    root = Path(root)
    report = {}
    for plan_name in plans:
        plan = Plan.parse(plan_name, READY_PLANS)
        mesh = Mesh.build(plan)
        folder = root / plan_name.replace(",", "_").replace("=", "")
        extra = {"n_layers": 4} if plan_name != "pp2" else {}

        def opt_of(model):
            return AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.01)

        model = cuboid.load("gpt-debug", plan, seed=0, mesh=mesh, **extra).train()
        opt = opt_of(model)
        for step in range(2):
            cuboid.train_step(model, opt, _batch(model, step), max_grad_norm=1.0)
        checkpoint.save(model, folder, optimizer=opt, state={"step": 2}, max_shard_size="100KB")
        straight = cuboid.train_step(model, opt, _batch(model, 2), max_grad_norm=1.0).loss
        after = _full(model)

        r = {}
        for how in ("load", "folder"):
            if how == "load":
                fresh = cuboid.load("gpt-debug", plan, seed=99, mesh=mesh, **extra).train()
                problems = checkpoint.load(fresh, folder)
                assert not any(problems.values()), problems
            else:
                fresh = cuboid.load(folder, plan, mesh=mesh).train()
            opt2 = opt_of(fresh)
            info = checkpoint.load_training_state(folder, fresh, opt2)
            loss = cuboid.train_step(fresh, opt2, _batch(fresh, 2), max_grad_norm=1.0).loss
            mine = _full(fresh)
            r[how] = {"step": info["state"]["step"], "loss": abs(loss - straight) / abs(straight),
                      "differ": _same(mine, after), "params": _rel(mine, after) if mine.keys() == after.keys() else 1}

        # the pp2 checkpoint resumes on one device too: the same third step as the pipeline's
        one = cuboid.load(folder).train()
        opt1 = opt_of(one)
        checkpoint.load_training_state(folder, one, opt1, rng=False)
        loss = cuboid.train_step(one, opt1, _batch(one, 2), max_grad_norm=1.0).loss
        r["single"] = {"loss": abs(loss - straight) / abs(straight),
                       "params": _rel({n: p.detach() for n, p in one.named_parameters()}, after)}
        if plan_name == "pp2":
            r.update(_failures(root, model, opt))
        report[plan_name] = r
        dist.barrier()
    return report


def _failures(root, model, opt) -> dict:
    """A stage's writer fails (rank 1's disk is full): every rank raises, the previous checkpoint stays.
    A 4-block checkpoint into a 2-block pp2 model: the usual clear error, on every rank."""
    import torch.distributed as dist

    from cuboid import zoo
    from cuboid.zoo import checkpoint
    from cuboid.zoo.checkpoint import folder as folder_mod

    def full_disk(stage):
        if stage.startswith("file:"):
            raise OSError("disk full")

    out = {}
    if dist.get_rank() == 1:
        folder_mod.hook = full_disk
    try:
        checkpoint.save(model, root / "pp2", optimizer=opt, max_shard_size="100KB")
        out["failed"] = None
    except (OSError, checkpoint.CheckpointError) as e:
        out["failed"] = str(e)
    finally:
        folder_mod.hook = lambda stage: None
    out["still"] = checkpoint.verify(root / "pp2")["files"] > 0
    dist.barrier()
    out["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    try:
        checkpoint.load(model, root / "pp2-zbv")
        out["mismatch"] = None
    except checkpoint.CheckpointError as e:
        out["mismatch"] = str(e)
    try:  # a single-file HF export needs the whole model on one rank: a clear error, not a partial file
        zoo.to_hf(model, root / "hf")
        out["to_hf"] = None
    except checkpoint.CheckpointError as e:
        out["to_hf"] = str(e)
    return out


def check_resume(reports, plans):
    for rank, report in enumerate(reports):
        assert set(report) == set(plans)
        for plan_name, r in report.items():
            load, folder = r["load"], r["folder"]
            assert load["step"] == 2 and load["loss"] == 0.0 and load["differ"] == [], (rank, plan_name, load)
            # a folder load keeps GPT-2's Conv1D weights as transposed views of the mapped file, so their
            # gradients have transposed strides and the clipping norm sums in another order: last-bit noise
            assert folder["step"] == 2 and folder["loss"] < 1e-6 and folder["params"] < 1e-6, \
                (rank, plan_name, folder)
            assert r["single"]["loss"] < 1e-5 and r["single"]["params"] < 1e-5, (rank, plan_name, r["single"])


def test_pp2_exact_resume(tmp_path):
    reports = run_world(resume_worker, 2, str(tmp_path), timeout=200)
    check_resume(reports, ("pp2", "pp2-zbv"))
    for rank, report in enumerate(reports):
        r = report["pp2"]
        assert (r["failed"] == "disk full") if rank == 1 else ("rank 1 failed to write" in r["failed"]), (rank, r)
        assert r["still"] and r["left"] == [], (rank, r)
        assert "unexpected: transformer.h.2." in r["mismatch"], (rank, r["mismatch"])
        assert "use cuboid.zoo.checkpoint.save" in r["to_hf"], (rank, r["to_hf"])


ZERO_PP = ("dp2-pp2-zero1", "dp=2,pp=2,microbatches=2,zero=2", "dp=2,pp=2,microbatches=2,zero=3")


def test_pp_with_zero_saves_and_resumes_on_4_ranks(tmp_path):
    """ZeRO under pp: every dp rank takes part in assembling whole tensors from pieces (a save where only
    dp rank 0 fetched waited for ever), and the checkpoint resumes exactly, on the plan and on one device."""
    check_resume(run_world(resume_worker, 4, str(tmp_path), ZERO_PP, timeout=400), ZERO_PP)
