"""`cuboid finetune --task sft --packing --lora` on small local Qwen3 and Gemma 3 folders (a chat tokenizer,
random weights), from the command line as a user runs it: the loss falls, and peft reads the final adapters
(``PeftModel.from_pretrained`` on the transformers base gives the logits of cuboid's model with the same adapters)."""
from __future__ import annotations

import pytest
import torch

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

ANSWER = "sun moon sun"  # every conversation's answer: a few steps teach it


def _folder(folder, arch: str):
    """A tiny random Qwen3ForCausalLM or Gemma3ForCausalLM (sliding and global layers, a window of 8 shorter
    than the packed rows) with the qwen2-style chat tokenizer."""
    import transformers as T

    tok = CF.chat_tokenizer(folder, "qwen2")
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  intermediate_size=96, vocab_size=len(tok), max_position_embeddings=256,
                  pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if arch == "qwen3":
        T.Qwen3ForCausalLM(T.Qwen3Config(tie_word_embeddings=True, **common)).save_pretrained(str(folder))
    else:
        cfg = T.Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                 query_pre_attn_scalar=20, rope_local_base_freq=1000.0, **common)
        T.Gemma3ForCausalLM(cfg).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    rows = [{"messages": [dict(m, content=ANSWER) if m["role"] == "assistant" else m for m in c]}
            for c in CF.conversations(32, seed=7)]
    return CF.write_jsonl(rows, tmp_path_factory.mktemp("data") / "chat.jsonl")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_sft_lora_then_peft(arch, chat_file, tmp_path):
    import cuboid
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _folder(tmp_path / arch, arch)
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(base), "--data", str(chat_file), "--task", "sft", "--packing",
                     "--lora", "r=4,alpha=8", "--max-length", "128", "--steps", "8", "--batch-size", "4", "--lr",
                     "2e-2", "--log-every", "1", "--eval-every", "8", "--no-progress", "--no-plot", "--output-dir",
                     str(run))
    assert rc == 0, err
    assert "task sft" in err and "packed:" in err, err
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    final = run / "final"
    assert (final / "adapter_config.json").is_file()

    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than the window
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(final))
    ours = cuboid.load(str(base), lora=str(final)).eval()
    with torch.no_grad():
        want, got = hf.eval()(input_ids=ids).logits, ours(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapters moved the logits
    assert (got - want).abs().max() / want.abs().max() < 1e-5
