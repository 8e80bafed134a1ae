"""bench/gpu.py's report of the kernel parts: the comparison plan, the tables, the skipped anchors, the header."""
from __future__ import annotations

import datetime

import torch
import triton

from gpu_common import GPU, NOTES, PEAKS, fmt, markdown


def print_plan(anchors: dict, peaks: tuple) -> list:
    """Every comparison a GPU run makes, at the GPU sizes, with each anchor's availability; returns the lines."""
    def avail(name):
        return f"{name} [{'runs' if anchors[name].fn is not None else 'skipped'}]"
    g = GPU
    lines = ["checks (bf16, fp16, fp32 vs the torch references): attention d" +
             "/".join(map(str, g["attn_check"]["dims"])) + f" s{g['attn_check']['s']} causal x mask; layer_norm and "
             f"rms_norm {g['norm_check']['rows']}x" + "/".join(map(str, g["norm_check"]["hidden"])) +
             " +residual; rope d" + "/".join(map(str, g["rope_check"]["dims"])) + f" s{g['rope_check']['s']} "
             f"h{g['rope_check']['h']}/{g['rope_check']['hkv']}; swiglu {g['swiglu_check']['rows']}x" +
             "/".join(map(str, g["swiglu_check"]["widths"])) + " chunked; linear_cross_entropy "
             f"{g['lce_check']['rows']}x{g['lce_check']['hidden']} vocab " +
             "/".join(map(str, g["lce_check"]["vocabs"])) + " vs the unfused head; AdamW, LAMB, LARS x3 steps"]
    for s in g["attn_seqs"]:
        for d in g["attn_dims"]:
            b, h = max(1, g["attn_tokens"] // s), max(1, g["attn_width"] // d)
            for causal in (False, True):
                lines.append(f"attention fwd+bwd b{b} h{h} s{s} d{d} {'causal' if causal else 'full'} bf16, TFLOP/s: "
                             f"cuboid vs {avail('sdpa flash')}, {avail('flash-attn 2')}")
    for M, n in g["norm_shapes"]:
        lines.append(f"layer_norm fwd+bwd {M}x{n} bf16, GB/s: cuboid vs F.layer_norm, {avail('liger layer_norm')}")
        lines.append(f"rms_norm fwd+bwd {M}x{n} bf16, GB/s: cuboid vs F.rms_norm, {avail('liger rms_norm')}")
    for b, s, h, hkv, d in g["rope_shapes"]:
        lines.append(f"rope fwd+bwd b{b} s{s} h{h}/{hkv} d{d} bf16, GB/s: cuboid vs {avail('liger rope')}, "
                     "torch (HF formula)")
    for M, n in g["swiglu_shapes"]:
        lines.append(f"swiglu fwd+bwd {M}x{n} bf16, GB/s: cuboid vs {avail('liger swiglu')}, F.silu(g) * u")
    for N, H, V in g["lce_shapes"]:
        lines.append(f"linear_cross_entropy fwd+bwd {N} tokens x {H} -> {V} bf16, TFLOP/s and GiB peak: cuboid vs "
                     f"{avail('liger fused linear CE')}, unfused (F.linear + fp32 F.cross_entropy)")
    lines.append(f"AdamW step 1.0B params fp32, GB/s and ms: cuboid vs {avail('torch fused AdamW')}; "
                 "LAMB, LARS vs cuboid's torch._foreach reference")
    t = g["tune"]
    lines.append(f"tune: every autotune entry of attention (b{t['attn']['b']} h{t['attn']['h']} s{t['attn']['s']} d" +
                 "/".join(map(str, t["attn"]["dims"])) + f" causal), norm (rms {t['norm'][0]}x{t['norm'][1]}), "
                 f"rope, swiglu ({t['swiglu'][0]}x{t['swiglu'][1]}), optim (AdamW), grouped_mm "
                 f"({t['grouped_mm'][0]} rows, "
                 f"{t['grouped_mm'][1]} groups, {t['grouped_mm'][3]} -> {t['grouped_mm'][2]}): ms, and outputs vs "
                 "entry 0")
    lines.append("ceilings: copy_ of 1 GiB (GB/s), bf16 matmul 8192^3 (TFLOP/s); datasheet peaks by device name: " +
                 ", ".join(f"{k} {tf:g} TFLOP/s {gb:g} GB/s" for k, tf, gb in PEAKS))
    lines += [f"{a.name}: {'available' if a.fn is not None else 'skipped'}"
              f"{' (' + a.version + ')' if a.version else ''}{': ' + a.why if a.why else ''}"
              for a in anchors.values()]
    print("\n== plan: the comparisons a GPU run makes (GPU sizes), then the anchors")
    for line in lines:
        print(f"  - {line}")
    return lines


def print_table(header: str, rows: list, ceil: dict, dry: bool) -> None:
    print(f"\n{header}\n")
    if dry:
        print("**DRY RUN: CPU, Triton interpreter, perf_counter timer: every figure below is meaningless.**\n")
    print(f"Ceilings: copy_ {ceil['copy_GBps']:.0f} GB/s (read+write, {ceil['copy_bytes'] / 2**30:.3g} GiB); "
          f"bf16 matmul {ceil['matmul_n']}^3 {ceil['matmul_bf16_TFLOPs']:.1f} TFLOP/s\n")
    markdown("kernel | size | unit | cuboid: | peer: | peer name | cuboid/peer: | of ceiling: | of peak:",
             ([r.kernel, r.size, r.unit, fmt(r.cuboid, 2 if r.unit == "ms" else 1),
               fmt(r.peer, 2 if r.unit == "ms" else 1), r.peer_name, fmt(r.speedup, 2), fmt(r.fraction, 2),
               fmt(r.of_peak, 2)] for r in rows))
    print()
    for note in NOTES:
        print(f"- {note}")


def print_skipped(skipped: list) -> None:
    """One line per (anchor, reason), with the comparisons it missed counted."""
    if not skipped:
        return
    counts: dict = {}
    for line in skipped:
        what, _, why = line.partition(" vs ")
        counts.setdefault(why, []).append(what)
    print("\nanchors skipped:")
    for why, whats in counts.items():
        print(f"  {why} ({len(whats)} comparison{'s' if len(whats) > 1 else ''}, e.g. {whats[0]})")


def print_tune(tune_rows: list) -> None:
    if not tune_rows:
        return
    print("\nautotune lists (entry 0 is the launcher's choice; * marks the fastest fwd + bwd):\n")
    markdown("op | size | entry: | config | fwd ms: | bwd ms: | err/tol vs entry 0:",
             ([r.op, r.size, f"{r.entry}{' *' if r.best else ''}", r.config, fmt(r.fwd_ms, 3), fmt(r.bwd_ms, 3),
               fmt(r.ratio, 3)] for r in tune_rows))


def header_line(dry: bool) -> str:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    gpu = "CPU (dry run, TRITON_INTERPRET=1)" if dry else torch.cuda.get_device_name()
    cuda = "" if dry else f" | CUDA {torch.version.cuda}"
    return f"cuboid bench/gpu.py | {date} | {gpu} | torch {torch.__version__} | triton {triton.__version__}{cuda}"
