"""LoRA adapters (Hu et al., arXiv 2106.09685) on the linears of a model, under every plan.

An adapted linear computes ``y = base(x) + s B(A(dropout(x)))`` with A (r, in),
B (out, r), ``s = alpha / r``; the base weights are frozen. The adapters are
two layers hung on the base layer (``<path>.lora_A``, ``<path>.lora_B``, and
``<path>.lora_dropout``) and their output is added by a forward hook of the
base, so parameter names, checkpoints of the base and the model code do not
change, and whoever calls the layer (the model, a sequence split, a pipeline
stage, a recomputed block) gets the adapter.

**Layouts.** A and B follow the base layer's layout, built from the same
tensor mode as the base (:func:`add_adapters` picks them from the base's
class), so their output lands where the base's does:

======================  ===================================  ======================================
base                    A (r, in)                            B (out, r)
======================  ===================================  ======================================
one device (Linear)     whole                                whole
1D ColumnLinear         whole, replicated (its gradient is   ColumnLinear: rows cut like the base's
                        whole on every rank: ``dz`` is all-  (packed segments alike); the input
                        reduced by B's ``copy_to``)          ``z`` enters it as a replicated input
1D RowLinear            RowLinear: columns cut like the      whole, replicated; ``z`` is the partial
                        base's                               sum of A's pieces, all-reduced
1D ReplicatedKVLinear   whole                                whole; rank r uses the rows of its
                                                             head, the gradient summed over tp
2D / 2.5D Linear2D      the grid's Linear (in -> r)          the grid's Linear (r -> out, packed
                                                             like the base)
======================  ===================================  ======================================

Under Megatron sequence parallelism (``tp_sequence``: the base's ``seq_dim``)
the replicated pieces see only their rank's tokens, so they enter through
``copy_to`` and their gradient sums over ``tp``. Data, pipeline and sequence
parallelism and ZeRO treat adapters as any trainable parameter; frozen base
weights get no gradient, hence no optimizer state, no gradient all-reduce
and no ZeRO bucket. 3D tensor parallelism has no layer that maps its column
output layout to itself, so it is refused in one sentence.

Dropout acts on the adapter's input only (as peft's). Under 1D without
sequence splitting every rank drops what one device drops: replicated
inputs draw from the default generator, equal over tp, and a row layer's
input slice takes its slice of the mask one device draws for the whole
input. Under the grids each rank's block draws its own mask (as the model's
dropouts do there).

**Experts.** A mixture of experts' stacked ``gate_up`` (E, 2I, C) and ``down``
(E, C, I) take adapters per expert as peft's ``target_parameters`` does
(``ParamWrapper``): ``W_e + s B_e A_e`` for each expert ``e``, with
``lora_<name>_A`` (E, r, in) and ``lora_<name>_B`` (E, out, r) parameters of
the experts layer itself, so expert parallelism shards, gathers, averages
(over ``edp``) and checkpoints them as it does the experts. The layer's class
gains :class:`LoraExperts`, whose ``project`` adds ``s (x A_e^T) B_e^T`` to
each grouped GEMM: two more grouped GEMMs of rank ``r``, no ``E x out x in``
update materialised. peft has no dropout there, so neither has cuboid.

**Off.** :func:`adapters_off` (peft's ``disable_adapter``, what TRL runs the
reference policy of DPO and GRPO under) makes every adapted layer compute its
base alone, no copy of the weights: the hook adds nothing and ``project``
skips its low-rank term. Each layer holds one flag, ``lora_off``, that the
context sets and restores, so the plan's machinery (sequence splits,
pipeline stages, ZeRO units, compiled blocks, which recompile once for the
other value) runs unchanged; adapters skipped on every rank take no
collective with them (1D's ``copy_to`` and A's all-reduce go together).

Initialisation is peft's: A uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` (kaiming
uniform with a = sqrt(5)), B zero, each full tensor drawn from a generator
seeded by the model seed and the parameter's name, so every plan starts from
the same adapters.
"""
from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import cuboid.kernels as kernels
from cuboid.parallel import comm
from cuboid.parallel import layers as L

__all__ = ["LoraConfig", "add_adapters", "add_expert_adapters", "init_adapters", "freeze_base", "adapted",
           "adapted_experts", "adapter_parameters", "merged_weight", "merge_adapters", "LoraExperts", "ADAPTER_NAMES",
           "EXPERT_WEIGHTS", "adapters_off", "carries_adapters"]

ADAPTER_NAMES = ("lora_A", "lora_B")
EXPERT_WEIGHTS = ("gate_up", "down")  # the stacked expert parameters adapters may target, in module order


@dataclass(frozen=True)
class LoraConfig:
    """Rank ``r``, ``alpha`` (the update is scaled by alpha / r), ``dropout`` on the adapter's input, and
    ``targets``: what to adapt, by role (the zoo resolves them: ``attn``, ``qkv``, ``q``, ``k``, ``v``,
    ``o``, ``mlp``)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ("attn", "mlp")
    extra: dict = field(default_factory=dict, compare=False)  # what a peft adapter_config.json held beside

    def __post_init__(self) -> None:
        if int(self.r) != self.r or self.r < 1:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in self.targets.replace("+", ",").split(",") if t))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError("LoRA needs at least one target (attn, qkv, q, k, v, o, mlp)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @classmethod
    def parse(cls, value) -> "LoraConfig":
        """A LoraConfig from itself, a dict (``r``, ``alpha``, ``dropout``, ``targets``) or a string
        ``"r=16,alpha=32,dropout=0.05,targets=attn+mlp"``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"r", "alpha", "dropout", "targets"}
            if unknown:
                raise ValueError(f"unknown LoRA option(s) {', '.join(sorted(unknown))}: r, alpha, dropout, targets")
            return cls(**value)
        if isinstance(value, str):
            out: dict = {}
            for item in (s.strip() for s in value.split(",")):
                if not item:
                    continue
                key, eq, val = item.partition("=")
                if not eq:
                    raise ValueError(f"LoRA option {item!r} is not key=value (r=16,alpha=32,dropout=0.05,targets=attn+mlp)")
                key = key.strip()
                if key in ("r", "alpha", "dropout"):
                    try:
                        out[key] = int(val) if key == "r" else float(val)
                    except ValueError:
                        raise ValueError(f"LoRA option {item!r}: {key} takes "
                                         f"{'a whole number' if key == 'r' else 'a number'}") from None
                elif key == "targets":
                    out[key] = tuple(t for t in val.split("+") if t)
                else:
                    raise ValueError(f"unknown LoRA option {key!r}: r, alpha, dropout, targets")
            return cls(**out)
        raise TypeError(f"lora must be a dict, a 'r=16,alpha=32' string or a LoraConfig, got {type(value).__name__}")


def linear_kind(base: nn.Module) -> str:
    """Which layout a cuboid linear has (plain, kv, column, row, grid; the adapters' layout, see the module
    docstring); NotImplementedError for 3D, TypeError for a layer that is not a cuboid linear."""
    from cuboid.parallel.tensor import d1, d3
    from cuboid.parallel.tensor.d2 import Linear2D

    if isinstance(base, d1.ReplicatedKVLinear):
        return "kv"
    if isinstance(base, d1.ColumnLinear):
        return "column"
    if isinstance(base, d1.RowLinear):
        return "row"
    if isinstance(base, Linear2D):
        return "grid"
    if isinstance(base, d3.Linear3D):
        raise NotImplementedError("LoRA under 3D tensor parallelism is not built (its column output layout has no "
                                  "layer mapping it to itself); use tp1d, 2D or 2.5D")
    if type(base) is L.Linear or getattr(base, "nf4_kind", None) == "plain":  # a one-device linear, or its NF4 form
        return "plain"
    raise TypeError(f"LoRA adapts cuboid linears, not {type(base).__name__}")


def _layers(base: nn.Module, kind: str, r: int) -> tuple:
    """(A, B) for ``base`` on the meta device (no random draw), in the base's layout."""
    from cuboid.parallel.tensor import d1

    dt = base.weight.dtype
    i, o = base.in_features, base.out_features
    meta = dict(device="meta", dtype=dt)
    if kind in ("plain", "kv"):
        return L.Linear(i, r, False, **meta), L.Linear(r, o, False, **meta)
    if kind == "column":
        return (L.Linear(i, r, False, **meta),
                d1.ColumnLinear(r, o, False, group=base.axes, packed=base.packed, gather_output=base.gather_output,
                                **meta))
    if kind == "row":
        return (d1.RowLinear(i, r, False, group=base.axes, input_is_parallel=base.input_is_parallel, **meta),
                L.Linear(r, o, False, **meta))
    cls, q = type(base), base.axes.q  # the grid's linear: A's rows and B's columns are cut over q
    if r % q:
        raise ValueError(f"LoRA rank r={r} must be a multiple of the grid side q={q} under {base.axes}")
    return (cls(i, r, False, grid=base.axes, input_is_parallel=base.input_is_parallel, **meta),
            cls(r, o, False, grid=base.axes, packed=base.packed, **meta))


def _delta(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``B(A(dropout(x)))`` in the layout of ``base``'s output."""
    A, B, kind = base.lora_A, base.lora_B, base.lora_kind
    x = _row_dropout(base, x) if kind == "row" else base.lora_dropout(x)
    if kind in ("plain", "grid"):
        return B(A(x))
    seq = getattr(base, "seq_dim", None)
    g = base.axes.group("tp")
    if kind == "column":
        B.seq_dim = seq  # B gathers z's tokens as the base gathers x's
        return B(A(x) if seq is None else F.linear(x, comm.copy_to(A.weight, g)))
    if kind == "row":
        A.seq_dim = seq
        z = A(x)  # (.., r): the partial sums of A's pieces, all-reduced (or reduce-scattered on tokens)
        return B(z) if seq is None else F.linear(z, comm.copy_to(B.weight, g))
    # kv: rank r computes the rows of its head; dz and dB are partial sums over the ranks' query heads
    z = comm.copy_to(A(x), g) if seq is None else comm.all_gather_to(F.linear(x, comm.copy_to(A.weight, g)), g, seq)
    return F.linear(z, comm.copy_to(B.weight, g)[base.rows])


def _row_dropout(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A 1D row layer's input is this rank's slice of the features: its dropout mask is the slice of the mask
    one device draws for the whole (.., in) input (the same draws from the default generator, which is equal
    over tp), so a 1D run drops what one device drops. Under ``tp_sequence`` (tokens split too) the mask is
    drawn for the local tensor."""
    drop = base.lora_dropout
    p = drop.p
    if not drop.training or p == 0.0 or not base.input_is_parallel or getattr(base, "seq_dim", None) is not None \
            or base.axes.size("tp") == 1:
        return drop(x)
    tp, r = base.axes.size("tp"), base.axes.index("tp")
    n = x.shape[-1]
    keep = torch.empty(*x.shape[:-1], n * tp, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    return x * keep[..., r * n:(r + 1) * n]


def _hook(base: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    if base.lora_off:
        return out
    return out + _delta(base, args[0]) * base.lora_scaling


class LoraExperts:
    """Mixin placed before an experts layer's class (:func:`add_expert_adapters`): each grouped GEMM of an
    adapted weight gains its low-rank term, ``x W_e^T + s (x A_e^T) B_e^T`` for the rows of expert ``e``."""

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        y = super().project(name, x, counts)
        if name not in self.lora_weights or self.lora_off:
            return y
        z = kernels.grouped_mm(x, getattr(self, f"lora_{name}_A"), counts)  # (M, r)
        return y + kernels.grouped_mm(z, getattr(self, f"lora_{name}_B"), counts) * self.lora_scaling


_LORA_CLASSES: dict = {}


def _lora_class(cls: type) -> type:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraExperts, cls), {"__module__": __name__})
    return _LORA_CLASSES[cls]


def add_expert_adapters(model: nn.Module, paths: Iterable[str], names: Iterable[str], config: LoraConfig) -> list:
    """Adapters of ``config`` on the stacked expert weights ``names`` (of :data:`EXPERT_WEIGHTS`) of the
    experts layers at ``paths``: ``lora_<name>_A`` (E, r, in) and ``lora_<name>_B`` (E, out, r) parameters of
    the layer (this rank's experts under expert parallelism; on meta or materialised, left uninitialised:
    :func:`init_adapters`). Returns the adapted paths."""
    names = tuple(n for n in EXPERT_WEIGHTS if n in set(names))
    if not names:
        return []
    if config.dropout:
        raise ValueError(f"LoRA dropout {config.dropout} on the experts: peft's adapters on stacked expert weights "
                         "(target_parameters) have none; set dropout=0 or leave the experts out of the targets")
    wanted, done = set(paths), []
    for path, experts in list(model.named_modules()):
        if path not in wanted or getattr(experts, "placeholder", False):
            continue
        if isinstance(experts, LoraExperts):
            raise ValueError(f"{path} already carries LoRA adapters")
        if not callable(getattr(experts, "project", None)):
            raise NotImplementedError(f"{path}: LoRA on the experts needs the experts layer's project() seam")
        for name in names:
            w = getattr(experts, name)  # (E_local, out, in)
            e, o, i = w.shape
            for ab, shape in (("A", (e, config.r, i)), ("B", (e, o, config.r))):
                setattr(experts, f"lora_{name}_{ab}", nn.Parameter(torch.empty(shape, device=w.device, dtype=w.dtype)))
        experts.lora_plain_class = type(experts)
        experts.__class__ = _lora_class(type(experts))
        experts.lora_weights, experts.lora_scaling = names, config.scaling
        experts.lora_r, experts.lora_alpha, experts.lora_off = config.r, config.alpha, False
        experts.tag_placements()  # the adapters take the experts' placement (their ep group)
        done.append(path)
    _record(model, sorted(wanted))
    return done


def adapted_experts(model: nn.Module) -> list:
    """[(path, experts layer)] of every experts layer of ``model`` carrying adapters, in module order."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, LoraExperts)]


def adapted(model: nn.Module) -> list:
    """[(path, base layer)] of every layer of ``model`` carrying adapters, in module order."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m._modules.get("lora_A"), nn.Module)]


def add_adapters(model: nn.Module, paths: Iterable[str], config: LoraConfig) -> list:
    """Hang adapters of ``config`` on the linears at ``paths`` (sharded or not, on meta or materialised;
    placeholders of other pipeline stages' layers are skipped). Allocated adapters are left uninitialised:
    call :func:`init_adapters`. Returns the adapted paths."""
    wanted = set(paths)
    done = []
    for path, base in list(model.named_modules()):
        if path not in wanted or getattr(base, "placeholder", False):
            continue
        if hasattr(base, "lora_A"):
            raise ValueError(f"{path} already carries LoRA adapters")
        kind = linear_kind(base)
        A, B = _layers(base, kind, config.r)
        device = base.weight.device
        if device.type != "meta":
            A, B = L.to_empty(A, device), L.to_empty(B, device)
        A.lora_adapter = B.lora_adapter = True  # (optimizers route adapters alike under every plan: parallel/muon.py)
        base.lora_A, base.lora_B = A, B
        base.lora_dropout = L.Dropout(config.dropout)
        base.lora_kind, base.lora_scaling, base.lora_r, base.lora_alpha = kind, config.scaling, config.r, config.alpha
        base.lora_off = False
        base.lora_handle = base.register_forward_hook(_hook)
        done.append(path)
    _record(model, sorted(wanted))
    return done


def _record(model: nn.Module, paths: Iterable[str]) -> None:
    """Note on ``model`` the paths adapters were asked for: the same on every rank, whichever pipeline stage
    (and so whichever adapted layers) it holds, so :func:`carries_adapters` answers alike everywhere."""
    model.lora_targets = tuple(getattr(model, "lora_targets", ())) + tuple(p for p in paths)


def carries_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters: asked for on it (every rank of a plan answers alike, even one
    whose pipeline stages hold no adapted layer) or held by one of its layers (a part of a model)."""
    return bool(getattr(model, "lora_targets", ())) or bool(adapted(model)) or bool(adapted_experts(model))


@contextmanager
def adapters_off(model: nn.Module):
    """Within the block, ``model`` computes its base model's outputs: every adapter is skipped (no merged or
    copied weights), under every plan; on exit (or an exception) each layer gets back the state it had, so
    nested blocks and the adapters' outputs come back exactly. The reference policy of DPO and GRPO:
    ``with torch.no_grad(), adapters_off(model): ref = model(**batch)``.

    The base is frozen, so a forward inside needs no gradients (nothing in it requires one). A model without
    adapters is refused (``ValueError``): its "base" would be the trained model itself, and a reference policy
    equal to the policy trains nothing without a word. Decided from what every rank was asked to adapt, so
    every rank of a plan raises or enters alike; entering and leaving make no collective."""
    if not carries_adapters(model):
        raise ValueError(f"adapters_off: the {type(model).__name__} carries no LoRA adapters (load it with "
                         "lora=...); a fully trained model's base is a separate copy of the base weights")
    layers = [m for _, m in adapted(model)] + [m for _, m in adapted_experts(model)]
    saved = [m.lora_off for m in layers]
    for m in layers:
        m.lora_off = True
    try:
        yield model
    finally:
        for m, was in zip(layers, saved):
            m.lora_off = was


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_pair(a_layer: nn.Module, a_name: str, b_layer: nn.Module, b_name: str, seed: int, key: str) -> None:
    full = torch.empty(a_layer.full_shape(a_name))
    bound = 1.0 / math.sqrt(full.shape[-1])
    full.uniform_(-bound, bound, generator=torch.Generator().manual_seed(_seed(seed, key)))
    a_layer.load_full(a_name, full)
    b_layer.load_full(b_name, torch.zeros(b_layer.full_shape(b_name)))


def init_adapters(model: nn.Module, seed: int = 0) -> None:
    """peft's initialisation: A uniform in [-1/sqrt(in), 1/sqrt(in)] from a generator per (seed, name), B zero;
    each rank keeps its slice of the full tensors (the same adapters under every plan)."""
    for path, base in adapted(model):
        _init_pair(base.lora_A, "weight", base.lora_B, "weight", seed, f"{path}.lora_A.weight")
    for path, experts in adapted_experts(model):
        for name in experts.lora_weights:
            a, b = f"lora_{name}_A", f"lora_{name}_B"
            _init_pair(experts, a, experts, b, seed, f"{path}.{a}")


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train: every other parameter stops requiring gradients (before ``prepare``, so data
    parallelism and ZeRO see only the adapters)."""
    keep = {id(p) for p in adapter_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def adapter_parameters(model: nn.Module) -> list:
    """The adapters' parameters (A and B of every adapted layer, then of every adapted experts layer), in
    module order."""
    return [m.weight for _, base in adapted(model) for m in (base.lora_A, base.lora_B)] + [
        getattr(experts, f"lora_{name}_{ab}") for _, experts in adapted_experts(model)
        for name in experts.lora_weights for ab in "AB"]


def merged_weight(base: nn.Module) -> torch.Tensor:
    """The full merged weight ``W + s B A`` of an adapted layer (collectives over its shard group, as
    ``full_tensor``)."""
    w = base.full_tensor("weight")
    a, b = base.lora_A.full_tensor("weight"), base.lora_B.full_tensor("weight")
    return (w.float() + base.lora_scaling * (b.float() @ a.float())).to(w.dtype)


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + s B A``; experts: ``W_e + s B_e A_e``, each rank its own
    experts) and remove it; in place, returns ``model``. A collective under tensor parallelism (each merged
    weight is gathered whole, then each rank keeps its slice); every rank calls it."""
    for _, experts in adapted_experts(model):
        with torch.no_grad():
            for name in experts.lora_weights:
                w = getattr(experts, name)
                a, b = getattr(experts, f"lora_{name}_A"), getattr(experts, f"lora_{name}_B")
                w.copy_((w.float() + experts.lora_scaling * torch.bmm(b.float(), a.float())).to(w.dtype))
                del experts._parameters[f"lora_{name}_A"], experts._parameters[f"lora_{name}_B"]
        experts.__class__ = experts.lora_plain_class
        for attr in ("lora_weights", "lora_scaling", "lora_r", "lora_alpha", "lora_plain_class", "lora_off"):
            delattr(experts, attr)
    for _, base in adapted(model):
        base.load_full("weight", merged_weight(base))
        base.lora_handle.remove()
        for name in ("lora_A", "lora_B", "lora_dropout", "lora_handle", "lora_kind", "lora_scaling", "lora_r",
                     "lora_alpha", "lora_off"):
            delattr(base, name)
    model.lora_targets = ()
    return model
