"""The zoo families' sharding specs: what each layer *is* (docs/architecture.md).

The tensor modes read the roles to decide how to split a layer on their grid; each family's record
(zoo/families.py) names its spec, and ``cuboid.zoo.spec_of`` adapts it to a model's head.
"""
from __future__ import annotations

from cuboid.parallel.spec import ShardingSpec

_BLOCK_ROLES = {
    "blocks.*.attn.qkv": "column_qkv",  # fused [W_q; W_k; W_v]: each of the 3 segments split alike
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.ln1": "norm",
    "blocks.*.ln2": "norm",
}

_LLAMA_BLOCK = {
    "blocks.*.attn.q": "column",
    "blocks.*.attn.k": "column_kv",  # key/value heads: cut like q where they divide, else replicated (1D)
    "blocks.*.attn.v": "column_kv",
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.gate": "column",
    "blocks.*.mlp.up": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.ln1": "norm",
    "blocks.*.ln2": "norm",
    "blocks.*.post_ln1": "norm",  # Gemma 3: the norms after attention and MLP
    "blocks.*.post_ln2": "norm",
    # Qwen3, Gemma 3: a norm over each head's features after the head-split q/k projections, whole on every rank;
    # its gradient is a sum over the heads, which a mode that splits heads must sum over its ranks
    "blocks.*.attn.q_norm": "head_norm",
    "blocks.*.attn.k_norm": "head_norm",
    # gpt-oss's (H,) sink logits: cut on their one dim in contiguous blocks, as q's heads are (a learned tensor's
    # split on its last dim, which the modes call vocab)
    "blocks.*.attn.sinks": "vocab",
    # mixture of experts: the router whole on every rank; the experts sharded over ep (parallel/experts.py)
    "blocks.*.mlp.router": "replicate",
    "blocks.*.mlp.experts": "experts",
}

# DeepSeek-V3 under 1D tp: the heads' projections (q or q_b, kv_b) are cut by heads and o by its input, as
# Llama's; the latent projections q_a and kv_a (hidden -> q_lora_rank, kv_lora_rank + rope) and their norms stay
# whole on every tensor rank: they are narrow (the cost model's attention_macs counts them whole), and cutting
# kv_a would split the latent that every head reads. The router is whole, the routed experts go over ep, the
# shared experts are cut like a dense MLP.
_DEEPSEEK_BLOCK = {
    "blocks.*.attn.q": "column",
    "blocks.*.attn.q_a": "replicate",
    "blocks.*.attn.q_norm": "norm",
    "blocks.*.attn.q_b": "column",
    "blocks.*.attn.kv_a": "replicate",
    "blocks.*.attn.kv_norm": "norm",
    "blocks.*.attn.kv_b": "column",
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.gate": "column",
    "blocks.*.mlp.up": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.mlp.shared.gate": "column",
    "blocks.*.mlp.shared.up": "column",
    "blocks.*.mlp.shared.proj": "row",
    "blocks.*.mlp.router": "replicate",
    "blocks.*.mlp.experts": "experts",
    "blocks.*.ln1": "norm",
    "blocks.*.ln2": "norm",
}

# the zoo families' specs (their records' in zoo/families.py)
GPT = ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "ln_f": "norm", "classifier": "replicate",
                          **_BLOCK_ROLES},
                   first=("tok_emb", "pos_emb"), last=("ln_f", "classifier", "tok_emb"), shifted_labels=True,
                   pooled_last=True)
BERT = ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "type_emb": "embedding",
                           "ln_emb": "norm", "pooler": "replicate", "mlm_dense": "replicate",
                           "mlm_ln": "norm", "mlm_bias": "vocab", "classifier": "replicate", **_BLOCK_ROLES},
                    first=("tok_emb", "pos_emb", "type_emb", "ln_emb"),
                    last=("pooler", "mlm_dense", "mlm_ln", "mlm_bias", "classifier", "tok_emb"),
                    pooled_first=True)
VIT = ShardingSpec(roles={"patch": "column", "cls_token": "replicate", "pos_emb": "replicate",
                          "ln_f": "norm", "pooler": "replicate", "classifier": "replicate", **_BLOCK_ROLES},
                   first=("patch", "cls_token", "pos_emb"), last=("ln_f", "pooler", "classifier"),
                   pooled_first=True)
# the head is lm_head (untied) or tok_emb (tied: spec_of keeps the tie only then)
LLAMA = ShardingSpec(roles={"tok_emb": "vocab", "lm_head": "vocab", "ln_f": "norm", "classifier": "replicate",
                            **_LLAMA_BLOCK},
                     first=("tok_emb",), last=("ln_f", "lm_head", "classifier", "tok_emb"), shifted_labels=True,
                     pooled_last=True)
DEEPSEEK = ShardingSpec(roles={"tok_emb": "vocab", "lm_head": "vocab", "ln_f": "norm", **_DEEPSEEK_BLOCK},
                        first=("tok_emb",), last=("ln_f", "lm_head", "tok_emb"), shifted_labels=True)
