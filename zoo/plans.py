"""Sharding specs and ready plans of the zoo models.

A spec says what each layer *is* (docs/architecture.md): the tensor modes read the roles
to decide how to split a layer on their grid. Ready plans are named plans known
to work (each one is exercised by a test); ``cuboid plans`` lists them.
"""
from __future__ import annotations

from cuboid.parallel.spec import ShardingSpec
from cuboid.parallel.plan import Plan

from .families import shape_of
from .vit.config import ViTConfig

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

SPECS = {
    "gpt": ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "ln_f": "norm", "classifier": "replicate",
                               **_BLOCK_ROLES},
                        first=("tok_emb", "pos_emb"), last=("ln_f", "classifier", "tok_emb"), shifted_labels=True,
                        pooled_last=True),
    "bert": ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "type_emb": "embedding",
                                "ln_emb": "norm", "pooler": "replicate", "mlm_dense": "replicate",
                                "mlm_ln": "norm", "mlm_bias": "vocab", "classifier": "replicate", **_BLOCK_ROLES},
                         first=("tok_emb", "pos_emb", "type_emb", "ln_emb"),
                         last=("pooler", "mlm_dense", "mlm_ln", "mlm_bias", "classifier", "tok_emb"),
                         pooled_first=True),
    "vit": ShardingSpec(roles={"patch": "column", "cls_token": "replicate", "pos_emb": "replicate",
                               "ln_f": "norm", "pooler": "replicate", "classifier": "replicate", **_BLOCK_ROLES},
                        first=("patch", "cls_token", "pos_emb"), last=("ln_f", "pooler", "classifier"),
                        pooled_first=True),
    # the head is lm_head (untied) or tok_emb (tied: spec_of keeps the tie only then)
    "llama": ShardingSpec(roles={"tok_emb": "vocab", "lm_head": "vocab", "ln_f": "norm", "classifier": "replicate",
                                 **_LLAMA_BLOCK},
                          first=("tok_emb",), last=("ln_f", "lm_head", "classifier", "tok_emb"), shifted_labels=True,
                          pooled_last=True),
    "deepseek": ShardingSpec(roles={"tok_emb": "vocab", "lm_head": "vocab", "ln_f": "norm", **_DEEPSEEK_BLOCK},
                             first=("tok_emb",), last=("ln_f", "lm_head", "tok_emb"), shifted_labels=True),
}

# the plans that work in this build, the same for every family
READY_PLANS = {
    "single": Plan(),
    "dp": Plan(dp=2),
    "dp2": Plan(dp=2),
    "dp4": Plan(dp=4),
    "dp2-ckpt": Plan(dp=2, checkpoint="full"),
    "tp1d": Plan(tp=2),
    "tp1d-4": Plan(tp=4),
    "dp2-tp2": Plan(dp=2, tp=2),
    "tp2d": Plan(tp=4, tp_mode="2d"),
    "tp2.5d": Plan(tp=8, tp_mode="2.5d", depth=2),
    "tp3d": Plan(tp=8, tp_mode="3d"),
    "pp2": Plan(pp=2, microbatches=2),
    "pp4": Plan(pp=4, microbatches=4),
    "pp2-gpipe": Plan(pp=2, microbatches=2, schedule="gpipe"),
    "pp2-interleaved": Plan(pp=2, microbatches=2, schedule="interleaved"),
    "pp2-zbv": Plan(pp=2, microbatches=2, schedule="zbv"),
    "dp2-pp2": Plan(dp=2, pp=2, microbatches=2),
    "dp2-pp2-tp2": Plan(dp=2, pp=2, tp=2, microbatches=2),
    "pp2-tp2d": Plan(pp=2, tp=4, tp_mode="2d", microbatches=2),
    "zero1": Plan(dp=4, zero=1),
    "zero2": Plan(dp=4, zero=2),
    "zero3": Plan(dp=4, zero=3),
    "dp2-tp2-zero3": Plan(dp=2, tp=2, zero=3),
    "dp2-pp2-zero1": Plan(dp=2, pp=2, microbatches=2, zero=1),
    "sp2": Plan(sp=2),
    "sp4": Plan(sp=4),
    "sp2-a2a": Plan(sp=2, sp_mode="all_to_all"),
    "sp2-tp2": Plan(sp=2, tp=2),
    "dp2-sp2": Plan(dp=2, sp=2),
    "tp2-seq": Plan(tp=2, tp_sequence=True),
}


def stage_costs(config, seq_len=None) -> tuple:
    """(per-block, embedding, head) forward costs of a zoo config, in multiply-adds per token: what
    pipeline stages are balanced by (``cuboid.parallel.stages.cut_stages``).

    A block: its projections and MLP matmuls (the cost model's :class:`~cuboid.parallel.cost.Shape` of the
    config: grouped K/V, a gated MLP's three matrices) plus attention over ``seq_len`` keys; the embedding:
    lookups, or ViT's patch matmul; the head: the vocabulary matmul of an LM or MLM head (with BERT's MLM
    dense layer), else pooler and classifier.
    """
    shape = shape_of(config)
    h, q, kv = shape.dim, shape.q_dim, shape.kv_dim
    t = seq_len or shape.n_positions
    block = shape.attention_macs() + shape.mlp_matrices * h * shape.hidden + 2 * t * q
    embed = config.channels * config.patch_size ** 2 * h if isinstance(config, ViTConfig) else 3 * h
    if config.head in ("lm", "mlm"):
        head = h * config.vocab_size + (h * h if config.head == "mlm" else 0)
    else:
        head = h * h + h * (getattr(config, "num_labels", 0) or 0)
    return [float(block)] * config.n_layers, float(embed), float(head)
