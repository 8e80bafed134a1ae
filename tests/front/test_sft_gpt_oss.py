"""`cuboid finetune --task sft` on a tiny gpt-oss folder with the harmony chat layout (<|start|>role<|message|>
turns, answers in the final channel ended by <|return|> or <|end|>): the rows train on what the assistant writes
after <|start|>assistant (the final channel's header, the answer and its end token) only, and the loss falls."""
from __future__ import annotations

import torch

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

ANSWER = "sun moon sun"


def test_sft_with_the_harmony_template(tmp_path):
    import transformers as T

    from cuboid.data.chat import encode_conversation

    base = tmp_path / "base"
    tok = CF.chat_tokenizer(base, "harmony")
    cfg = T.GptOssConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 64,
                                          "rope_theta": 150000.0})
    torch.manual_seed(0)
    T.GptOssForCausalLM(cfg).save_pretrained(str(base))
    rows = [{"messages": [dict(m, content=ANSWER) if m["role"] == "assistant" else m for m in c]}
            for c in CF.conversations(16, seed=3)]
    messages = rows[0]["messages"]
    ids, mask = encode_conversation(messages, tok, tok.chat_template)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    answers = sum(m["role"] == "assistant" for m in messages)
    assert trained == ("<|channel|>final<|message|>" + ANSWER + "<|end|>") * (answers - 1) \
        + "<|channel|>final<|message|>" + ANSWER + "<|return|>", trained
    data = CF.write_jsonl(rows, tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(base), "--data", str(data), "--task", "sft", "--max-length", "96",
                     "--steps", "6", "--batch-size", "4", "--lr", "2e-2", "--log-every", "1", "--eval-every", "6",
                     "--no-progress", "--no-plot", "--output-dir", str(run))
    assert rc == 0, err
    assert "task sft" in err, err
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
