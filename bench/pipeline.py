"""Bubble fraction and activations in flight of torch's pipeline schedules, on fixed-cost stages.

The engine cuboid's pipeline uses, ``torch.distributed.pipelining``
(``PipelineStage`` with ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble``), runs p gloo ranks
on loopback. Every stage is the same: ``--blocks`` blocks whose costs are
sleeps, so that the CPU's noise (2 cores shared with other jobs) does not
decide; ``time.sleep`` gives the core away, so p ranks on 2 cores still
overlap like p devices.

One block is ``y = XCost(x) * WCost(w)``:

- ``XCost`` (a custom autograd Function) sleeps ``t_f`` in forward and
  ``t_bi`` in backward: the input-gradient part of the backward;
- ``WCost`` is the identity on the block's weight ``w`` and sleeps ``t_w`` in
  backward: the weight-gradient part. It lies only on the weight's path, so
  torch's split backward (ZBV's ``I`` = ``stage_backward_input``, an
  ``autograd.grad`` toward the stage inputs) does not run it, and its ``W``
  (``stage_backward_weight``, from the saved gradients at the first node the
  weight path shares with the input path) runs it and nothing else. A full
  backward (GPipe, 1F1B, interleaved) runs both, ``t_b = t_bi + t_w``.
- The first stage's input needs no gradient; the block then makes it a leaf
  that does, so that every stage costs the same. (torch skips ``I`` on stage
  0 under ZBV and runs the whole backward as its ``W``.)

A rank's stage (or each of its v virtual stages, 1/v of the work each) costs
``t_f`` forward and ``t_b`` backward per micro-batch, shared evenly by its
blocks. Defaults: t_f = t_bi = t_w = 100 ms (backward = 2 x forward; ZB-V's
"zero bubble" needs T_F = T_B = T_W), one block per (virtual) stage. torch's
runtime costs about 1-3 ms per action on the shared 2-core machine (p2p over
gloo, the schedule's Python, waking up), a roughly fixed cost per step whatever
the sleeps ("step - simulated" below), and it is counted as bubble. On
2026-12-03, GPipe and 1F1B at m = 4p measured 1.13-1.23 x the formula with
50 ms ops, 1.07-1.10 x with 100 ms and (1F1B) 1.03-1.05 x with 200 ms.

Measured, per schedule, p and m (one warm-up step, then ``--repeats`` steps
and the median):

- step time T: from the earliest rank's start to the last rank's end (a
  barrier before each step; one monotonic clock for all processes);
- busy time of each rank: the sum of the measured sleeps of its blocks in the
  step (forward, input-gradient, weight-gradient);
- bubble = mean over ranks of (T - busy) / T, against (p-1)/(m+p-1) for
  GPipe and 1F1B and (p-1)/(v m+p-1) for interleaved 1F1B (v = 2); ZBV
  beside 1F1B at the same p, m;
- "torch's order, simulated": the actions each rank runs (the runtime
  schedules' ``pipeline_order``; GPipe's and 1F1B's own loops) played with
  the same costs and free, instant communication: the bubble the schedule
  itself leaves, so that measured minus simulated is this machine's overhead;
- activations in flight: the first block of every (virtual) stage saves a
  marker tensor of a known size (``save_for_backward``) per micro-batch; a
  ``weakref.finalize`` on it counts when autograd really frees it (after the
  backward, or after ZBV's ``W``). The peak live bytes per rank, in units of
  one whole stage's micro-batch (v virtual-stage markers = 1), beside m
  (GPipe) and p (1F1B; ZB-V's paper claims the same as 1F1B).

The overheads the formula leaves out (p2p sends over gloo, the schedule's
Python, oversleep and waking on a busy machine) count as bubble here.

A last part steps each schedule once (1 ms costs) at micro-batch counts off
the grid (1, p-1, p+1, 2p-1, 2p+1) and records which are refused and which run.
Each world of p ranks is bounded (``--timeout``; p2p and collectives time out
after 60 s), so a hang is reported, not waited on.

    python bench/pipeline.py [--out bench/pipeline.json] [--tf 0.1 --tbi 0.1 --tw 0.1]
                             [--blocks 1] [--repeats 3] [--ps 2,4] [--no-probe]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
V = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}
MARK_ELEMS = 1 << 16  # 256 KiB of fp32 per (virtual) stage and micro-batch
WIDTH, MB_ROWS = 8, 2  # activations: (2, 8) per micro-batch

# per-process tallies, reset before each step
BUSY: dict = defaultdict(float)
TIMELINE: list = []  # (kind, stage, start, end) of every sleep in the step
LIVE: dict = defaultdict(int)
PEAK: dict = {"total": 0}
SCALE = [1.0]  # multiplies every sleep; the warm-up step runs at a small scale


def _sleep(kind: str, stage: int, seconds: float) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds * SCALE[0])
    t1 = time.perf_counter()
    BUSY[kind] += t1 - t0
    TIMELINE.append((kind, stage, t0, t1))


def _freed(stage: int) -> None:
    LIVE[stage] -= 1
    LIVE["total"] -= 1


def _held(stage: int) -> None:
    LIVE[stage] += 1
    LIVE["total"] += 1
    PEAK["total"] = max(PEAK["total"], LIVE["total"])
    PEAK[stage] = max(PEAK.get(stage, 0), LIVE[stage])


def _functions():
    import torch

    class XCost(torch.autograd.Function):
        """Identity on the activation; sleeps t_f forward and t_bi backward (the input gradient)."""

        @staticmethod
        def forward(ctx, x, tf, tbi, stage, mark):
            ctx.tbi, ctx.stage = tbi, stage
            if mark is not None:  # one marker per (virtual) stage and micro-batch, freed with the graph
                buf = torch.empty(MARK_ELEMS)
                weakref.finalize(buf, _freed, mark)
                _held(mark)
                ctx.save_for_backward(buf)
            _sleep("F", stage, tf)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            _sleep("B", ctx.stage, ctx.tbi)
            return g, None, None, None, None

    class WCost(torch.autograd.Function):
        """Identity on the weight; sleeps t_w backward (the weight gradient)."""

        @staticmethod
        def forward(ctx, w, tw, stage):
            ctx.tw, ctx.stage = tw, stage
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            _sleep("W", ctx.stage, ctx.tw)
            return g, None, None

    return XCost, WCost


def make_stage_module(stage: int, blocks: int, tf: float, tbi: float, tw: float):
    import torch
    from torch import nn

    XCost, WCost = _functions()

    class Block(nn.Module):
        def __init__(self, mark):
            super().__init__()
            self.w = nn.Parameter(torch.ones(WIDTH))
            self.mark = mark

        def forward(self, x):
            if not x.requires_grad:  # the first stage: make its input-gradient part run too
                x = x.detach().requires_grad_()
            return XCost.apply(x, tf, tbi, stage, self.mark) * WCost.apply(self.w, tw, stage)

    return nn.Sequential(*[Block(stage if i == 0 else None) for i in range(blocks)])


def stage_ids(schedule: str, rank: int, p: int) -> list:
    if V[schedule] == 1:
        return [rank]
    return [rank, rank + p] if schedule == "interleaved" else [rank, 2 * p - 1 - rank]


def _loss(out, target):
    return ((out - target) ** 2).mean()


def build(schedule: str, p: int, m: int, rank: int, blocks: int, tf: float, tbi: float, tw: float):
    import torch
    from torch.distributed import pipelining as P

    v = V[schedule]
    ids = stage_ids(schedule, rank, p)
    per = blocks  # blocks per (virtual) stage; each virtual stage does 1/v of the rank's work
    mods = [make_stage_module(s, per, tf / v / per, tbi / v / per, tw / v / per) for s in ids]
    stages = [P.PipelineStage(mod, s, p * v, torch.device("cpu")) for mod, s in zip(mods, ids)]
    kinds = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved": P.ScheduleInterleaved1F1B,
             "zbv": P.ScheduleZBVZeroBubble}
    sched = kinds[schedule](stages[0] if v == 1 else stages, m, loss_fn=_loss, scale_grads=False)
    return sched, ids, mods


def one_step(sched, ids, p, v, m, rank):
    import gc

    import torch
    import torch.distributed as dist

    first, last = 0 in ids, p * v - 1 in ids
    x = torch.randn(m * MB_ROWS, WIDTH, generator=torch.Generator().manual_seed(0))
    target = torch.zeros(m * MB_ROWS, WIDTH)
    leftover = LIVE["total"]  # markers still alive from the step before (0: everything was freed)
    BUSY.clear()
    TIMELINE.clear()
    PEAK.clear()
    PEAK["total"] = LIVE["total"]
    kwargs = {"target": target, "losses": []} if last else {}
    gc.disable()  # no collector pauses inside the timed step
    dist.barrier()
    t0 = time.perf_counter()
    sched.step(*((x,) if first else ()), **kwargs)
    t1 = time.perf_counter()
    gc.enable()
    gc.collect()  # frees anything a reference cycle still held, so that live_after counts leaks only
    mine = {"t0": t0, "t1": t1, "busy": dict(BUSY), "peak_markers": PEAK["total"],
            "peak_per_stage": {s: PEAK.get(s, 0) for s in ids}, "live_after": LIVE["total"],
            "live_before": leftover, "timeline": list(TIMELINE)}
    every = [None] * p
    dist.all_gather_object(every, mine)
    return every


def _settle() -> None:
    """Import the pipelining package (slow the first time) and freeze what is alive, so that the
    collections after each step stay short."""
    import gc

    import torch.distributed.pipelining  # noqa: F401

    gc.collect()
    gc.freeze()


def world_worker(cases, args):
    """All cases of one world size on this rank; returns this rank's records (rank 0's gather of all)."""
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    _settle()
    out = []
    for schedule, m in cases:
        t_case = time.perf_counter()
        v = V[schedule]
        rec = {"schedule": schedule, "p": p, "m": m, "v": v}
        try:
            sched, ids, _ = build(schedule, p, m, rank, args["blocks"], args["tf"], args["tbi"], args["tw"])
        except Exception as e:  # a schedule refusing this m: record it (every rank refuses alike)
            rec["error"] = f"{type(e).__name__}: {e}"
            out.append(rec)
            dist.barrier()
            continue
        rec["order"] = {r: [None if a is None else (a.stage_index, str(a.computation_type.value), a.microbatch_index)
                            for a in acts] for r, acts in (sched.pipeline_order or {}).items()}
        SCALE[0] = 0.05  # the warm-up step (shape inference, first p2p) at 1/20 of the costs
        warm = one_step(sched, ids, p, v, m, rank)
        SCALE[0] = 1.0
        rec["steps"] = [one_step(sched, ids, p, v, m, rank) for _ in range(args["repeats"])]
        rec["warmup_step_s"] = max(r["t1"] for r in warm) - min(r["t0"] for r in warm)
        out.append(rec)
        del sched
        dist.barrier()
        if rank == 0:
            print(f"  p={p} {schedule} m={m}: {time.perf_counter() - t_case:.1f} s", file=sys.stderr, flush=True)
    return out


def probe_worker(cases, args):
    """Edge cases: does each schedule accept m, and does one step finish (bounded by the caller)?"""
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for schedule, m in cases:
        rec = {"schedule": schedule, "p": p, "m": m}
        try:
            sched, ids, _ = build(schedule, p, m, rank, 1, 0.001, 0.001, 0.001)
        except Exception as e:
            rec["result"] = f"refused: {type(e).__name__}: {e}"
            out.append(rec)
            continue
        try:
            steps = one_step(sched, ids, p, V[schedule], m, rank)
            rec["result"] = "ran"
            rec["markers_left"] = sum(r["live_after"] for r in steps)
        except Exception as e:
            rec["result"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            out.append(rec)
            break  # a rank that failed mid-step leaves the others' p2p in an unknown state
        out.append(rec)
    return out


# ---------------------------------------------------------------- launching

def phases_worker(phases, args):
    """One rank: a process group with the p2p timeout, then each phase's ``fn(cases, args)``, each result sent
    back as soon as it is done."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args["p2p_timeout"]))
    if rank == 0:
        print(f"  p={world}: process group up after {time.time() - args['t_launch']:.1f} s", file=sys.stderr,
              flush=True)
    for fn, cases in phases:
        yield fn(cases, args)


def run_phases(phases: list, world: int, args, timeout: float):
    """Each ``(fn, cases)`` of ``phases`` in turn, ``fn(cases, args)``, on ``world`` gloo ranks on loopback
    (one process group for all; :func:`tests.parallel.launch.gather_world`). Returns rank 0's result per phase
    (None where it did not finish) and the first error (a rank's traceback, or a timeout after ``timeout`` s:
    a hang), or None."""
    from tests.parallel.launch import gather_world

    got = gather_world(phases_worker, world, phases, args, timeout=timeout, hard_exit=True)
    error = got.error
    if error is not None and got.failed_rank is not None:
        error = f"phase {len(got.parts[got.failed_rank])}, rank {got.failed_rank}: {error}"
    elif error is not None:
        error += f"; phases done: {[ph for ph in range(len(phases)) if got.complete(ph + 1)]}"
    return [got.parts[0][ph] if got.complete(ph + 1) else None for ph in range(len(phases))], error


# ---------------------------------------------------------------- summary

def executed_order(schedule: str, p: int, m: int, order: dict) -> dict:
    """The actions each rank runs. Interleaved and ZBV run their ``pipeline_order``; GPipe and 1F1B run
    their own loops (``_step_microbatches``): GPipe all forwards then all backwards, 1F1B min(m, p - s)
    forwards, then B/F alternating, then the remaining backwards. (torch's descriptive
    ``Schedule1F1B.pipeline_order`` lists micro-batches that do not exist, e.g. 1F4 at p = 2, m = 4.)"""
    if schedule == "gpipe":
        return {s: [(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)] for s in range(p)}
    if schedule == "1f1b":
        out = {}
        for s in range(p):
            w = min(m, p - s)
            acts = [(s, "F", i) for i in range(w)]
            for i in range(m - w):
                acts += [(s, "B", i), (s, "F", w + i)]
            out[s] = acts + [(s, "B", i) for i in range(m - w, m)]
        return out
    return order


def simulate(order: dict, p: int, v: int, tf: float, tbi: float, tw: float):
    """Torch's own action lists (``pipeline_order``) played with the benchmark's costs and free, instant
    communication: each rank runs its actions in order, each as soon as its inputs exist. Returns the step
    time and the bubble fraction that the schedule itself leaves, without any overhead."""
    S = p * v
    cost = {"F": tf / v, "B": (tbi + tw) / v, "I": tbi / v, "W": tw / v}
    acts = {int(r): [a for a in lst if a is not None and a[1] in cost] for r, lst in order.items()}
    pos, free, busy = {r: 0 for r in acts}, {r: 0.0 for r in acts}, {r: 0.0 for r in acts}
    done: dict = {}  # (stage, kind, mb) -> end time; (stage, "grad", mb): the stage's input gradient is ready

    def needs(s, kind, mb):
        if kind == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if kind == "W":
            return [(s, "I", mb)]
        return [(s, "F", mb)] + ([(s + 1, "grad", mb)] if s < S - 1 else [])

    def duration(s, kind):  # torch: stage 0's I is a no-op under ZBV, its W runs the whole backward
        if s == 0 and kind == "I":
            return 0.0
        return cost["B"] if s == 0 and kind == "W" else cost[kind]

    progress = True
    while progress:
        progress = False
        for r in acts:
            while pos[r] < len(acts[r]):
                s, kind, mb = acts[r][pos[r]]
                need = needs(s, kind, mb)
                if any(k not in done for k in need):
                    break
                start = max([free[r]] + [done[k] for k in need])
                free[r] = done[(s, kind, mb)] = start + duration(s, kind)
                if kind in ("B", "I"):
                    done[(s, "grad", mb)] = free[r]
                busy[r] += duration(s, kind)
                pos[r] += 1
                progress = True
    if any(pos[r] < len(acts[r]) for r in acts):
        return None, None
    T = max(free.values())
    return T, sum((T - b) / T for b in busy.values()) / len(busy)


def formula(schedule: str, p: int, m: int):
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule == "interleaved":
        return (p - 1) / (V[schedule] * m + p - 1), "(p-1)/(v*m+p-1)"
    return None, "- (beside 1F1B)"


def held_by_order(order: dict, v: int) -> float:
    """Most micro-batches' activations a rank holds by the action list alone (+1 at F, -1 at the full
    backward or at W; I keeps them), in whole-stage units (v virtual-stage micro-batches = 1)."""
    peak = 0
    for acts in order.values():
        live = 0
        for s, kind, mb in acts:
            live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, live)
    return peak / v


def expected_held(schedule: str, p: int, m: int, order: dict):
    """m for GPipe, p for 1F1B (min with m); interleaved and ZBV: what torch's action lists hold."""
    if schedule == "gpipe":
        return m, "m"
    if schedule == "1f1b":
        return min(p, m), "p"
    return held_by_order(order, V[schedule]), "order"


def summarise(rec: dict, tf: float, tbi: float, tw: float) -> dict:
    p, v, m = rec["p"], rec["v"], rec["m"]
    if "error" in rec:
        return {k: rec[k] for k in ("schedule", "p", "m", "v", "error")}
    bubbles, steps, busies = [], [], []
    for every in rec["steps"]:
        T = max(r["t1"] for r in every) - min(r["t0"] for r in every)
        busy = [sum(r["busy"].values()) for r in every]
        bubbles.append(statistics.mean((T - b) / T for b in busy))
        steps.append(T)
        busies.append(statistics.mean(busy))
    i = sorted(range(len(bubbles)), key=bubbles.__getitem__)[len(bubbles) // 2]  # the median step
    f, expr = formula(rec["schedule"], p, m)
    order = executed_order(rec["schedule"], p, m, rec["order"])
    sim_T, sim_bubble = simulate(order, p, v, tf, tbi, tw)
    held, held_why = expected_held(rec["schedule"], p, m, {r: [a for a in acts if a] for r, acts in order.items()})
    every = rec["steps"][i]
    held_per_rank = [r["peak_markers"] / v for r in every]  # in whole-stage micro-batches
    out = {"schedule": rec["schedule"], "p": p, "m": m, "v": v,
           "step_ms": 1e3 * steps[i], "busy_ms": 1e3 * busies[i],
           "busy_over_nominal": busies[i] / (m * (tf + tbi + tw)),
           "busy_split_ms": {k: 1e3 * statistics.mean(r["busy"].get(k, 0.0) for r in every) for k in "FBW"},
           "bubble": bubbles[i], "bubbles_all": bubbles, "formula": f, "formula_expr": expr,
           "ratio": None if f is None else bubbles[i] / f,
           "sim_bubble": sim_bubble, "sim_step_ms": None if sim_T is None else 1e3 * sim_T,
           "held_per_rank": held_per_rank, "held_max": max(held_per_rank),
           "held_expected": held, "held_expected_from": held_why,
           "held_peak_mb_per_rank": [r["peak_markers"] * MARK_ELEMS * 4 / 2**20 for r in every],
           "markers_left_after_step": sum(r["live_after"] for r in every),
           "warmup_step_ms": 1e3 * rec["warmup_step_s"]}
    return out


def table(rows: list) -> str:
    one_f1b = {(r["p"], r["m"]): r["bubble"] for r in rows if r["schedule"] == "1f1b" and "bubble" in r}
    lines = ["| schedule | p | v | m | step ms | busy ms / stage | measured bubble | formula | formula value "
             "| measured / formula | torch's order, simulated | step - simulated ms | 1F1B measured (same p, m) "
             "| peak micro-batches held: max (per stage) | expected held |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | refused: {r['error']} "
                         "| | | | | | | | | | |")
            continue
        f = "-" if r["formula"] is None else f"{r['formula']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        sim = "-" if r["sim_bubble"] is None else f"{r['sim_bubble']:.3f}"
        extra = "-" if r["sim_step_ms"] is None else f"{r['step_ms'] - r['sim_step_ms']:.0f}"
        ref = f"{one_f1b[(r['p'], r['m'])]:.3f}" if r["schedule"] == "zbv" and (r["p"], r["m"]) in one_f1b else "-"
        per = " / ".join(f"{h:g}" for h in r["held_per_rank"])
        exp = f"{r['held_expected']:g} ({r['held_expected_from']})"
        lines.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['step_ms']:.0f} | {r['busy_ms']:.0f} "
                     f"| {r['bubble']:.3f} | {r['formula_expr']} | {f} | {ratio} | {sim} | {extra} | {ref} "
                     f"| {r['held_max']:g} ({per}) | {exp} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tf", type=float, default=0.1, help="forward seconds per stage and micro-batch")
    ap.add_argument("--tbi", type=float, default=0.1, help="input-gradient seconds per stage and micro-batch")
    ap.add_argument("--tw", type=float, default=0.1, help="weight-gradient seconds per stage and micro-batch")
    ap.add_argument("--blocks", type=int, default=1, help="blocks per (virtual) stage, sharing its costs")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--ps", default="2,4", help="pipeline sizes")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per world before calling it a hang")
    ap.add_argument("--no-probe", action="store_true", help="skip the micro-batch-count probe")
    ap.add_argument("--out", default=None, help="write the JSON here (e.g. bench/pipeline.json)")
    a = ap.parse_args()
    args = {"tf": a.tf, "tbi": a.tbi, "tw": a.tw, "blocks": a.blocks, "repeats": a.repeats, "p2p_timeout": 60}
    schedules = [s for s in a.schedules.split(",") if s]
    rows, raw, failures, probes = [], [], {}, []
    t_start = time.perf_counter()
    for p in [int(x) for x in a.ps.split(",")]:
        phases = [(world_worker, [(s, m) for m in (p, 4 * p) for s in schedules])]
        if not a.no_probe:  # in the same process group, after the measured cases
            edge = sorted({1, p - 1, p + 1, 2 * p - 1, 2 * p + 1} - {0})
            phases.append((probe_worker, [(s, m) for s in schedules for m in edge]))
        t0 = time.perf_counter()
        args["t_launch"] = time.time()
        (recs, *probe), err = run_phases(phases, p, args, a.timeout)
        print(f"p={p}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if err:
            failures[p] = err
            print(f"p={p} FAILED: {err}", file=sys.stderr)
        if recs:
            raw += recs
            rows += [summarise(r, a.tf, a.tbi, a.tw) for r in recs]
        if probe:
            probes += probe[0] if probe[0] else [{"p": p, "result": f"probe failed: {err}"}]
    order = {s: i for i, s in enumerate(SCHEDULES)}
    rows.sort(key=lambda r: (r["p"], r["m"], order[r["schedule"]]))
    md = table(rows)
    print(md)
    if probes:
        print("\nmicro-batch counts off the grid (one step, 1 ms costs):")
        for r in probes:
            print(f"  p={r.get('p')} {r.get('schedule', '')} m={r.get('m', '')}: {r['result']}")
    for p, err in failures.items():
        print(f"\np={p} failed: {err}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if a.out:
        import torch

        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(),
                "tf": a.tf, "tbi": a.tbi, "tw": a.tw, "blocks": a.blocks, "repeats": a.repeats,
                "marker_bytes": MARK_ELEMS * 4}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows, "probes": probes,
                                           "failures": failures, "raw": raw}, indent=1, default=str))
        print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
