"""`cuboid finetune --quantize nf4 --lora` under the plans, through the command line (``cuboid.cli.main``): one
device's run, then one 2-rank world running ``--plan dp=2``, ``dp=2,zero=3``, ``tp=2`` and ``pp=2`` in sequence
(a fresh output folder each), gives the same adapters in final/ (1e-5 relative, each tensor); peft reads one
device's adapters onto a transformers + bitsandbytes 4-bit base with the logits of ``cuboid.load(final/,
quantize="nf4")`` (1e-4), which loads the base final/'s adapter config names with the adapters on.

The runs train with LARS (``--optimizer lars``: lr x g where a weight is 0, lora_B's first step, then a per-tensor
trust ratio), whose step is linear in the gradient: AdamW's per-element g / (|g| + eps), eps 1e-8 in the CLI,
turns the rounding noise of an element whose gradient is near zero into a move of up to lr (measured: one
AdamW step at lr 1e-2 left layer 0's o_proj lora_B 1.8e-3 relative from one device's under dp=2, the other
tensors within 1e-7; two steps 1.8e-4 overall under dp, ZeRO-3 and pp, 3.4e-3 under tp).

The model is a tiny Llama folder (hidden 128, 4 heads of 32, 2 key/value heads, MLP 256, fp32) with a local
BPE tokenizer: tp=2's row cuts keep 64 and 128 input columns a rank, whole NF4 blocks of 64.
"""
import json
from pathlib import Path

import torch

from tests import bnb_cpu
from tests.front import fixtures as F

from .launch import run_world

PLANS = ("dp=2", "dp=2,zero=3", "tp=2", "pp=2,microbatches=2")
TOL, LOGITS_TOL = 1e-5, 1e-4


def _llama_folder(folder: Path) -> Path:
    import transformers as T

    tok = F.bpe_tokenizer(folder)
    cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, vocab_size=len(tok), max_position_embeddings=64,
                        tie_word_embeddings=False, pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def _args(folder, data, out, *plan) -> list:
    return ["finetune", "--model", str(folder), "--data", str(data), "--task", "causal", "--steps", "2",
            "--warmup", "0", "--batch-size", "4", "--seq-len", "16", "--optimizer", "lars", "--lr", "1", "--lora", "r=4,alpha=8", "--quantize", "nf4",
            "--output-dir", str(out), "--no-progress", "--no-plot", *plan]


def plans_worker(folder, data, root) -> list:
    """Every rank: the four plans' runs in sequence, each its own output folder; the return codes."""
    from cuboid.cli import main

    return [main(_args(folder, data, Path(root) / plan, "--plan", plan)) for plan in PLANS]


def _adapters(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "adapter_model.safetensors"))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_qlora_cli_adapters_equal_under_the_plans_and_peft_reads_them(tmp_path):
    import cuboid
    from cuboid.cli import main

    folder = _llama_folder(tmp_path / "llama")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in F.sentences(24)))
    assert main(_args(folder, data, tmp_path / "single")) == 0
    assert run_world(plans_worker, 2, str(folder), str(data), str(tmp_path), timeout=600) == [[0] * len(PLANS)] * 2
    want = _adapters(tmp_path / "single")
    assert want and max(float(t.abs().max()) for k, t in want.items() if "lora_B" in k) > 0  # trained
    for plan in PLANS:
        got = _adapters(tmp_path / plan)
        assert sorted(got) == sorted(want), plan
        errs = {k: _rel(got[k], want[k]) for k in want}
        assert max(errs.values()) < TOL, (plan, max(errs.items(), key=lambda kv: kv[1]))

    # peft onto transformers + bitsandbytes' 4-bit base, against cuboid's load of final/ (its base, 4-bit, adapters)
    import peft
    import transformers as T

    bnb_cpu.use_reference_kernels()  # bitsandbytes' pure-torch CPU kernels where the native ones are wrong here
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    bnb = T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    base = T.LlamaForCausalLM.from_pretrained(str(folder), quantization_config=bnb, device_map="cpu",
                                              dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path / "single" / "final")).eval()
    ours = cuboid.load(str(tmp_path / "single" / "final"), quantize="nf4", dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, hf(input_ids=ids).logits
    assert float((a - b).abs().max() / b.abs().max()) < LOGITS_TOL
