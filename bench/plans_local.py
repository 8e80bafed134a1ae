"""Predicted against measured step time on this machine (the ``local`` profile), per plan.

    python bench/plans_local.py                 # calibrate, time 17 plans on 1-4 gloo ranks, print, bench/plans_local.json
    python bench/plans_local.py --steps 5

Calibrates the ``local`` profile in-process (``cuboid.loading.calibrate``: a
reference GPT's training step, an AdamW step, a gloo all-reduce probe),
then times ``cuboid.train_step`` of a different GPT (``TIMED`` in
``tests/parallel/cost_checks.py``: dim 256, 4 layers, batch 8 x 128) under
each plan, the slowest rank's median step, beside
:func:`cuboid.loading.planner.estimate`'s prediction. The test
(``tests/parallel/test_cost.py``) asserts five of these within 30%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PLANS = {1: ["single"], 2: ["dp2", "dp2-ckpt", "pp=2,microbatches=2,activation_checkpoint=true", "tp1d", "pp2",
                            "pp=2,microbatches=8", "sp2", "sp2-a2a"], 4: ["dp=4,activation_checkpoint=true", "dp=4,zero=2,activation_checkpoint=true", "dp4", "zero2",
                                    "dp2-tp2", "tp1d-4", "tp2d", "pp4"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=str(HERE / "plans_local.json"))
    args = ap.parse_args()
    import torch

    from cuboid import zoo
    from cuboid.loading.calibrate import calibrate
    from cuboid.cli.tables import table
    from cuboid.parallel import Plan
    from cuboid.loading.planner import estimate
    from tests.parallel.cost_checks import TIMED, TIMED_BATCH, TIMED_SEQ, time_worker
    from tests.parallel.launch import run_world

    t0 = time.time()
    hw, _ = calibrate(progress=True, save=False)
    config = zoo.config_of("gpt-debug", **TIMED)
    rows, out = [], []
    for world, plans in PLANS.items():
        if world == 1:
            torch.set_num_threads(1)
            measured = [time_worker(plans, args.steps)]
        else:
            measured = run_world(time_worker, world, plans, args.steps, timeout=900)
        for name in plans:
            took = max(r[name] for r in measured)
            e = estimate(config, Plan.parse(name, zoo.READY_PLANS), hw, TIMED_BATCH, TIMED_SEQ)
            rows.append((name, str(world), f"{took:.3f}", f"{e.step_s:.3f}", f"{e.step_s / took - 1:+.0%}",
                         f"{e.compute_s:.3f}", f"{e.comm_s:.3f}", f"{e.bubble_s + e.optimizer_s:.3f}"))
            out.append({"plan": name, "ranks": world, "measured_s": took, "predicted_s": e.step_s,
                        "compute_s": e.compute_s, "comm_s": e.comm_s, "bubble_s": e.bubble_s,
                        "optimizer_s": e.optimizer_s})
    print(table(rows, ("plan", "ranks", "measured s", "predicted s", "off", "compute", "comm", "bubble+optim")))
    by_measured = [r["plan"] for r in sorted(out, key=lambda r: r["measured_s"])]
    by_predicted = [r["plan"] for r in sorted(out, key=lambda r: r["predicted_s"])]
    print(f"\nfastest by measurement: {by_measured[:3]}; by prediction: {by_predicted[:3]}")
    profile = {"fp32_flops": hw.flops["fp32"], "memory_bytes_per_s": hw.memory_bytes_per_s,
               "alpha_s": hw.intra.alpha_s, "link_bytes_per_s": hw.intra.bytes_per_s, "cores": hw.cores}
    Path(args.json).write_text(json.dumps({"profile": profile, "rows": out, "seconds": time.time() - t0}, indent=1))
    print(f"profile: {profile}\nwrote {args.json} after {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
