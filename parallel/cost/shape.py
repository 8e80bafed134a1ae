"""What the cost model reads of a model and a plan: the model's shape, pipeline stages, bubble, FLOPs.

:class:`Shape` holds every fact the formulas need of a model, each one a
field the zoo fills from its family's config (``cuboid.zoo.families``
registers one function per config class with :func:`register_shape`):
nothing here guesses a family from a config. The rest is pure arithmetic on
a shape and a :class:`~cuboid.parallel.plan.Plan` (no tensors);
:mod:`.memory`, :mod:`.traffic` and :mod:`.predict` build on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..plan import Plan


@dataclass(frozen=True)
class Shape:
    """What the formulas read of a model."""

    n_layers: int
    dim: int
    n_heads: int
    hidden: int                 # MLP width
    vocab_size: int             # 0: no vocabulary (ViT)
    n_positions: int            # the longest sequence (ViT: patches + the class token)
    tied_head: bool             # an LM or MLM head tied to the token embedding
    kv_heads: int = 0           # key/value heads (grouped-query attention); 0: n_heads
    head_dim: int = 0           # 0: dim // n_heads
    gated_mlp: bool = False     # a gated MLP (SwiGLU: gate, up, down) with q, k, v apart and RMSNorm (Llama's block)
    first_token_tensors: int = 0  # (B, 1, dim) tensors the head takes from the first token's sequence rank
                                  # (BERT 1; ViT 2: its pre-norm residual too)
    window: int = 0             # sliding-window attention's window (Mistral, Qwen2, Gemma 3); 0: none
    window_layers: int = 0      # how many of the n_layers blocks attend through that window
    experts: int = 0            # experts of a sparse (mixture-of-experts) MLP; 0: every MLP dense
    top_k: int = 0              # experts each token goes to
    expert_hidden: int = 0      # one expert's gated-MLP width (0: hidden)
    sparse_layers: int = 0      # how many of the n_layers blocks have the sparse MLP (the others ``hidden``'s dense one)
    aux_loss: bool = False      # the load-balancing loss joins the loss (HF output_router_logits)
    head_norm: int = 0          # elements of a block's per-head q/k norm weights (Qwen3, Gemma 3: 2 head_dim), whole
                                # on every tensor rank, their gradient summed over the tensor group per forward
    # multi-head latent attention (DeepSeek-V2/V3; 0: q, k, v projections of head_dim each): keys and values come
    # from a ``latent``-wide compressed vector plus a ``rope_dim``-wide RoPE key shared by the heads, queries
    # through a ``q_rank`` low-rank path (0: one projection), values ``v_head_dim`` wide (head_dim: q/k's)
    latent: int = 0
    rope_dim: int = 0
    q_rank: int = 0
    v_head_dim: int = 0
    shared_hidden: int = 0      # a sparse layer's shared experts' gated-MLP width, run by every token (DeepSeek)
    balance_stats: bool = True  # a forward sums its routers' statistics over dp x sp (the Llama MoEs' aux loss is
                                # computed whether or not it trains; DeepSeek-V3 balances by a bias: none)
    parameters: int = 0         # the model's parameters, exact (0: not given)
    active_parameters: int = 0  # those one token uses: the router and top_k of each sparse layer's experts (0: not given)

    @classmethod
    def of(cls, model: Any) -> "Shape":
        """The shape of a model config, by the function its family registered (a :class:`Shape` is its own)."""
        if isinstance(model, Shape):
            return model
        shape_fn = _SHAPES.get(type(model))
        if shape_fn is None:
            raise TypeError(f"the cost model does not know the shape of a {type(model).__name__}: give a Shape, or a "
                            "config whose family registered one (cuboid.zoo registers its configs' shapes)")
        return shape_fn(model)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: fc and proj, or a gated MLP's gate, up and down."""
        return 3 if self.gated_mlp else 2

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head_dim."""
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)

    def attention_span(self, seq: int) -> float:
        """Keys per query in the ``4 B s^2 q`` attention term (``seq`` for a global layer), averaged over the
        layers: a windowed layer scores ``W (W + 1) / 2 + (s - W) W`` causal pairs against a global layer's
        ``s (s + 1) / 2``, so its span is ``2 W - W^2 / s`` keys (``s`` when the window covers the sequence)."""
        if not self.window or not self.window_layers or self.window >= seq:
            return float(seq)
        local = 2 * self.window - self.window ** 2 / seq
        n = max(self.n_layers, 1)
        return ((n - self.window_layers) * seq + self.window_layers * local) / n

    @property
    def sparse(self) -> bool:
        """Whether some blocks route tokens to experts (a mixture-of-experts model)."""
        return self.experts > 0 and self.sparse_layers > 0

    @property
    def expert_width(self) -> int:
        """One expert's MLP width."""
        return self.expert_hidden or self.hidden

    def linear_macs(self) -> float:
        """Multiply-adds per token of all blocks' linears: attention's q, k, v, o, and per layer the dense MLP or,
        on a sparse layer, the router (``h E``) and the ``top_k`` experts a token goes to (``k 3 h I``: active
        work, not all ``E`` experts')."""
        h = self.dim
        attention = self.attention_macs()
        sparse = self.sparse_layers if self.sparse else 0
        dense_mlp = self.mlp_matrices * h * self.hidden
        sparse_mlp = self.router_macs() + self.expert_macs()
        return self.n_layers * attention + (self.n_layers - sparse) * dense_mlp + sparse * sparse_mlp

    def attention_macs(self) -> float:
        """Multiply-adds per token of one block's attention projections: q, k, v and o (``(2 q + 2 kv) h``), or
        MLA's ``h r + r q`` (or ``h q``) for the queries, ``h (L + R)`` into the latent and the RoPE key, ``L H
        (nope + Dv)`` out of it, and ``H Dv h`` for the output (the latent projections are whole on every tensor
        rank: the spec replicates them)."""
        h = self.dim
        if not self.latent:
            return float((2 * self.q_dim + 2 * self.kv_dim) * h)
        q = self.q_dim
        queries = h * self.q_rank + self.q_rank * q if self.q_rank else h * q
        v = self.n_heads * self.v_head_dim
        return float(queries + h * (self.latent + self.rope_dim) + self.latent * (q - self.n_heads * self.rope_dim + v)
                     + v * h)

    def cache_elements(self) -> int:
        """Numbers a generation cache keeps per token and layer: keys and values (``2 kv``), or MLA's latent and
        RoPE key (``latent + rope_dim``)."""
        return self.latent + self.rope_dim if self.latent else 2 * self.kv_dim

    def router_macs(self) -> float:
        """Multiply-adds per token of one sparse layer's router (``h E``); 0 for a dense model."""
        return self.dim * self.experts if self.sparse else 0.0

    def expert_macs(self) -> float:
        """Multiply-adds per token of one sparse layer's experts: its ``top_k`` experts' gate, up and down (the
        experts are gated MLPs: three matrices each), and the shared experts' (``3 h shared_hidden``)."""
        if not self.sparse:
            return 0.0
        return self.top_k * 3 * self.dim * self.expert_width + 3 * self.dim * self.shared_hidden

    def routed_elements(self) -> float:
        """fp32 elements per token a block keeps for backward beyond a dense one, averaged over the layers: a
        sparse layer keeps, besides what a gated MLP of width ``top_k x expert_width`` keeps, ``3 k h + E + 8 k``:
        the ``k`` routed copies of its input, the experts' outputs and their weighted copies, the router's
        logits, and int64 indices per choice (2 elements each); the same bytes under bf16 autocast (the stream and
        the copies stay fp32). bench/checkpointing.py's tracker measures what a block keeps."""
        if not self.sparse:
            return 0.0
        k = self.top_k
        return self.sparse_layers / max(self.n_layers, 1) * (3 * k * self.dim + self.experts + 8 * k)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values)."""
        return (self.kv_heads or self.n_heads) * (self.head_dim or self.dim // self.n_heads)


_SHAPES: dict[type, Callable[[Any], Shape]] = {}


def register_shape(config_type: type, shape_fn: Callable[[Any], Shape]) -> None:
    """Say how a config class's models are shaped: ``shape_fn(config)`` is the :class:`Shape` that
    :meth:`Shape.of` gives for instances of ``config_type``."""
    _SHAPES[config_type] = shape_fn


def dtype_bytes(name: str) -> int:
    """Bytes of an element of a plan's ``dtype`` name."""
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
    from ..stages import stage_ids

    n = len(block_cuts)
    if n != plan.pp * (2 if plan.schedule in ("interleaved", "zbv") else 1):
        raise ValueError(f"the cost model needs the pipeline's block ranges, one per stage, for plan "
                         f"{plan.describe()}; got {n}")
    out = []
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
    twice forward, recompute (whole blocks) one forward of the blocks more. Grouped-query attention
    and a gated MLP (Llama): ``2 B s ((2 q + 2 kv) h + 3 h f) + 4 B s^2 q`` with ``q``, ``kv`` the
    query and key widths; sliding-window layers put their span in place of one ``s``
    (:meth:`Shape.attention_span`); a sparse layer's MLP is its router and the ``top_k`` experts each
    token goes to, ``2 B s (h E + 3 k h I)`` (:meth:`Shape.linear_macs`). ``parts``: (all blocks, head) apart."""
    h, q = shape.dim, shape.q_dim
    attention = 4 * batch * seq * q * (seq if not shape.window_layers else shape.attention_span(seq))
    forward = 2 * batch * seq * shape.linear_macs() + shape.n_layers * attention
    blocks = (3 + (1 if recompute else 0)) * forward
    head = 3 * 2 * batch * seq * h * shape.vocab_size
    return (blocks, head) if parts else blocks + head
