"""Mixture-of-experts layers on one device: the router, the experts as grouped GEMMs, the load-balancing loss.

The layout and the order of operations are transformers' (Qwen3-MoE, Mixtral, OLMoE), so checkpoints map and
outputs agree: the router's ``weight`` is HF's ``gate.weight`` (E, C); the experts hold ``gate_up`` (E, 2I, C),
gate rows first, and ``down`` (E, C, I), the layout of transformers 5's fused ``gate_up_proj`` / ``down_proj``.

Dropless: every (token, choice) pair is computed, sorted by expert so that all experts run as one grouped GEMM
(:func:`cuboid.kernels.grouped_mm`) for gate/up and one for down, with no Python loop over experts.
:meth:`Experts.dispatch` is the seam expert parallelism overrides (all-to-all to the ranks owning the experts,
:meth:`Experts.compute` there, all-to-all back).

The load-balancing statistics of a forward are gathered by a :class:`Recorder` that the model opens around its
blocks (:func:`recording`); every :class:`~cuboid.zoo.llama.moe.SparseMLP` adds its router logits to the
active recorder. Only a forward inside a recording records: a block recomputed in backward (activation
checkpointing) runs outside it and adds nothing twice.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

import cuboid.kernels as kernels
from cuboid.parallel.layers import ShardedModule, gelu

EXPERT_ACTS = ("silu", "gelu_tanh")


class Router(ShardedModule):
    """Linear router with top-k choice: ``forward(x (N, C)) -> (logits (N, E), weights (N, k), experts (N, k))``.

    Softmax in fp32, top-k of the probabilities, divided by their sum when ``norm_topk_prob``, cast to x's
    dtype (transformers' Qwen3MoeTopKRouter and OlmoeTopKRouter); ``cast=False`` keeps the weights in fp32, so
    the experts' outputs are weighed in fp32 (MixtralTopKRouter). Logits are in x's dtype."""

    role = "replicate"

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = True, cast: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"experts_per_token must be between 1 and n_experts {n_experts}, got {top_k}")
        self.n_experts, self.top_k, self.norm_topk_prob, self.cast = n_experts, top_k, norm_topk_prob, cast
        self.weight = torch.nn.Parameter(torch.empty(n_experts, dim))
        self.tag_placements()

    def forward(self, x: torch.Tensor) -> tuple:
        logits = F.linear(x, self.weight)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype) if self.cast else weights, experts

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class Experts(ShardedModule):
    """The experts' gated MLPs as two grouped GEMMs: ``forward(x (N, C), weights (N, k), experts (N, k)) -> (N, C)``.

    ``gate_up`` (E_local, 2I, C): each expert's gate rows then up rows; ``down`` (E_local, C, I). ``n_experts``
    is the global E and ``first_expert`` the index of this layer's first expert (0 on one device; expert
    parallelism holds ``E / ep`` experts from there)."""

    role = "experts"

    def __init__(self, dim: int, hidden: int, n_experts: int, act: str = "silu") -> None:
        super().__init__()
        if act not in EXPERT_ACTS:
            raise ValueError(f"the experts' activation must be one of {', '.join(EXPERT_ACTS)}, got {act!r}")
        self.n_experts, self.first_expert, self.hidden, self.act = n_experts, 0, hidden, act
        self.gate_up = torch.nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down = torch.nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.tag_placements()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        N, k = experts.shape
        flat = experts.reshape(-1)  # (N*k,) the expert of each (token, choice) pair, token-major
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert, tokens in order within each
        token = torch.div(order, k, rounding_mode="floor")  # (N*k,) the token of each sorted pair
        # per-expert counts without a host sync (bincount on the GPU reads its maximum first)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        y = self.dispatch(x[token], counts)  # (N*k, C)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        # each token's choices added in ascending expert order, onto zeros (transformers' order)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for rows sorted by expert, ``counts`` (E,) rows per global expert. One device:
        :meth:`compute`. Expert parallelism sends each rank its experts' rows and brings the outputs back."""
        return self.compute(x_sorted, counts)

    def compute(self, x_sorted: torch.Tensor, counts_local: torch.Tensor) -> torch.Tensor:
        """This layer's experts on rows sorted by (local) expert: (M, C) -> (M, C), ``counts_local`` (E_local,)."""
        h = self.project("gate_up", x_sorted, counts_local)  # (M, 2I)
        gate, up = h[:, :self.hidden], h[:, self.hidden:]
        a = kernels.swiglu(gate, up) if self.act == "silu" else gelu(gate, "tanh") * up
        return self.project("down", a, counts_local)

    def project(self, name: str, x: torch.Tensor, counts_local: torch.Tensor) -> torch.Tensor:
        """One grouped projection of :meth:`compute` (``name``: ``"gate_up"`` or ``"down"``): the seam LoRA on
        the experts overrides to add its low-rank term."""
        return kernels.grouped_mm(x, getattr(self, name), counts_local)

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, first={self.first_expert}, hidden={self.hidden}, act={self.act}"


def balance_stats(logits: torch.Tensor, k: int, keep: Optional[torch.Tensor] = None) -> tuple:
    """One layer's load-balancing statistics from its router logits (N, E): ``(counts, probsum, tokens)``.

    ``counts`` (E,) fp32 without gradient: top-k selections per expert; ``probsum`` (E,) fp32 with gradient:
    each expert's softmax probability summed over tokens; ``tokens``: a 0-dim fp32 tensor. ``keep`` (N,): 1 for a
    token, 0 for padding (weights each token as transformers' ``load_balancing_loss_func`` with a mask)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    with torch.no_grad():
        chosen = torch.topk(probs, k, dim=-1).indices.reshape(-1)  # (N*k,)
        ones = torch.ones_like(chosen, dtype=torch.float32) if keep is None else \
            keep.to(torch.float32).repeat_interleave(k)
        counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device).scatter_add_(0, chosen, ones)
        tokens = ones.sum() / k
    if keep is not None:
        probs = probs * keep.to(torch.float32).unsqueeze(-1)
    return counts, probs.sum(0), tokens


def balance_loss(counts: torch.Tensor, probsum: torch.Tensor, tokens: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss ``n_experts * sum(counts * probsum) / tokens ** 2`` from statistics
    summed over layers (``tokens`` counts (layer, token) pairs): transformers' ``load_balancing_loss_func``."""
    return n_experts * torch.sum(counts * probsum) / (tokens * tokens)


class Recorder:
    """The router statistics of one forward: ``counts``, ``probsum``, ``tokens`` summed over the sparse layers
    (see :func:`balance_stats`), and each layer's logits when ``keep_logits``. ``keep`` (N,): the token mask of
    the tokens the layers see (None: every token counts). ``reduce(counts, probsum, tokens, n_experts) -> loss``
    replaces :func:`balance_loss` where a plan spreads one forward's tokens over ranks (it sums the statistics
    over them).

    :meth:`add` only keeps a layer's logits; the statistics are made when ``counts``, ``probsum`` or ``tokens``
    is read, after the blocks. So a block under activation checkpointing saves the same tensors in its forward
    and in its recompute (which runs outside any recording). Setting the three seeds the sums (a pipeline stage
    starts from the statistics of the stages before it)."""

    def __init__(self, top_k: int, keep_logits: bool = False, keep: Optional[torch.Tensor] = None,
                 reduce: Optional[Callable] = None) -> None:
        self.top_k, self.keep_logits, self.keep, self.reduce = top_k, keep_logits, keep, reduce
        self.logits: list = []
        self._pending: list = []  # logits added since the sums were last made
        self._sums = [None, None, None]  # counts, probsum, tokens

    def add(self, logits: torch.Tensor) -> None:
        """Add one sparse layer's router logits (N, E)."""
        if self.keep_logits:
            self.logits.append(logits)
        self._pending.append(logits)

    def _totals(self) -> list:
        for logits in self._pending:
            stats = balance_stats(logits, self.top_k, self.keep)
            self._sums = list(stats) if self._sums[0] is None else [a + b for a, b in zip(self._sums, stats)]
        self._pending = []
        return self._sums

    def _getter(i: int):
        return property(lambda self: self._totals()[i], lambda self, value: self._seed(i, value))

    def _seed(self, i: int, value) -> None:
        self._totals()[i] = value

    counts, probsum, tokens = _getter(0), _getter(1), _getter(2)
    del _getter

    def loss(self, n_experts: int) -> Optional[torch.Tensor]:
        """The auxiliary loss of what was recorded (None when no sparse layer ran)."""
        counts, probsum, tokens = self._totals()
        if counts is None:
            return None
        return (self.reduce or balance_loss)(counts, probsum, tokens, n_experts)


_RECORDERS: list = []


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Make ``recorder`` the one the sparse layers add to while the block runs (nested: the innermost)."""
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.pop()


def active_recorder() -> Optional[Recorder]:
    """The innermost open :class:`Recorder`, or None (a forward outside any recording records nothing)."""
    return _RECORDERS[-1] if _RECORDERS else None
