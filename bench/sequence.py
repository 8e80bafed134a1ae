"""Sequence parallelism: the longest sequence that trains in a fixed memory budget per rank, and ring vs all-to-all.

    python bench/sequence.py [--budget-gb 2] [--layers 2] [--positions 16384] [--comm-seq 1024]
                             [--parts memory,traffic] [--json bench/sequence.json] [--tables-from JSON]

The model is gpt2-small-sized (``cuboid.load("gpt2", n_layers=..., n_positions=...)``:
dim 768, 12 heads, vocabulary 50257, tied LM head) with ``--layers`` blocks
(default 2, so that CPU runs finish) and ``n_positions`` raised to
``--positions``, fp32, batch 1, random token ids (labels = inputs), trained by
``cuboid.train_step`` with ``cuboid.parallel.optim.AdamW(lr=1e-4)``. Every
world is started by ``run_phases`` from bench/pipeline.py (spawned gloo
processes on 127.0.0.1, one thread each, bounded in time); memory is
``RssAnon`` of ``/proc/self/status`` sampled every 0.5 ms by ``AnonPeak``
from bench/checkpoint.py, counted from just before the model is built.

**1. Longest trainable sequence** (``--parts memory``). Configurations: no
sp (1 process, 2 threads), ring ``Plan(sp=2)``, ring ``Plan(sp=4)``, and
Megatron sequence parallelism inside 1D tensor parallelism
(``Plan(tp=2, tp_sequence=True)``) when this build has it. A probe of
length T is its own world: build the model and optimizer, one warm-up step
at the shortest length (128 sp tokens: the optimizer state and first-call
costs appear), then one measured step at T. T fits when the worst rank's
peak ``RssAnon`` minus its ``RssAnon`` before the model was built stays
within ``--budget-gb``; a failed step (an ``OutOfMemoryError``, a rank past
``--hard-cap`` x the budget, which is stopped, or a world past
``--probe-timeout``) does not fit. T is a multiple of ``2 sp 64``. The
search: a coarse probe at ``sp x --coarse`` tokens, then steps to the
length where the line through the measured peaks (peak = a + b T) meets the
budget, until a fitting T and a failing T + 2 sp 64 are both measured (at
most ``--max-probes`` probes per configuration). The table gives T_max, its
ratio to no-sp's, the goal 0.9 sp, and what the worst rank's memory is made
of at T_max: the state left after the warm-up (weights, AdamW state, data
parallel buckets), the step's growth above it, and one fp32 copy of the
rank's logits ((T / sp) x 50257 x 4 bytes; ``F.cross_entropy`` in fp32 keeps
the logits, their log-softmax and, in backward, their gradient).

**2. Ring vs all-to-all** (``--parts traffic``): at sp = 2 and sp = 4, one
world per sp builds both ``Plan(sp=sp)`` and ``Plan(sp=sp,
sp_mode="all_to_all")`` models, warms each up, then runs ``--repeats``
measured steps of ``--comm-seq`` tokens, alternating ring and all-to-all
(a barrier before each; a step's time is the slowest rank's; the table gives
the median as a ratio to ring's). Bytes sent per rank per step are read with
``cuboid.parallel.comm.count()`` (``bytes(group="sp")`` and ``per_op()``),
beside the formulas of ``parallel/sequence.py`` per layer (n = T/sp x 768
elements, e = 4 bytes): ring (sp-1) 2 n e forward + ((sp-1) 2 n e + sp 2 n 4)
backward; all-to-all 8 (sp-1)/sp n e. The gradient all-reduce over the
``dp x sp`` group (torch's ``replicate``, all weights replicated on every sp
rank) is torch's own collective and not in the count; it is the same for
both modes.

The machine is shared (2 cores): the driver waits for free memory before a
world starts, and times are ratios within one run (the seconds are in the
JSON). Prints markdown tables and writes ``--json``; ``--tables-from
bench/sequence.json`` prints a saved run's tables again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package: its helpers are imported as top-level modules

from checkpoint import AnonPeak  # noqa: E402  (RssAnon sampler)
from pipeline import run_phases  # noqa: E402  (spawned gloo worlds with a timeout)

VOCAB = 50257
CONFIGS = {  # name -> (world size, Plan kwargs or None for one process, sp for the goal or None)
    "no sp": (1, None, 1),
    "ring sp=2": (2, {"sp": 2}, 2),
    "ring sp=4": (4, {"sp": 4}, 4),
    "tp2-seq": (2, {"tp": 2, "tp_sequence": True}, None),
}


class OverBudget(MemoryError):
    pass


class Guard(AnonPeak):
    """``AnonPeak`` that also stops this rank (``OverBudget`` in the main thread) once RssAnon passes
    ``cap`` bytes, or once the machine has less than 1 GiB available; ``reset()`` starts a new peak."""

    def __init__(self, cap: int) -> None:
        self.cap, self.tripped = cap, None
        signal.signal(signal.SIGUSR1, self._raise)
        super().__init__()

    def _raise(self, *_):
        raise OverBudget(self.tripped)

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            now = self.now()
            self.peak = max(self.peak, now)
            tick += 1
            if self.tripped is None and (now > self.cap or tick % 40 == 0 and _meminfo("MemAvailable") < 2**30):
                self.tripped = (f"RssAnon {now / 1e9:.2f} GB passed the cap {self.cap / 1e9:.2f} GB" if now > self.cap
                                else "the machine has less than 1 GiB available")
                os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(self.period)

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak


def _meminfo(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024


# ---------------------------------------------------------------------- worker (one rank)


def _setup(world: int) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:  # if the kernel has to kill something, let it be a probe, not the machine's other jobs
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def _load(plan_kw, args):
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.optim import AdamW

    over = {"n_layers": args["layers"], "n_positions": args["positions"]}
    if plan_kw is None:
        model = cuboid.load(args["preset"], **over)
    else:
        plan = Plan(**plan_kw)
        model = cuboid.load(args["preset"], plan, mesh=Mesh.build(plan), **over)
    return model, AdamW(model.parameters(), lr=1e-4)


def _batch(T: int) -> dict:
    import torch

    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
    return {"input_ids": ids, "labels": ids}


def _state_bytes(model, opt) -> dict:
    params = {id(p): p for p in model.parameters()}
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if hasattr(t, "numel") and t.dim() > 0)
    return {"params": sum(p.numel() * p.element_size() for p in params.values()), "optimizer": state}


def probe_worker(case, args):
    """One probe: build, warm up at the shortest length, one measured step at ``case["T"]``; every rank's record."""
    import torch.distributed as dist

    import cuboid

    world, plan_kw, _ = CONFIGS[case["config"]]
    _setup(world)
    base = AnonPeak.now()
    guard = Guard(base + int(args["hard_cap"] * args["budget"]))
    rec = {"rank": dist.get_rank(), "base": base}
    try:
        model, opt = _load(plan_kw, args)
        rec["loaded"] = AnonPeak.now() - base
        cuboid.train_step(model, opt, _batch(case["warm"]))
        rec["static"] = AnonPeak.now() - base
        rec.update(_state_bytes(model, opt))
        dist.barrier()
        guard.reset()
        t0 = time.perf_counter()
        cuboid.train_step(model, opt, _batch(case["T"]))
        rec["seconds"] = time.perf_counter() - t0
        rec["step_peak"] = guard.peak - base
    finally:
        rec["peak"] = guard.stop() - base  # the whole probe, from before the model was built
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rec)
    return every


def traffic_worker(case, args):
    """Ring and all-to-all models side by side in one world; alternating measured steps with byte counts."""
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import comm

    sp, T = case["sp"], case["T"]
    _setup(sp)
    modes = {"ring": {"sp": sp}, "all_to_all": {"sp": sp, "sp_mode": "all_to_all"}}
    built = {m: _load(kw, args) for m, kw in modes.items()}
    for model, opt in built.values():
        cuboid.train_step(model, opt, _batch(2 * sp * 64))
    sampler = AnonPeak()
    out = {m: {"seconds": [], "peak_growth": []} for m in modes}
    for i in range(case["repeats"]):
        for mode, (model, opt) in built.items():
            dist.barrier()
            before = AnonPeak.now()
            sampler.peak = before
            t0 = time.perf_counter()
            with comm.count() as tally:
                cuboid.train_step(model, opt, _batch(T))
            out[mode]["seconds"].append(time.perf_counter() - t0)
            out[mode]["peak_growth"].append(sampler.peak - before)
            if i == 0:
                items = {f"{o}@{g}": {"calls": c, "bytes": b} for (o, g), (c, b) in tally.items().items()}
                out[mode].update(sp_bytes=tally.bytes(group="sp"), per_op=tally.per_op(), per_group=tally.per_group(),
                                 items=items)
    sampler.stop()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"rank": dist.get_rank(), "modes": out})
    return every


# ---------------------------------------------------------------------- driver


def _one_world(fn, case, world: int, args: dict, timeout: float) -> tuple:
    need = int(world * args["budget"] * 1.2) + 2**30
    t0 = time.monotonic()
    while _meminfo("MemAvailable") < need and time.monotonic() - t0 < args["wait"]:
        print(f"  waiting for memory: {_meminfo('MemAvailable') / 2**30:.1f} GiB available, "
              f"{need / 2**30:.1f} GiB wanted", file=sys.stderr, flush=True)
        time.sleep(15)
    args = {**args, "t_launch": time.time(), "p2p_timeout": timeout}
    t1 = time.monotonic()
    (every,), err = run_phases([(fn, case)], world, args, timeout)
    return every, err, time.monotonic() - t1, t1 - t0


def _verdict(err: str) -> str:
    if "OverBudget" in err or "OutOfMemoryError" in err or "MemoryError" in err:
        return "over the hard cap" if "OverBudget" in err else "out of memory"
    if "timed out" in err:
        return "timeout"
    return "error"


def run_probe(config: str, T: int, args: dict) -> dict:
    world, _, sp = CONFIGS[config]
    q = 128 * world
    case = {"config": config, "T": T, "warm": q}
    t0 = time.perf_counter()
    every, err, wall, waited = _one_world(probe_worker, case, world, args, args["probe_timeout"])
    rec = {"T": T, "wall_s": wall, "waited_s": waited}
    if err is None:
        worst = max(every, key=lambda r: r["peak"])
        rec.update(peak=worst["peak"], fits=worst["peak"] <= args["budget"], worst_rank=worst["rank"], ranks=every,
                   seconds=max(r["seconds"] for r in every))
    else:
        v = _verdict(err)
        rec.update(fits=False, failure=v, error=err[-1500:])
    what = f"peak {rec['peak'] / 1e9:.2f} GB" if "peak" in rec else rec["failure"]
    print(f"  {config} T={T}: {what}, {'fits' if rec['fits'] else 'does not fit'} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rec


def _predict(probes: list, budget: int) -> float:
    """The T where the line through the measured peaks meets the budget (the two probes nearest it)."""
    pts = sorted(((p["T"], p["peak"]) for p in probes if "peak" in p), key=lambda tp: abs(tp[1] - budget))[:2]
    if len(pts) == 1 or pts[0][0] == pts[1][0]:  # one point: a line through the warm-up's static state
        (T, peak), = pts[:1]
        ranks = next(p["ranks"] for p in probes if p["T"] == T and "ranks" in p)
        static = max(r["static"] for r in ranks)
        return T * (budget - static) / max(peak - static, 1)
    (t1, p1), (t2, p2) = pts
    slope = (p2 - p1) / (t2 - t1)
    return t1 + (budget - p1) / slope if slope > 0 else 2 * max(t1, t2)


def search(config: str, args: dict) -> dict:
    world, plan_kw, sp = CONFIGS[config]
    q = 128 * world
    probes: list = []
    T = min(args["positions"], q * max(1, round(world * args["coarse"] / q)))
    for _ in range(args["max_probes"]):
        rec = run_probe(config, T, args)
        probes.append(rec)
        if rec.get("failure") == "error":
            return {"config": config, "world": world, "probes": probes, "error": rec["error"]}
        fit = [p["T"] for p in probes if p["fits"]]
        unfit = [p["T"] for p in probes if not p["fits"]]
        lo, hi = max(fit, default=0), min(unfit, default=None)
        if hi is not None and hi - lo <= q or (hi is None and lo >= args["positions"]):
            break
        if any("peak" in p for p in probes):
            nxt = int(_predict(probes, args["budget"]) // q) * q
        else:  # only failures without a peak: halve
            nxt = (hi // 2 // q) * q
        nxt = max(nxt, lo + q)
        if hi is not None:
            nxt = min(nxt, hi - q)
        T = min(nxt, args["positions"])
    fit = [p for p in probes if p["fits"]]
    best = max(fit, key=lambda p: p["T"]) if fit else None
    unfit = [p["T"] for p in probes if not p["fits"] and (best is None or p["T"] > best["T"])]
    out = {"config": config, "world": world, "sp": sp, "quantum": q, "probes": probes,
           "T_max": best["T"] if best else 0,
           "bracketed": best is not None and bool(unfit) and min(unfit) - best["T"] <= q,
           "first_unfit": min(unfit) if unfit else None}
    if best:
        worst = max(best["ranks"], key=lambda r: r["peak"])
        out.update(peak=worst["peak"], static=worst["static"], params=worst["params"], optimizer=worst["optimizer"],
                   growth=worst["peak"] - worst["static"], local_tokens=best["T"] // (sp or world),
                   step_s=best["seconds"])
    return out


def _available(config: str) -> str | None:
    """None when the configuration can run in this build, else why not."""
    _, plan_kw, _ = CONFIGS[config]
    if plan_kw is None:
        return None
    from cuboid.parallel import Plan

    try:
        Plan(**plan_kw).require_implemented()
    except (TypeError, ValueError, NotImplementedError) as e:
        return f"not built ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


# ---------------------------------------------------------------------- tables


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def memory_table(rows: list, budget: int, layers: int) -> str:
    base = next((r["T_max"] for r in rows if r["config"] == "no sp" and r.get("T_max")), None)
    head = ("config", "ranks", f"T_max (budget {budget / 1e9:g} GB/rank, {layers} layers)", "next T (did not fit)",
            "T_max / no-sp", "goal 0.9 sp", "worst rank peak MB", "after warm-up MB (weights + AdamW + buckets)",
            "step growth MB", "growth / local token KB", "one fp32 logits copy MB", "probes")
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 2) + " --- |"]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or "error: " + r["error"].strip().splitlines()[-1][:160]
            lines.append(f"| {r['config']} | {r['world']} | {why} |" + " |" * (len(head) - 3))
            continue
        probes = ", ".join(f"{p['T']}{'' if p['fits'] else 'x'}" for p in r["probes"])
        if not r["T_max"]:
            lines.append(f"| {r['config']} | {r['world']} | none fits | | | | | | | | | {probes} |")
            continue
        ratio = f"{r['T_max'] / base:.2f}" if base else "-"
        goal = f"{0.9 * r['sp']:.1f}" if r["sp"] else "-"
        nxt = str(r["first_unfit"]) if r["first_unfit"] else "-"
        lines.append(f"| {r['config']} | {r['world']} | {r['T_max']}{'' if r['bracketed'] else ' (lower bound)'} "
                     f"| {nxt} | {ratio} | {goal} | {mb(r['peak'])} | {mb(r['static'])} | {mb(r['growth'])} "
                     f"| {r['growth'] / r['local_tokens'] / 1e3:.0f} | {mb(r['local_tokens'] * VOCAB * 4)} "
                     f"| {probes} |")
    return "\n".join(lines)


def expected_sp_bytes(mode: str, sp: int, T: int, layers: int, dim: int = 768) -> float:
    n, e = T / sp * dim, 4
    per_layer = ((sp - 1) * 2 * n * e + (sp - 1) * 2 * n * e + sp * 2 * n * 4 if mode == "ring"
                 else 8 * (sp - 1) / sp * n * e)
    return layers * per_layer


def traffic_table(rows: list, layers: int) -> str:
    head = ("sp", "mode", "T", "sp bytes / rank / step (MB)", "formula (attention only, MB)", "per op (MB)",
            "step time / ring's (median)", "step peak growth MB")
    lines = ["| " + " | ".join(head) + " |", "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['sp']} | - | {r['T']} | error: {r['error'].strip().splitlines()[-1][:160]} |"
                         + " |" * 4)
            continue
        for mode in ("ring", "all_to_all"):
            m = r["modes"][mode]
            ops = ", ".join(f"{o} {v / 1e6:.1f}" for o, v in sorted(m["per_op"].items()))
            lines.append(f"| {r['sp']} | {mode} | {r['T']} | {m['sp_bytes'] / 1e6:.2f} "
                         f"| {expected_sp_bytes(mode, r['sp'], r['T'], layers) / 1e6:.2f} | {ops} "
                         f"| {m['step_s'] / r['modes']['ring']['step_s']:.2f} "
                         f"| {mb(m['peak_growth'])} |")
    return "\n".join(lines)


def summarise_traffic(every: list) -> dict:
    modes = {}
    for mode in ("ring", "all_to_all"):
        per_rank = [r["modes"][mode] for r in every]
        steps = [max(ts) for ts in zip(*(m["seconds"] for m in per_rank))]  # each step: the slowest rank
        modes[mode] = {"sp_bytes": max(m["sp_bytes"] for m in per_rank), "per_op": per_rank[0]["per_op"],
                       "per_group": per_rank[0]["per_group"], "items": per_rank[0]["items"],
                       "step_s": statistics.median(steps), "steps_s": steps,
                       "peak_growth": max(max(m["peak_growth"]) for m in per_rank),
                       "sp_bytes_per_rank": [m["sp_bytes"] for m in per_rank]}
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-gb", type=float, default=2.0, help="RssAnon growth allowed per rank (1e9 bytes)")
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--positions", type=int, default=16384, help="n_positions (the longest T probed)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--coarse", type=int, default=1024, help="first probe: sp x this many tokens")
    ap.add_argument("--max-probes", type=int, default=4, help="probes per configuration")
    ap.add_argument("--hard-cap", type=float, default=1.5, help="stop a rank past this multiple of the budget")
    ap.add_argument("--probe-timeout", type=float, default=420.0, help="seconds per probe world")
    ap.add_argument("--comm-seq", type=int, default=1024, help="T of the ring vs all-to-all part")
    ap.add_argument("--comm-sps", default="2,4")
    ap.add_argument("--repeats", type=int, default=2, help="measured steps per mode in the traffic part")
    ap.add_argument("--parts", default="memory,traffic")
    ap.add_argument("--wait", type=float, default=900.0, help="seconds to wait for free memory before a world")
    ap.add_argument("--json", type=Path, default=HERE / "sequence.json")
    ap.add_argument("--tables-from", type=Path, help="print the tables of a saved --json and exit (runs nothing)")
    a = ap.parse_args()
    if a.tables_from:
        saved = json.loads(a.tables_from.read_text())
        print(render(saved["memory"], saved["traffic"], saved["settings"], saved["machine"], saved["seconds"]))
        return
    os.environ.pop("TRITON_INTERPRET", None)  # the CPU path: torch references
    args = {"budget": int(a.budget_gb * 1e9), "preset": a.preset, "layers": a.layers, "positions": a.positions,
            "coarse": a.coarse, "max_probes": a.max_probes, "hard_cap": a.hard_cap, "wait": a.wait,
            "probe_timeout": a.probe_timeout}
    parts = set(a.parts.split(","))
    t_start = time.perf_counter()
    memory, traffic = [], []
    if "memory" in parts:
        for config in [c for c in a.configs.split(",") if c]:
            t0 = time.perf_counter()
            why = _available(config)
            if why:
                memory.append({"config": config, "world": CONFIGS[config][0], "skipped": why})
            else:
                memory.append(search(config, args))
            print(f"{config}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if "traffic" in parts:
        for sp in [int(x) for x in a.comm_sps.split(",")]:
            t0 = time.perf_counter()
            case = {"sp": sp, "T": a.comm_seq, "repeats": a.repeats}
            every, err, wall, waited = _one_world(traffic_worker, case, sp, args, a.probe_timeout)
            row = {"sp": sp, "T": a.comm_seq, "wall_s": wall, "waited_s": waited}
            row.update({"error": err} if err else {"modes": summarise_traffic(every), "ranks": every})
            traffic.append(row)
            print(f"traffic sp={sp}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_start
    import torch

    machine = {"cpus": os.cpu_count(), "mem_total": _meminfo("MemTotal"), "python": platform.python_version(),
               "torch": torch.__version__}
    settings = {**args, "comm_seq": a.comm_seq, "repeats": a.repeats}
    md = render(memory, traffic, settings, machine, total)
    print(md)
    a.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:], "machine": machine,
        "settings": settings, "seconds": total, "memory": memory, "traffic": traffic, "table": md},
        indent=1, default=str) + "\n")
    print(f"wrote {a.json}", file=sys.stderr)


def render(memory: list, traffic: list, settings: dict, machine: dict, total: float) -> str:
    """The header line and the tables, from what a run measured (also ``--tables-from`` a saved JSON)."""
    layers, budget = settings["layers"], settings["budget"]
    out = [f"sequence bench: {settings['preset']} (dim 768, 12 heads, vocab {VOCAB}) with {layers} layers, "
           f"n_positions {settings['positions']}, fp32, batch 1, {machine['cpus']} CPUs, torch {machine['torch']}, "
           f"{total:.0f} s"]
    if memory:
        out.append(f"longest trainable sequence at {budget / 1e9:g} GB of RssAnon growth per rank (probes: T, "
                   f"x = did not fit):\n\n{memory_table(memory, budget, layers)}")
    if traffic:
        T = traffic[0]["T"]
        repeats = next((len(r["modes"]["ring"]["steps_s"]) for r in traffic if "modes" in r), "?")
        out.append(f"ring vs all-to-all, one training step of {T} tokens, {layers} layers (median of {repeats}, "
                   f"alternated):\n\n{traffic_table(traffic, layers)}")
    return "\n\n".join(out)

if __name__ == "__main__":
    main()
