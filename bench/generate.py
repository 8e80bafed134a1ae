"""Greedy generation on CPU: cuboid's key/value cache against transformers' ``generate``, same model and prompts.

A Llama-shaped model (grouped-query attention) at batch 1 and 8, prompts of 128 and 512 tokens, 128 new
tokens; the two run alternately so machine noise hits both. Prints tokens per second and their ratio
(cuboid / transformers, > 1: cuboid faster) and the cache's bytes against ``2 x layers x kv_heads x head_dim x
tokens x bytes``; writes JSON.

    python bench/generate.py [--new 128] [--repeats 3] [--out bench/generate.json]
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

CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024)


def cache_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for m in model.modules() if type(m).__name__ == "CachedAttention"
               for t in (m.k, m.v) if t is not None)


def run(new: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**CONFIG)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = cuboid.load(d).eval()
    rows = []
    for batch in (1, 8):
        for prompt in (128, 512):
            ids = torch.randint(0, CONFIG["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
            mask = torch.ones_like(ids)
            held = {}

            def watch(_tokens):
                held["bytes"] = cache_bytes(ours)

            times = {"hf": [], "cuboid": []}
            for i in range(repeats + 1):
                for name in ("hf", "cuboid"):
                    t0 = time.perf_counter()
                    if name == "hf":
                        out_hf = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                             min_new_tokens=new, pad_token_id=0, eos_token_id=None)
                    else:
                        out = ours.generate(ids, mask, max_new_tokens=new, streamer=watch)
                    if i:
                        times[name].append(time.perf_counter() - t0)
            same = torch.equal(out, out_hf)
            med = {k: statistics.median(v) for k, v in times.items()}
            tokens = batch * new
            expected = 2 * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"] * (
                CONFIG["hidden_size"] // CONFIG["num_attention_heads"]) * batch * (prompt + new - 1) * 4
            row = {"batch": batch, "prompt": prompt, "new": new, "hf_tok_s": tokens / med["hf"],
                   "cuboid_tok_s": tokens / med["cuboid"], "ratio_cuboid_over_hf": med["hf"] / med["cuboid"],
                   "same_tokens": same, "cache_bytes": held.get("bytes", 0), "cache_formula_bytes": expected}
            rows.append(row)
            print(f"batch {batch} prompt {prompt}: hf {row['hf_tok_s']:.0f} tok/s, cuboid {row['cuboid_tok_s']:.0f} "
                  f"tok/s, cuboid/hf {row['ratio_cuboid_over_hf']:.2f}, same tokens {same}, cache "
                  f"{row['cache_bytes']} B (formula {expected})", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/generate.json")
    args = ap.parse_args()
    rows = run(args.new, args.repeats)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| batch | prompt | HF tok/s | cuboid tok/s | cuboid/HF | same tokens | cache bytes (formula) |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in rows:
        print(f"| {r['batch']} | {r['prompt']} | {r['hf_tok_s']:.0f} | {r['cuboid_tok_s']:.0f} | "
              f"{r['ratio_cuboid_over_hf']:.2f} | {r['same_tokens']} | {r['cache_bytes']} ({r['cache_formula_bytes']}) |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                          "config": CONFIG, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
