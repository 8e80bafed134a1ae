"""Nothing hangs (issue 49): an evaluation with a dp rank a batch short (or with no row) under ZeRO-3 and
under experts, and a checkpoint saved under dp x ep x pp, each in one bounded gloo world per size, through
the per-plan checks of :mod:`reliability_checks` (which the plan worlds call too)."""
from __future__ import annotations

import os

import torch

from .launch import run_world

# (model, plan) of each size's world; both collectives went wrong before: ZeRO-3 and the experts' all-to-all
# met a forward one rank did not run; a pp stage's replica skipped the ep all_gather of an expert tensor
# each with the checks it runs: the uneven eval hung under ZeRO-3 and under experts, the save under dp x ep x pp
WORLDS = {2: [("gpt-debug", "dp=2,zero=3", ("eval",)), ("qwen3-moe-debug", "dp=2,ep=2", ("eval",))],
          4: [("qwen3-moe-debug", "dp=2,ep=2,pp=2,microbatches=2", ("eval", "save"))]}
TIMEOUT_S = 60  # each collective's bound (CUBOID_TIMEOUT_S): a hang is a CollectiveTimeout naming the op


def rows(name: str, n: int = 6, seq: int = 16) -> dict:
    from cuboid import zoo

    vocab = zoo.config_of(name).vocab_size
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def worker(world: int, folder: str) -> dict:
    os.environ["CUBOID_TIMEOUT_S"] = str(TIMEOUT_S)
    import cuboid

    from .reliability_checks import save_and_reload_check, uneven_eval_check

    report = {}
    for name, plan, checks in WORLDS[world]:
        model = cuboid.load(name, plan, seed=0)
        errs = uneven_eval_check(model, rows(name)) if "eval" in checks else {}
        if "save" in checks:
            errs.update(save_and_reload_check(model, os.path.join(folder, "ckpt")))
        report[f"{plan}/{name}"] = errs
    return report


def check(reports: list, world: int) -> None:
    assert len(reports) == world
    for rank, report in enumerate(reports):
        assert set(report) == {f"{plan}/{name}" for name, plan, _ in WORLDS[world]}
        for name, plan, checks in WORLDS[world]:
            errs = report[f"{plan}/{name}"]
            assert ("save_reload" in errs) == ("save" in checks), (rank, plan, errs)
            assert errs["uneven_eval"] < 1e-5, (rank, plan, errs)
            assert errs.get("save_reload", 0.0) == 0.0, (rank, plan, errs)


def test_uneven_eval_under_zero3_and_experts_on_2_ranks(tmp_path):
    check(run_world(worker, 2, 2, str(tmp_path), timeout=300), 2)


def test_uneven_eval_and_save_under_dp_ep_pp_on_4_ranks(tmp_path):
    check(run_world(worker, 4, 4, str(tmp_path), timeout=400), 4)
