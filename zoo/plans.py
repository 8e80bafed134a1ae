"""Sharding specs and ready plans of the zoo models.

A spec says what each layer *is* (docs/architecture.md): the tensor modes read the roles
to decide how to split a layer on their grid. Ready plans are named plans known
to work (each one is exercised by a test); ``cuboid plans`` lists them.
"""
from __future__ import annotations

from cuboid.parallel.apply import ShardingSpec
from cuboid.parallel.plan import Plan

_BLOCK_ROLES = {
    "blocks.*.attn.qkv": "column_qkv",  # fused [W_q; W_k; W_v]: each of the 3 segments split alike
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.ln1": "norm",
    "blocks.*.ln2": "norm",
}

SPECS = {
    "gpt": ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "ln_f": "norm", **_BLOCK_ROLES},
                        first=("tok_emb", "pos_emb"), last=("ln_f", "tok_emb")),
    "bert": ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "type_emb": "embedding",
                                "ln_emb": "norm", "pooler": "replicate", "mlm_dense": "replicate",
                                "mlm_ln": "norm", "mlm_bias": "vocab", "classifier": "replicate", **_BLOCK_ROLES},
                         first=("tok_emb", "pos_emb", "type_emb", "ln_emb"),
                         last=("pooler", "mlm_dense", "mlm_ln", "mlm_bias", "classifier", "tok_emb")),
    "vit": ShardingSpec(roles={"patch": "column", "cls_token": "replicate", "pos_emb": "replicate",
                               "ln_f": "norm", "pooler": "replicate", "classifier": "replicate", **_BLOCK_ROLES},
                        first=("patch", "cls_token", "pos_emb"), last=("ln_f", "pooler", "classifier")),
}

# the plans that work in this build, the same for every family
READY_PLANS = {
    "single": Plan(),
    "dp": Plan(dp=2),
    "dp2": Plan(dp=2),
    "dp4": Plan(dp=4),
    "dp2-ckpt": Plan(dp=2, activation_checkpoint=True),
    "tp1d": Plan(tp=2),
    "tp1d-4": Plan(tp=4),
    "dp2-tp2": Plan(dp=2, tp=2),
    "tp2d": Plan(tp=4, tp_mode="2d"),
    "tp2.5d": Plan(tp=8, tp_mode="2.5d", depth=2),
    "tp3d": Plan(tp=8, tp_mode="3d"),
}
