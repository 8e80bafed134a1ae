"""Median CPU training step (forward, backward, AdamW) of each zoo model vs transformers.

Same config, same weights, same batch, same threads, same process; the two
models are timed alternately so machine noise hits both. Prints HF/cuboid per
model (> 1 means cuboid is faster) and writes JSON.

    python bench/train_step.py [--sizes small medium] [--models gpt llama] [--steps 10] [--out bench/train_step.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

import cuboid
from cuboid.parallel.optim import AdamW

SIZES = {
    # name: (dim, layers, heads, mlp, seq/image, batch)
    "small": dict(dim=128, layers=2, heads=4, mlp=512, seq=128, image=64, patch=8, batch=8),
    "medium": dict(dim=384, layers=4, heads=6, mlp=1536, seq=256, image=128, patch=16, batch=8),
}


def hf_model(family: str, s: dict):
    drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "gpt":
        cfg = T.GPT2Config(n_embd=s["dim"], n_layer=s["layers"], n_head=s["heads"], n_inner=s["mlp"],
                           vocab_size=8192, n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return T.GPT2LMHeadModel(cfg)
    if family == "bert":
        cfg = T.BertConfig(hidden_size=s["dim"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                           intermediate_size=s["mlp"], vocab_size=8192, max_position_embeddings=s["seq"], **drop)
        return T.BertForMaskedLM(cfg)
    if family == "llama":  # grouped-query attention (heads / 2 key/value heads), SwiGLU, RMSNorm, RoPE
        cfg = T.LlamaConfig(hidden_size=s["dim"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            num_key_value_heads=s["heads"] // 2, intermediate_size=s["mlp"], vocab_size=8192,
                            max_position_embeddings=s["seq"])
        return T.LlamaForCausalLM(cfg)
    cfg = T.ViTConfig(hidden_size=s["dim"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      intermediate_size=s["mlp"], image_size=s["image"], patch_size=s["patch"], num_labels=100, **drop)
    return T.ViTForImageClassification(cfg)


def batch(family: str, s: dict):
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(s["batch"], 3, s["image"], s["image"], generator=g),
                "labels": torch.randint(0, 100, (s["batch"],), generator=g)}
    ids = torch.randint(0, 8192, (s["batch"], s["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def make_step(model, opt, data):
    def step():
        loss = model(**data).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return step


FAMILIES = ("gpt", "bert", "vit", "llama")


def run(sizes, steps: int, families=FAMILIES, warmup: int = 2) -> list[dict]:
    rows = []
    for size in sizes:
        s = SIZES[size]
        for family in families:
            torch.manual_seed(0)
            hf = hf_model(family, s).train()
            with tempfile.TemporaryDirectory() as d:
                hf.save_pretrained(d)
                ours = cuboid.load(d).train()
            data = batch(family, s)
            step_hf = make_step(hf, torch.optim.AdamW(hf.parameters(), lr=1e-4), data)
            step_ours = make_step(ours, AdamW(ours.parameters(), lr=1e-4), data)
            times = {"hf": [], "cuboid": []}
            for i in range(warmup + steps):
                for name, fn in (("hf", step_hf), ("cuboid", step_ours)):
                    t0 = time.perf_counter()
                    fn()
                    if i >= warmup:
                        times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"model": family, "size": size, "params": sum(p.numel() for p in ours.parameters()),
                         "hf_ms": med["hf"] * 1e3, "cuboid_ms": med["cuboid"] * 1e3,
                         "ratio_hf_over_cuboid": med["hf"] / med["cuboid"]})
            print(f"{family:5s} {size:7s} hf {med['hf'] * 1e3:8.1f} ms  cuboid {med['cuboid'] * 1e3:8.1f} ms  "
                  f"HF/cuboid {med['hf'] / med['cuboid']:.2f}", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--models", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="bench/train_step.json")
    args = ap.parse_args()
    rows = run(args.sizes, args.steps, args.models)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} steps\n")
    print("| model | size | params | HF ms | cuboid ms | HF/cuboid |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['size']} | {r['params']:,} | {r['hf_ms']:.1f} | {r['cuboid_ms']:.1f} | "
              f"{r['ratio_hf_over_cuboid']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                          "steps": args.steps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
