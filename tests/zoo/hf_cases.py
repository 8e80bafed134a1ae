"""Small random Hugging Face models of every supported architecture, and their inputs."""
import torch
import transformers as T

SEED = 0


def gpt2_config(**kw):
    return T.GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw)


def bert_config(**kw):
    return T.BertConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, intermediate_size=96,
                        vocab_size=97, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **kw)


def vit_config(**kw):
    return T.ViTConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, intermediate_size=96,
                       image_size=16, patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       **kw)


def _decoder(cls, **kw):
    return lambda: cls(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=32, **kw)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}  # short: the scaled frequencies bite at length 7
llama_config = _decoder(T.LlamaConfig, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
qwen2_config = _decoder(T.Qwen2Config, num_key_value_heads=1, tie_word_embeddings=True)  # biases, MQA, tied
mistral_config = _decoder(T.MistralConfig, num_key_value_heads=4, sliding_window=None)
# the 2026 families and the windows: head_dim apart from hidden / heads, windows shorter than the test sequences
qwen3_config = _decoder(T.Qwen3Config, num_key_value_heads=2, head_dim=16)
mistral_window_config = _decoder(T.MistralConfig, num_key_value_heads=2, sliding_window=4)
qwen2_window_config = _decoder(T.Qwen2Config, num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
                               max_window_layers=1)  # layer 0 global, layer 1 sliding
GEMMA3_ROPE = {"rope_type": "linear", "factor": 4.0}  # on the global layers only


def gemma3_config(**kw):
    """Sliding, global, sliding layers (window 4), linear RoPE scaling on the global one, a query scale apart
    from head_dim, a local RoPE base apart from the global one."""
    return T.Gemma3TextConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              query_pre_attn_scalar=20, rope_scaling=GEMMA3_ROPE, rope_theta=50000.0,
                              rope_local_base_freq=1000.0, **kw)


# mixtures of experts: 6 experts; Qwen3-MoE's layer 1 dense (mlp_only_layers) between sparse layers 0 and 2, top 2
# normalised; Mixtral top 2; OLMoE top 3 unnormalised, q/k norms over all heads
def _moe(cls, **kw):
    return lambda: cls(vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=80, **kw)


qwen3_moe_config = _moe(T.Qwen3MoeConfig, num_hidden_layers=3, head_dim=16, intermediate_size=80,
                        moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                        mlp_only_layers=[1], router_aux_loss_coef=0.05)
mixtral_config = _moe(T.MixtralConfig, num_hidden_layers=2, intermediate_size=24, num_local_experts=6,
                      num_experts_per_tok=2, router_aux_loss_coef=0.05)
olmoe_config = _moe(T.OlmoeConfig, num_hidden_layers=2, intermediate_size=24, num_experts=6, num_experts_per_tok=3,
                    norm_topk_prob=False, router_aux_loss_coef=0.05, pad_token_id=0, eos_token_id=None)
MOE_CASES = {
    "Qwen3MoeForCausalLM": (T.Qwen3MoeForCausalLM, qwen3_moe_config, "causal"),
    "MixtralForCausalLM": (T.MixtralForCausalLM, mixtral_config, "causal"),
    "OlmoeForCausalLM": (T.OlmoeForCausalLM, olmoe_config, "causal"),
}

# name -> (HF class, config factory, task)
CASES = {
    "GPT2LMHeadModel": (T.GPT2LMHeadModel, gpt2_config, "causal"),
    "GPT2Model": (T.GPT2Model, gpt2_config, "base-text"),
    "GPT2ForSequenceClassification": (T.GPT2ForSequenceClassification,
                                      lambda: gpt2_config(num_labels=3, pad_token_id=0), "seqcls"),
    "BertForMaskedLM": (T.BertForMaskedLM, bert_config, "mlm"),
    "BertForSequenceClassification": (T.BertForSequenceClassification, lambda: bert_config(num_labels=3), "seqcls"),
    "BertModel": (T.BertModel, bert_config, "base-text"),
    "ViTForImageClassification": (T.ViTForImageClassification, lambda: vit_config(num_labels=5), "imgcls"),
    "ViTModel": (T.ViTModel, vit_config, "base-image"),
    "LlamaForCausalLM": (T.LlamaForCausalLM, llama_config, "causal"),
    "Qwen2ForCausalLM": (T.Qwen2ForCausalLM, qwen2_config, "causal"),
    "MistralForCausalLM": (T.MistralForCausalLM, mistral_config, "causal"),
    "LlamaForSequenceClassification": (T.LlamaForSequenceClassification,
                                       _decoder(T.LlamaConfig, num_key_value_heads=2, num_labels=3, pad_token_id=0),
                                       "seqcls"),
    "Qwen2ForSequenceClassification": (T.Qwen2ForSequenceClassification,
                                       _decoder(T.Qwen2Config, num_key_value_heads=2, num_labels=3, pad_token_id=0),
                                       "seqcls"),
    "LlamaModel": (T.LlamaModel, llama_config, "base-text"),
    "Qwen3ForCausalLM": (T.Qwen3ForCausalLM, qwen3_config, "causal"),
    "Qwen3ForSequenceClassification": (T.Qwen3ForSequenceClassification,
                                       _decoder(T.Qwen3Config, num_key_value_heads=2, head_dim=16, num_labels=3,
                                                pad_token_id=0), "seqcls"),
    "Qwen3Model": (T.Qwen3Model, qwen3_config, "base-text"),
    "Gemma3ForCausalLM": (T.Gemma3ForCausalLM, lambda: gemma3_config(final_logit_softcapping=3.0), "causal"),
    "Gemma3TextForSequenceClassification": (T.Gemma3TextForSequenceClassification,
                                            lambda: gemma3_config(num_labels=3, pad_token_id=0), "seqcls"),
    "Gemma3TextModel": (T.Gemma3TextModel, gemma3_config, "base-text"),
    "MistralForCausalLM+window": (T.MistralForCausalLM, mistral_window_config, "causal"),
    "Qwen2ForCausalLM+window": (T.Qwen2ForCausalLM, qwen2_window_config, "causal"),
}


def make_hf(name):
    cls, cfg, _ = CASES[name] if name in CASES else MOE_CASES[name]
    torch.manual_seed(SEED)
    model = cls(cfg()).eval()
    # HF zero-initialises biases and sets norms to 1/0: randomise everything so
    # a mapping that drops or swaps a tensor cannot pass
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def make_batch(name, labels=True):
    """HF inputs: odd sequence length 7, right padding in one row, token types."""
    task = CASES[name][2]
    g = torch.Generator().manual_seed(1)
    if task in ("base-image", "imgcls"):
        batch = {"pixel_values": torch.randn(3, 3, 16, 16, generator=g)}
        if labels and task == "imgcls":
            batch["labels"] = torch.tensor([0, 4, 2])
        return batch
    ids = torch.randint(1, 97, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    if task == "seqcls" and not name.startswith("Bert"):  # decoders pool the last token that is not padding (id 0)
        ids[1, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if name.startswith("Bert"):
        batch["token_type_ids"] = torch.tensor([[0] * 4 + [1] * 3] * 3)
    if labels:
        if task == "causal":
            lab = ids.clone()
            lab[mask == 0] = -100
            batch["labels"] = lab
        elif task == "mlm":
            lab = torch.full_like(ids, -100)
            lab[:, 2] = ids[:, 2]
            lab[0, 5] = ids[0, 5]
            batch["labels"] = lab
        elif task == "seqcls":
            batch["labels"] = torch.tensor([2, 0, 1])
    return batch


def hf_outputs(model, batch):
    out = model(**batch)
    if hasattr(out, "logits"):
        return out.logits, getattr(out, "loss", None)
    return out.last_hidden_state, None
