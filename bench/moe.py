"""Mixture of experts on this machine: the grouped GEMM against a loop over experts, tokens/s at ep = 1, 2, 4,
and the experts' all-to-all bytes against the cost model's formula.

    python bench/moe.py                  # all three parts, prints tables, writes bench/moe.json
    python bench/moe.py --quick          # small sizes and few steps (a smoke run)
    python bench/moe.py --dry-run        # one step per part at toy sizes, nothing written

1. **Grouped GEMM** (``cuboid.kernels.grouped_mm``, the CPU torch path here) against a Python loop of one
   matmul per expert, on the experts' gate/up and down shapes with a routing drawn at random (uneven groups,
   some empty at the smallest size): forward, and forward + backward, median milliseconds, and the largest
   difference of the two outputs.
2. **Tokens per second** of ``cuboid.train_step`` on a small Qwen3-MoE (every layer sparse) under
   ``dp=W,ep=1``, ``dp=W,ep=2`` and ``dp=W,ep=4`` on ``W`` gloo processes (default 4): the same global batch,
   world and model; only where the experts live changes. The slowest rank's median step.
3. **Dispatch bytes**: in those steps, the bytes of every all-to-all over the expert-parallel group that
   ``comm.count`` counts, summed over the ranks, beside (a) the same formula applied to the routing the run
   made (each (token, choice) pair whose expert lives on another rank is a row of ``dim`` elements; four
   exchanges per sparse layer and step: dispatch and combine, forward and backward) and (b) the cost model's
   even-routing formula (:func:`cuboid.parallel.cost.traffic.expert_exchange_bytes` summed over ranks); both
   with the per-expert counts each rank exchanges first (``(ep - 1) / ep x 8 E`` bytes per layer), as the cost
   model prices them.

On a 2-core machine shared with other work the times are indicative only; byte counts are exact.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (experts, routed rows M = tokens x k, model dim C, expert width I)
GEMM_SIZES = {"full": [(8, 4096, 256, 512), (32, 8192, 256, 256), (128, 8192, 128, 128)],
              "quick": [(8, 1024, 128, 128), (32, 2048, 64, 64)],
              "dry": [(4, 64, 16, 16)]}
# the timed model: Qwen3-MoE's layout, every layer sparse
MOE = {"full": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=8, experts_per_token=2,
                    moe_hidden=256, mlp_only_layers=(), vocab_size=512, n_positions=256),
       "quick": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, experts_per_token=2,
                     moe_hidden=64, mlp_only_layers=(), vocab_size=512, n_positions=128),
       "dry": dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, n_experts=4, experts_per_token=2,
                   moe_hidden=16, mlp_only_layers=(), vocab_size=128, n_positions=32)}
BATCH = {"full": (8, 128), "quick": (8, 64), "dry": (4, 16)}
STEPS = {"full": 5, "quick": 3, "dry": 1}


def _median_ms(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def loop_mm(x, w, counts):
    """The reference the grouped GEMM replaces: one matmul per expert over its rows, concatenated."""
    import torch

    outs, start = [], 0
    for g, c in enumerate(counts.tolist()):
        outs.append(x[start:start + c] @ w[g].T)
        start += c
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def grouped_gemm(sizes, reps: int) -> list[dict]:
    """Part 1: grouped_mm against :func:`loop_mm` on each of ``sizes``."""
    import torch

    from cuboid.kernels import grouped_mm

    rows = []
    gen = torch.Generator().manual_seed(0)
    for experts, m, dim, width in sizes:
        # a skewed routing: expert popularity drawn from a Dirichlet-like spread, some experts maybe empty
        weights = torch.rand(experts, generator=gen) ** 3
        choice = torch.multinomial(weights / weights.sum(), m, replacement=True, generator=gen)
        counts = torch.bincount(choice, minlength=experts).to(torch.int64)
        for name, n_out, k_in in (("gate_up", 2 * width, dim), ("down", dim, width)):
            x = torch.randn(m, k_in, generator=gen)
            w = torch.randn(experts, n_out, k_in, generator=gen) / k_in ** 0.5
            diff = (grouped_mm(x, w, counts) - loop_mm(x, w, counts)).abs().max().item()

            def step(f):
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                f(xg, wg, counts).sum().backward()

            fwd = {f.__name__: _median_ms(lambda f=f: f(x, w, counts), reps) for f in (grouped_mm, loop_mm)}
            both = {f.__name__: _median_ms(lambda f=f: step(f), reps) for f in (grouped_mm, loop_mm)}
            rows.append({"experts": experts, "rows": m, "gemm": name, "shape": f"{m}x{k_in} @ {experts}x{n_out}x{k_in}",
                         "empty_experts": int((counts == 0).sum()), "max_abs_diff": diff,
                         "forward_ms": fwd, "forward_backward_ms": both})
    return rows


def moe_worker(config_fields: dict, plans: list, batch: int, seq: int, steps: int) -> dict:
    """Part 2 and 3 on one rank: per plan, the median step seconds, the all-to-all bytes over the expert group
    this rank sent in one counted step, and the routing its routers made in that step (:class:`RoutedPairs`)."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import comm
    from tests.parallel.cost_checks import RoutedPairs, median_step, stepped

    config = zoo.config_of("qwen3-moe-debug", **config_fields)
    out = {}
    for spec in plans:
        model, opt, data = stepped(config, spec, batch, seq, lr=1e-4)
        plan = model.parallel.plan
        with comm.count() as tally, RoutedPairs(model, plan, model.parallel.mesh) as routed:
            cuboid.train_step(model, opt, data)
        sent = sum(b for (op, group), (_, b) in tally.items().items() if op == "all_to_all" and group == "ep")
        out[spec] = {"step_s": median_step(model, opt, data, steps), "a2a_bytes": sent, "routed": routed.result(config),
                     "ep": plan.ep}
    return out


def expert_parallel(size: str, world: int) -> list[dict]:
    """Parts 2 and 3: tokens/s and all-to-all bytes of ``dp=world,ep=e`` for e in 1, 2, 4 (those dividing)."""
    from cuboid.parallel.cost.traffic import expert_exchange_bytes
    from tests.parallel.cost_checks import routed_bytes
    from tests.parallel.launch import run_world

    fields, (batch, seq), steps = MOE[size], BATCH[size], STEPS[size]
    eps = [e for e in (1, 2, 4) if world % e == 0 and fields["n_experts"] % e == 0]
    plans = [f"dp={world},ep={e}" for e in eps]
    reports = run_world(moe_worker, world, fields, plans, batch, seq, steps, timeout=1800)
    rows = []
    layers, k, dim, elem = fields["n_layers"], fields["experts_per_token"], fields["dim"], 4
    for spec, e in zip(plans, eps):
        took = max(r[spec]["step_s"] for r in reports)
        measured = sum(r[spec]["a2a_bytes"] for r in reports)
        counts = world * layers * (e - 1) / e * 8 * fields["n_experts"]  # each rank's counts exchange per layer
        routed = routed_bytes([r[spec]["routed"] for r in reports])
        even = 4 * layers * world * expert_exchange_bytes(batch // world * seq, k, dim, elem, e) + counts
        rows.append({"plan": spec, "ep": e, "ranks": world, "step_s": took, "tokens_per_s": batch * seq / took,
                     "a2a_bytes_measured": measured, "a2a_bytes_routed_formula": routed,
                     "a2a_bytes_even_formula": even})
    return rows


def print_tables(gemm: list, ep: list) -> None:
    from cuboid.cli.tables import table

    if gemm:
        print("grouped GEMM (cuboid.kernels.grouped_mm, CPU torch path) against a loop over experts, median ms")
        print(table([(r["gemm"], r["shape"], str(r["empty_experts"]), f"{r['forward_ms']['grouped_mm']:.2f}",
                      f"{r['forward_ms']['loop_mm']:.2f}",
                      f"{r['forward_ms']['loop_mm'] / r['forward_ms']['grouped_mm']:.2f}x",
                      f"{r['forward_backward_ms']['grouped_mm']:.2f}", f"{r['forward_backward_ms']['loop_mm']:.2f}",
                      f"{r['forward_backward_ms']['loop_mm'] / r['forward_backward_ms']['grouped_mm']:.2f}x",
                      f"{r['max_abs_diff']:.1e}") for r in gemm],
                    ("gemm", "rows @ experts", "empty", "fwd grouped", "fwd loop", "speed-up", "f+b grouped",
                     "f+b loop", "speed-up", "max diff")))
    if ep:
        print("\nexpert parallelism: train_step of a small Qwen3-MoE on gloo ranks (slowest rank, median);"
              " all-to-all bytes of one step over all ranks")
        print(table([(r["plan"], str(r["ranks"]), f"{r['step_s'] * 1e3:.0f} ms", f"{r['tokens_per_s']:.0f}",
                      f"{r['a2a_bytes_measured']:,.0f}", f"{r['a2a_bytes_routed_formula']:,.0f}",
                      f"{r['a2a_bytes_even_formula']:,.0f}") for r in ep],
                    ("plan", "ranks", "step", "tokens/s", "a2a measured", "formula (this routing)",
                     "formula (even)")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few steps")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes, one step, nothing written")
    ap.add_argument("--world", type=int, default=4, help="gloo processes for the ep part (default 4)")
    ap.add_argument("--skip", choices=("gemm", "ep"), action="append", default=[], help="leave a part out")
    ap.add_argument("--json", default=str(HERE / "moe.json"))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    size = "dry" if args.dry_run else "quick" if args.quick else "full"
    gemm = grouped_gemm(GEMM_SIZES[size], STEPS[size]) if "gemm" not in args.skip else []
    ep = expert_parallel(size, args.world) if "ep" not in args.skip else []
    print_tables(gemm, ep)
    if not args.dry_run:
        Path(args.json).write_text(json.dumps({"size": size, "threads": 1, "grouped_gemm": gemm,
                                               "expert_parallel": ep}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
