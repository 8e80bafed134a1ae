"""The tensor-parallel papers' 64-GPU speedups, predicted by cuboid's cost model beside the reported ones.

    python bench/papers.py            # table on stdout, bench/papers.json
    python bench/papers.py --sweep    # also the predicted speedups over hidden size x batch

For each reported comparison in ``bench/papers_setup.json`` (Optimus 2D
over 1D; 3D over 1D and 2D; Tesseract 2.5D over 1D and 2D), the model,
batch and grids given there are priced by :func:`cuboid.parallel.cost.predict`
(transformer layers only, as the papers time them) on the paper's hardware
profile (``parallel/hardware/*.toml``), and the predicted speedup (baseline
step time over the method's) is set beside the reported one. The setup file
says which facts come from the papers and which are assumed; ``--sweep``
shows how much the answer moves with the assumed model size and batch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def config_of(model: dict):
    from cuboid.zoo.gpt.config import GPTConfig

    return GPTConfig(vocab_size=model["vocab_size"], n_positions=model["seq"], dim=model["dim"],
                     n_layers=model["n_layers"], n_heads=model["n_heads"], mlp_hidden=model["mlp_hidden"])


def step_time(model: dict, plan_fields: dict, hw, batch=None) -> tuple:
    from cuboid.parallel import Plan
    from cuboid.parallel.cost import predict

    config = config_of(model)
    plan = Plan.from_dict(plan_fields).validate(config, 64)
    est = predict(config, plan, {0: {}}, hw, batch or model["batch"], model["seq"], layers_only=True)
    return est.step_s, est


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also sweep hidden size and batch")
    ap.add_argument("--json", default=str(HERE / "papers.json"))
    args = ap.parse_args()
    from cuboid.parallel.cost import load_hardware

    rows, out = [], []
    for case in json.loads((HERE / "papers_setup.json").read_text()):
        hw = load_hardware(case["hardware_profile"].removesuffix(".toml"))
        base, new = case["comparison"].split("/")[::-1]
        t_base, e_base = step_time(case["model"], case["plans"][base], hw)
        t_new, e_new = step_time(case["model"], case["plans"][new], hw)
        predicted = t_base / t_new
        off = predicted / case["reported_speedup"] - 1
        short = {"2104.05343": "Optimus", "2105.14450": "3D (Bian et al.)", "2105.14500": "Tesseract"}
        rows.append((short.get(str(case.get("arxiv", "")), case["paper"][:20]), f"{new} over {base}", hw.name,
                     f"{case['reported_speedup']:.2f}x", f"{predicted:.2f}x", f"{off:+.0%}",
                     f"{t_base * 1e3:.0f} / {t_new * 1e3:.0f}",
                     f"{e_base.comm_s / t_base:.0%} / {e_new.comm_s / t_new:.0%}"))
        entry = {"paper": case["paper"], "comparison": case["comparison"], "hardware": hw.name,
                 "reported": case["reported_speedup"], "predicted": predicted, "relative_error": off,
                 "step_ms": {base: t_base * 1e3, new: t_new * 1e3},
                 "comm_share": {base: e_base.comm_s / t_base, new: e_new.comm_s / t_new}}
        if args.sweep:
            entry["sweep"] = {}
            for dim in (4096, 8192, 12288):
                for batch in (8, 16, 32, 64):
                    m = dict(case["model"], dim=dim, mlp_hidden=4 * dim, batch=batch)
                    entry["sweep"][f"dim{dim}-batch{batch}"] = (step_time(m, case["plans"][base], hw)[0]
                                                                / step_time(m, case["plans"][new], hw)[0])
        out.append(entry)
    from cuboid.cli.tables import table

    print(table(rows, ("paper", "speedup", "hardware", "reported", "predicted", "off", "step ms (base/new)",
                        "comm share (base/new)")))
    if args.sweep:
        for e in out:
            s = e["sweep"]
            print(f"{e['comparison']:8s} {e['hardware']:14s} predicted over dim x batch: "
                  f"{min(s.values()):.2f}x .. {max(s.values()):.2f}x (reported {e['reported']:.2f}x)")
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
