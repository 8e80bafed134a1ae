"""Ready plans of the zoo models and the pipeline's stage costs; the sharding specs are the families' records'
(zoo/specs.py, zoo/registry.py: ``SPECS`` here is the registry's table).

Ready plans are named plans known to work (each one is exercised by a test); ``cuboid plans`` lists them.
"""
from __future__ import annotations

from cuboid.parallel.plan import Plan

from .families import shape_of
from .registry import SPECS

__all__ = ["READY_PLANS", "SPECS", "stage_costs"]
from .vit.config import ViTConfig

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
