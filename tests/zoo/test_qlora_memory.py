"""``cuboid.load(folder, quantize="nf4")`` quantizes while it reads: loading a sharded bf16 Llama folder raises the
process's peak anonymous memory (``RssAnon``, sampled in a thread: mapped file pages are page cache, not the
process's) by the 4-bit model plus one tensor's temporaries, well under half the bf16 weights' bytes; a reader
that held the bf16 model (78 MB of linears) fails the bound."""
import json

import torch

MB = 1 << 20
H, I, LAYERS, VOCAB = 512, 1536, 12, 1024  # 40M block-linear parameters: 80 MB of bf16


def write_folder(root):
    """A Llama folder of random bf16 tensors in 3 safetensors shards with transformers' index (no model built)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                        p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (H, H),
                        p + "self_attn.v_proj.weight": (H, H), p + "self_attn.o_proj.weight": (H, H),
                        p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                        p + "mlp.down_proj.weight": (H, I)})
    names = list(tensors)
    weight_map, shards = {}, [names[k::3] for k in range(3)]
    for k, part in enumerate(shards):
        file = f"model-0000{k + 1}-of-00003.safetensors"
        save_file({n: (torch.randn(tensors[n], generator=g) * 0.02).to(torch.bfloat16) for n in part},
                  str(root / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=I,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8, vocab_size=VOCAB,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16")))
    return sum(torch.Size(s).numel() for n, s in tensors.items() if "_proj" in n) * 2


_CHILD = """
import json, sys, torch
from tests.checkpoint.test_load_memory import AnonPeak, warm_up
import cuboid
from cuboid.parallel.quant import quantized_layers
warm_up()
peak = AnonPeak()
model = cuboid.load(sys.argv[1], quantize="nf4", dtype=torch.bfloat16)
peak.stop()
layers = quantized_layers(model)
print(json.dumps({"layers": len(layers), "growth": peak.peak - peak.base, "four_bit": sum(
    b.numel() * b.element_size() for _, m in layers for b in m.buffers(recurse=False))}))
"""


def test_quantize_while_reading_keeps_the_peak_small(tmp_path):
    """The load runs in a fresh process (nothing freed earlier for the allocator to hand back) with glibc's mmap
    threshold fixed (its dynamic threshold otherwise keeps freed temporaries in the heap, counted as resident)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bf16_bytes = write_folder(tmp_path)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(root), TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["layers"] == 7 * LAYERS
    assert 0.25 * bf16_bytes < r["four_bit"] < 0.27 * bf16_bytes  # about 0.52 bytes a parameter with double quant
    print(f"bf16 block linears {bf16_bytes / MB:.1f} MB, 4-bit {r['four_bit'] / MB:.1f} MB, peak growth "
          f"{r['growth'] / MB:.1f} MB")
    assert r["growth"] < 0.45 * bf16_bytes, (r["growth"] / MB, bf16_bytes / MB)
