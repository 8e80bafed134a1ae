"""A QLoRA step on this machine: cuboid's 4-bit NF4 base + LoRA against cuboid's bf16 LoRA and against
transformers + bitsandbytes + peft on the same Llama-shaped model, one run each; and the quantized weights'
bytes against the formula.

Each variant runs in a fresh process (``--variant``): it loads the model from one bf16 folder, takes
``--steps`` AdamW steps of LoRA r=16 on every block linear (batch x seq random tokens), and reports its peak
anonymous memory growth (``RssAnon`` sampled in a thread from before the load: mapped file pages are page
cache, not the process's) and tokens/s over the steps after the first. On CPU the compute dtype is fp32 for
the two 4-bit variants (bitsandbytes' ``bnb_4bit_compute_dtype``) and bf16 for the bf16 LoRA; on a GPU all
compute in bf16.

Bytes: an NF4 weight of n values with double quantization holds n/2 bytes of codes, n/64 one-byte scale codes,
n/16384 fp32 second-level scales, a 16- and a 256-entry fp32 table and an fp32 offset: about 0.516 bytes a
parameter (4.13 bits).

    python bench/qlora.py [--hidden 1024] [--layers 4] [--steps 4] [--out bench/qlora.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages (see bench/checkpoint.py)

MB = 1 << 20
VARIANTS = ("cuboid-qlora", "cuboid-lora-bf16", "hf-bnb-peft")


def rss_anon() -> int:
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class Peak:
    def __init__(self):
        self.base = self.peak = rss_anon()
        self.stop_ = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop_.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(1e-3)

    def stop(self) -> int:
        self.stop_.set()
        self.t.join()
        return max(self.peak, rss_anon()) - self.base


def make_folder(root: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="64MB")
    return root / "bf16"


def nf4_formula(n: int) -> float:
    """Bytes of one NF4 weight of n values with double quantization (bitsandbytes' layout)."""
    blocks = -(-n // 64)
    return (n + 1) // 2 + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256 + 1)


def run_variant(variant: str, folder: str, steps: int, batch: int, seq: int) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    compute = torch.bfloat16 if cuda or variant == "cuboid-lora-bf16" else torch.float32
    torch.manual_seed(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    peak = Peak()
    out = {"variant": variant, "device": device, "compute": str(compute).replace("torch.", "")}
    if variant.startswith("cuboid"):
        import cuboid
        from cuboid.parallel.quant import quantized_layers

        quant = "nf4" if variant == "cuboid-qlora" else None
        model = cuboid.load(folder, dtype=compute, device=device, quantize=quant,
                            lora="r=16,alpha=32,targets=attn+mlp").train()
        if quant:
            layers = quantized_layers(model)
            out["nf4_bytes"] = sum(b.numel() * b.element_size() for _, m in layers for b in m.buffers(recurse=False))
            out["nf4_formula_bytes"] = sum(nf4_formula(m.nf4_weight().numel) for _, m in layers)
            out["nf4_params"] = sum(m.nf4_weight().numel for _, m in layers)
        vocab = model.config.vocab_size

        def loss_of(x):
            return model(x, labels=x).loss
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import BitsAndBytesConfig, LlamaForCausalLM

        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=compute)
        model = LlamaForCausalLM.from_pretrained(folder, quantization_config=bnb, device_map=device, dtype=compute)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).train()
        vocab = model.config.vocab_size

        def loss_of(x):
            return model(input_ids=x, labels=x).loss
    out["load_s"] = time.perf_counter()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        t0 = time.perf_counter()
        loss_of(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["peak_anon_mb"] = peak.stop() / MB
    if cuda:
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / MB
    out["step_s"] = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    out["tokens_per_s"] = batch * seq / out["step_s"]
    out.pop("load_s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).with_name("qlora.json")))
    ap.add_argument("--variant", choices=VARIANTS, help="(internal) run one variant in this process")
    ap.add_argument("--folder", help="(internal) the bf16 folder")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.folder, args.steps, args.batch, args.seq)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), args.hidden, args.layers)
        rows = []
        for v in VARIANTS:
            p = subprocess.run([sys.executable, __file__, "--variant", v, "--folder", str(folder), "--steps",
                                str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)],
                               capture_output=True, text=True, cwd=tempfile.gettempdir())
            if p.returncode:
                raise SystemExit(f"{v} failed:\n{p.stderr[-3000:]}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    result = {"hidden": args.hidden, "layers": args.layers, "batch": args.batch, "seq": args.seq,
              "steps": args.steps, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()[0], "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"| variant | device | compute | peak anon growth (MB) | tokens/s |")
    print("| --- | --- | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['device']} | {r['compute']} | {r['peak_anon_mb']:.0f} | {r['tokens_per_s']:.0f} |")
    q = rows[0]
    print(f"NF4 bytes {q['nf4_bytes']} for {q['nf4_params']} parameters ({q['nf4_bytes'] / q['nf4_params']:.4f} "
          f"B/param); formula {q['nf4_formula_bytes']:.0f}")


if __name__ == "__main__":
    main()
