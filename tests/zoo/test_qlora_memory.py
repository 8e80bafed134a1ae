"""``cuboid.load(folder, quantize="nf4")`` quantizes while it reads: loading a sharded bf16 Llama folder raises the
process's peak anonymous memory (``RssAnon``, sampled in a thread: mapped file pages are page cache, not the
process's) by the 4-bit model plus one tensor's temporaries, well under half the bf16 weights' bytes; a reader
that held the bf16 model (78 MB of linears) fails the bound."""
import json

import torch

import cuboid
from cuboid.parallel.quant import quantized_layers

from ..checkpoint.test_load_memory import AnonPeak, warm_up

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


def test_quantize_while_reading_keeps_the_peak_small(tmp_path):
    bf16_bytes = write_folder(tmp_path)
    warm_up()
    peak = AnonPeak()
    model = cuboid.load(tmp_path, quantize="nf4", dtype=torch.bfloat16)
    peak.stop()
    layers = quantized_layers(model)
    assert len(layers) == 7 * LAYERS
    four_bit = sum(b.numel() * b.element_size() for _, m in layers for b in m.buffers(recurse=False))
    assert 0.25 * bf16_bytes < four_bit < 0.27 * bf16_bytes  # about 0.52 bytes a parameter with double quant
    growth = peak.peak - peak.base
    print(f"bf16 block linears {bf16_bytes / MB:.1f} MB, 4-bit {four_bit / MB:.1f} MB, peak growth "
          f"{growth / MB:.1f} MB")
    assert growth < 0.45 * bf16_bytes, (growth / MB, bf16_bytes / MB)
