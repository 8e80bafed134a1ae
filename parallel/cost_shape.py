"""What the cost model reads of a model and a plan: the model's shape, pipeline stages, bubble, FLOPs.

Pure arithmetic on a config and a :class:`~.plan.Plan` (no tensors): :mod:`.cost`,
:mod:`.cost_memory` and :mod:`.cost_traffic` build on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .plan import Plan


@dataclass(frozen=True)
class Shape:
    """What the formulas read of a model config."""

    n_layers: int
    dim: int
    n_heads: int
    hidden: int                 # MLP width
    vocab_size: int             # 0: no vocabulary (ViT)
    n_positions: int
    tied_head: bool             # an LM head tied to the token embedding (GPT; BERT's MLM head)
    kv_heads: int = 0           # key/value heads (grouped-query attention); 0: n_heads
    head_dim: int = 0           # 0: dim // n_heads
    mlp_matrices: int = 2       # fc + proj; SwiGLU's gate + up + down: 3

    @classmethod
    def of(cls, config) -> "Shape":
        dim = config.dim
        hidden = getattr(config, "hidden", None) or getattr(config, "mlp_hidden", 0) or 4 * dim
        vocab = getattr(config, "vocab_size", 0) or 0
        positions = getattr(config, "n_positions", None) or (getattr(config, "n_patches", 0) + 1)
        swiglu = hasattr(config, "n_kv_heads")
        return cls(config.n_layers, dim, config.n_heads, int(hidden), int(vocab), int(positions),
                   getattr(config, "head", "") in ("lm", "mlm") and getattr(config, "tie_embeddings", True),
                   getattr(config, "n_kv_heads", 0) or 0, getattr(config, "head_dim", 0) or 0, 3 if swiglu else 2)

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head_dim."""
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values)."""
        return (self.kv_heads or self.n_heads) * (self.head_dim or self.dim // self.n_heads)


def _dtype_bytes(name: str) -> int:
    return 4 if name == "fp32" else 2


# ----------------------------------------------------------------------------- pipeline stages


@dataclass(frozen=True)
class Stage:
    """A rank's pipeline stage(s): how many blocks, and whether it holds the embeddings / the head."""

    blocks: int
    first: bool = True
    last: bool = True
    index: int = 0              # pipeline rank


def stages_of(plan: Plan, block_cuts: Sequence[range], n_layers: int) -> list[Stage]:
    """One :class:`Stage` per pipeline rank from the cut (one range per stage, two per rank for
    ``interleaved`` / ``zbv``); without pp, one stage of all ``n_layers`` blocks."""
    if plan.pp == 1:
        return [Stage(n_layers)]
    from .pipeline import stage_ids

    out = []
    n = len(block_cuts)
    for r in range(plan.pp):
        ids = stage_ids(plan.schedule, r, plan.pp)
        out.append(Stage(sum(len(block_cuts[i]) for i in ids), 0 in ids, n - 1 in ids, r))
    return out


def bubble_fraction(plan: Plan) -> float:
    """Idle time over busy time of a pipeline step: ``(pp - 1) / m`` for GPipe and 1F1B, halved by
    two interleaved stages per rank; ZBV's V with split backward is taken as a third of 1F1B's."""
    if plan.pp == 1:
        return 0.0
    m = plan.microbatches
    base = (plan.pp - 1) / m
    return {"gpipe": base, "1f1b": base, "interleaved": base / 2, "zbv": base / 3}[plan.schedule]


def in_flight(plan: Plan, stage: Stage) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if plan.pp == 1:
        return 1
    m = plan.microbatches
    if plan.schedule == "gpipe":
        return m
    return min(m, plan.pp - stage.index + (1 if plan.schedule in ("interleaved", "zbv") else 0))


def step_flops(shape: Shape, batch: int, seq: int, recompute: bool = False, *, parts: bool = False):
    """FLOPs of one training step over a ``batch`` x ``seq`` global batch (Narayanan et al.):
    per block forward ``2 B s (4 h^2 + 2 h f) + 4 B s^2 h``, the logits ``2 B s h V``; backward
    twice forward, recompute one forward of the blocks more. Grouped-query attention and SwiGLU
    (Llama): ``2 B s ((2 q + 2 kv) h + 3 h f) + 4 B s^2 q`` with ``q``, ``kv`` the query and key
    widths. ``parts``: (all blocks, head) apart."""
    h, f = shape.dim, shape.hidden
    q, kv = shape.q_dim, shape.kv_dim
    block = 2 * batch * seq * ((2 * q + 2 * kv) * h + shape.mlp_matrices * h * f) + 4 * batch * seq * seq * q
    blocks = (3 + (1 if recompute else 0)) * shape.n_layers * block
    head = 3 * 2 * batch * seq * h * shape.vocab_size
    return (blocks, head) if parts else blocks + head
