"""`cuboid finetune --task sft` on a tiny DeepSeek-V3 folder with DeepSeek's chat layout (a bos, <｜User｜> and
<｜Assistant｜> turns, answers ended by <｜end▁of▁sentence｜>) and --moe-bias-update-rate: the rows train on the
assistant's tokens only, the loss falls, and the routers' correction biases in the final folder moved."""
from __future__ import annotations

import torch

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

ANSWER = "sun moon sun"


def test_sft_with_deepseeks_template_and_the_bias_update(tmp_path):
    import transformers as T
    from safetensors.torch import load_file

    base = tmp_path / "base"
    tok = CF.chat_tokenizer(base, "deepseek")
    cfg = T.DeepseekV3Config(vocab_size=len(tok), hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                             first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=256, num_nextn_predict_layers=0,
                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.DeepseekV3ForCausalLM(cfg).save_pretrained(str(base))
    rows = [{"messages": [dict(m, content=ANSWER) if m["role"] == "assistant" else m for m in c]}
            for c in CF.conversations(16, seed=3)]
    data = CF.write_jsonl(rows, tmp_path / "chat.jsonl")
    text = tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert text.startswith("<｜begin▁of▁sentence｜>")
    assert "<｜Assistant｜>" + ANSWER + "<｜end▁of▁sentence｜>" in text
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(base), "--data", str(data), "--task", "sft", "--max-length", "96",
                     "--steps", "6", "--batch-size", "4", "--lr", "2e-2", "--moe-bias-update-rate", "0.01",
                     "--log-every", "1", "--eval-every", "6", "--no-progress", "--no-plot", "--output-dir", str(run))
    assert rc == 0, err
    assert "task sft" in err, err
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
    final = load_file(str(run / "final" / "model.safetensors"))
    bias = final["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max().item() > 0  # 6 updates of +-0.01 (0 only where the load sat at the mean each time)
    assert torch.all((bias / 0.01 - (bias / 0.01).round()).abs() < 1e-3)  # whole steps of the rate
