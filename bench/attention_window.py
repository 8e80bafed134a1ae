"""Sliding-window attention's cost against sequence length at a fixed window: the Triton kernels' tiles, and
their time (the interpreter on CPU, compiled on a GPU when there is one).

Two parts:

- ``tiles``: the (query tile, key tile) products the three Triton kernels (forward, dK/dV, dQ) compute
  for causal attention of one head, with and without a window, from the kernels' own loop bounds
  (:func:`tile_visits` follows ``key_loop_bounds`` and the dK/dV kernel's query loop) at the GPU tiles the
  launchers pick for bf16, head dim 128 (``flash_attention._GPU_FWD`` / ``_GPU_DKDV`` / ``_GPU_DQ``, entry 0). FLOPs are
  4 D per score in the forward and 10 D in the backward (dK/dV: S, dV, dP, dK; dQ: S, dP, dQ), counted
  over whole tiles, as the kernels compute them.
- ``time``: the kernels forward + backward, windowed and plain causal at each length in the same run; the
  figure that counts is the ratio (windowed / causal) and the windowed time per token against the shortest
  length's, not the seconds (the interpreter runs programs one after another in numpy, so its time follows
  the tiles visited; the machine is shared). On a GPU (``--device cuda``) the lengths and the window grow.

    python bench/attention_window.py [--parts tiles time] [--window 4096] [--out bench/attention_window.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import timeit
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages (see bench/checkpoint.py)

TILE_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
HEAD_DIM = 128


def gpu_tiles(window: bool, head_dim: int = HEAD_DIM) -> tuple:
    """((BLOCK_M, BLOCK_N) of the forward, of the dK/dV kernel, of the dQ kernel) the launchers use for 2-byte
    dtypes at ``head_dim`` (entry 0 of each row; a windowed forward takes ``_GPU_FWD_DOCS``'s where it has one)."""
    import importlib

    fa = importlib.import_module("cuboid.kernels.flash_attention")
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    limit, fwd = next((limit, c) for limit, c in fa._GPU_FWD[2] if block_d <= limit)
    if window:
        fwd = fa._GPU_FWD_DOCS.get((2, limit), fwd)
    dkdv = next(c for limit, c in fa._GPU_DKDV[2] if block_d <= limit)
    dq = next(c for limit, c in fa._GPU_DQ[2] if block_d <= limit)
    return fwd[0][:2], dkdv[0][:2], dq[0][:2]


def tile_visits(S: int, window, fwd: tuple, dkdv: tuple, dq: tuple) -> dict:
    """Tile products per kernel for causal self-attention of one head, sequence ``S``: the loop bounds of the
    kernels (no documents, no padding; ``window`` None or an int)."""
    win_lo = None if window is None or window >= S else 1 - window  # check_window's bound (Sq == Sk)

    def key_loops(bm, bn):  # the forward and dQ kernels: key tiles per query tile
        n = 0
        for start_m in range(0, S, bm):
            lo, hi = 0, min(S, start_m + bm)
            if win_lo is not None:
                lo = max(lo, max(start_m + win_lo, 0) // bn * bn)
            n += max(0, math.ceil((hi - lo) / bn))
        return n

    def query_loops(bm, bn):  # the dK/dV kernel: query tiles per key tile
        n = 0
        for start_n in range(0, S, bn):
            lo, hi = start_n // bm * bm, S
            if win_lo is not None:
                hi = min(hi, min(start_n + bn, S) - win_lo)
            n += max(0, math.ceil((hi - lo) / bm))
        return n

    f, n_dq, n_dkdv = key_loops(*fwd), key_loops(*dq), query_loops(*dkdv)
    scores_f, scores_b = f * fwd[0] * fwd[1], n_dq * dq[0] * dq[1] + n_dkdv * dkdv[0] * dkdv[1]
    return dict(fwd_tiles=f, dq_tiles=n_dq, dkdv_tiles=n_dkdv, fwd_scores=scores_f, bwd_scores=scores_b,
                flops=4 * HEAD_DIM * scores_f + 5 * HEAD_DIM * scores_b)


def part_tiles(window: int) -> list:
    (fwd_w, dkdv, dq), (fwd, _, _) = gpu_tiles(True), gpu_tiles(False)
    rows = []
    for S in TILE_LENGTHS:
        w, c = tile_visits(S, window, fwd_w, dkdv, dq), tile_visits(S, None, fwd, dkdv, dq)
        rows.append(dict(seq=S, window=window, fwd_block=fwd, fwd_block_window=fwd_w, dkdv_block=dkdv,
                         dq_block=dq, windowed=w,
                         causal=c,
                         ratio=w["flops"] / c["flops"]))
    for r in rows:
        r["windowed_flops_per_token"] = r["windowed"]["flops"] / r["seq"]
        r["causal_flops_per_token"] = r["causal"]["flops"] / r["seq"]
    return rows


def _time(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``."""
    return statistics.median(timeit.repeat(fn, number=1, repeat=reps))


def part_time(device: str, window: int, lengths, reps: int) -> list:
    import torch

    from cuboid.kernels.flash_attention import attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    D = HEAD_DIM if device == "cuda" else 16
    B, H, Hkv = (1, 16, 4) if device == "cuda" else (1, 1, 1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for S in lengths:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
        k, v = (torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
                for _ in range(2))
        go = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g)

        def step(w):
            def run():
                out = attention(q, k, v, causal=True, window=w, backend="triton")
                torch.autograd.grad(out, (q, k, v), go)
                sync()
            return run

        step(window)()  # warm-up (compiles on a GPU)
        step(None)()
        tw, tc = _time(step(window), reps), _time(step(None), reps)
        rows.append(dict(seq=S, window=window, device=device, windowed_s=tw, causal_s=tc, ratio=tw / tc))
    base = rows[0]["windowed_s"] / rows[0]["seq"]
    for r in rows:
        r["windowed_time_per_token_vs_first"] = r["windowed_s"] / r["seq"] / base
    return rows


def print_tables(result: dict) -> None:
    if "tiles" in result:
        r0 = result["tiles"][0]
        print(f"\nTiles the Triton kernels visit, causal, one head, d{HEAD_DIM}, window {r0['window']}, forward "
              f"{r0['fwd_block_window'][0]}x{r0['fwd_block_window'][1]} (window) / {r0['fwd_block'][0]}x"
              f"{r0['fwd_block'][1]} (causal), dK/dV {r0['dkdv_block'][0]}x{r0['dkdv_block'][1]}, dQ "
              f"{r0['dq_block'][0]}x{r0['dq_block'][1]}")
        print("| seq | fwd tiles (window / causal) | dK/dV + dQ tiles (window / causal) | GFLOP window | "
              "GFLOP causal | window / causal | MFLOP per token, window | MFLOP per token, causal |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in result["tiles"]:
            w, c = r["windowed"], r["causal"]
            print(f"| {r['seq']} | {w['fwd_tiles']} / {c['fwd_tiles']} | {w['dkdv_tiles'] + w['dq_tiles']} / "
                  f"{c['dkdv_tiles'] + c['dq_tiles']} | {w['flops'] / 1e9:.1f} | {c['flops'] / 1e9:.1f} | "
                  f"{r['ratio']:.3f} | {r['windowed_flops_per_token'] / 1e6:.1f} | "
                  f"{r['causal_flops_per_token'] / 1e6:.1f} |")
    if "time" in result:
        r0 = result["time"][0]
        print(f"\nForward + backward time, {r0['device']}, window {r0['window']} against plain causal (same run)")
        print("| seq | window s | causal s | window / causal | window time per token vs first |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in result["time"]:
            print(f"| {r['seq']} | {r['windowed_s']:.3f} | {r['causal_s']:.3f} | {r['ratio']:.3f} | "
                  f"{r['windowed_time_per_token_vs_first']:.3f} |")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["tiles", "time"], choices=["tiles", "time"])
    ap.add_argument("--window", type=int, default=4096, help="the tiles part's window (default 4096)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="the time part's device (default: cuda when there is one, else the interpreter on CPU)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="the time part's sequence lengths (default: 256..2048 on CPU, 8192..65536 on a GPU)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated (first import)
    result = {}
    if "tiles" in args.parts:
        result["tiles"] = part_tiles(args.window)
    if "time" in args.parts:
        if device == "cuda":
            result["time"] = part_time("cuda", 4096, args.lengths or (8192, 16384, 32768, 65536), args.reps)
        else:
            result["time"] = part_time("cpu", 128, args.lengths or (256, 512, 1024, 2048), args.reps)
    print_tables(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
