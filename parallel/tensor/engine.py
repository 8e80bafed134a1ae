"""One walker for every tensor mode: a mode is a role -> layer table, applied to a model by its spec.

torch's ``parallelize_module`` with ``ParallelStyle``s and torchtitan's
per-block plans are the models: a model's :class:`~cuboid.parallel.ShardingSpec`
says what each layer *is* (``column``, ``column_qkv``, ``column_kv``, ``row``,
``vocab``, ``embedding``, ``norm``, ``head_norm``, ``replicate``), and each mode says what that means on
its grid with a table of :class:`Style` rows:

    role(s) + single-device layer type [+ a predicate on the site] -> sharded layer (+ its options)

:func:`parallelize_module` walks the model once, finds the first matching row
for every module the spec names, builds the sharded layer with the layer's
``from_full`` (a meta model stays on meta; a materialised one has its weights
sliced in) and puts it in place. A row whose layer is ``None`` keeps the
module whole; a module no row matches is a ``TypeError`` naming its path,
role and type. :func:`shard_model` picks the table from ``mesh.plan.tp_mode``
(:data:`MODES`: each mode module exports ``MODE``, a :class:`Mode`).

Predicates (:func:`row_sibling`, :func:`no_row_sibling`, :func:`square`,
:func:`rms`, :func:`takes_hidden`, :func:`hidden_last`) see a :class:`Site`:
the model, spec, path, module and role.

:func:`step_bytes` is the communication of one training step of a GPT-shaped
model (token lookup, learned positions, pre-LN blocks of qkv / proj / fc /
proj, final norm, tied vocab-parallel head and shifted loss), summed from a
mode's per-layer ``Costs`` (the formulas live there, once); each mode exposes
it as ``bytes_per_step`` and :func:`bytes_per_step` dispatches on a plan.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.tensor.base import Sharded

__all__ = ["Site", "Style", "Mode", "MODES", "mode_of", "parallelize_module", "shard_model", "step_bytes", "step_parts",
           "bytes_per_step", "Costs", "row_sibling", "no_row_sibling", "square", "rms", "takes_hidden", "hidden_last",
           "ANY"]

MODES = {"1d": "d1", "2d": "d2", "2.5d": "d2p5", "3d": "d3"}  # tp_mode -> module of cuboid.parallel.tensor
ANY = L.ShardedModule  # as a Style's source: any cuboid layer


@dataclass(frozen=True)
class Site:
    """A module the walker is placing: what a style's predicate and options see."""

    model: nn.Module
    spec: Any
    path: str
    module: nn.Module
    role: str
    hidden: Optional[int]  # the model's hidden size (config.dim, else the first norm's width)

    @property
    def packed(self) -> int:
        """Packed segments of a fused projection: 3 for ``column_qkv``."""
        return 3 if self.role == "column_qkv" else 1


def row_sibling(s: Site) -> bool:
    """The module's parent also holds a ``row`` layer (a column feeding a row: attention, MLP)."""
    parent = s.path.rpartition(".")[0]
    mod = s.model.get_submodule(parent) if parent else s.model
    return any(s.spec.role_of(f"{parent}.{n}" if parent else n) == "row" for n, _ in mod.named_children())


def no_row_sibling(s: Site) -> bool:
    """A column layer that takes a model input (ViT's patch projection): nothing row-split follows it."""
    return not row_sibling(s)


def square(s: Site) -> bool:
    """A linear with in == out (pooler, MLM transform): its output stays in the hidden layout."""
    return s.module.in_features == s.module.out_features


def rms(s: Site) -> bool:
    """An RMS norm: :class:`~cuboid.parallel.layers.RMSNorm` or a subclass (Gemma's ``1 + weight``)."""
    return isinstance(s.module, L.RMSNorm)


def takes_hidden(s: Site) -> bool:
    return s.module.in_features == s.hidden


def hidden_last(s: Site) -> bool:
    return s.module.weight.shape[-1] == s.hidden


@dataclass(frozen=True)
class Style:
    """One row of a mode's table: the modules with one of ``roles``, of exactly type ``source``
    (``ANY``: any cuboid layer), for which ``when(site)`` holds, become ``layer.from_full(module,
    where, **options(site))``; ``layer=None`` keeps them whole."""

    roles: tuple
    source: type
    layer: Optional[type]
    options: Callable[[Site], dict] = lambda s: {}
    when: Callable[[Site], bool] = lambda s: True

    def matches(self, s: Site) -> bool:
        kind = isinstance(s.module, ANY) if self.source is ANY else type(s.module) is self.source
        return s.role in self.roles and kind and self.when(s)


@dataclass(frozen=True)
class Mode:
    """A tensor mode: its table, what its layers are built on, and its per-layer traffic."""

    name: str                                # "1D", "2D", "2.5D", "3D" (for messages)
    styles: tuple                            # Style rows, first match wins
    place: Callable[[Any], Any]              # mesh (or what its layers take) -> the layers' ``where``
    costs: Callable[..., Any]                # (plan, dtype, autocast) -> the mode's Costs


def _hidden(model: nn.Module) -> Optional[int]:
    dim = getattr(getattr(model, "config", None), "dim", None)
    return dim or next((m.dim for m in model.modules() if isinstance(m, L.LayerNorm)), None)


def parallelize_module(model: nn.Module, spec, mode: Mode, where) -> nn.Module:
    """Replace every module ``spec`` names by the layer ``mode``'s table gives it, in place; returns ``model``.

    ``where``: what the mode's layers are built on (``mode.place(mesh)``).
    Modules already sharded are left as they are, so walking twice is harmless;
    placeholders of modules another pipeline stage holds are skipped.
    """
    hidden = _hidden(model)
    for path, mod in list(model.named_modules()):
        role = spec.role_of(path) if path else None
        if role is None or isinstance(mod, Sharded) or getattr(mod, "placeholder", False):
            continue  # already sharded, or held by another pipeline stage
        site = Site(model, spec, path, mod, role, hidden)
        style = next((s for s in mode.styles if s.matches(site)), None)
        if style is None:
            raise TypeError(f"{path}: role {role!r} does not apply to a {type(mod).__name__} "
                            f"in {mode.name} tensor parallelism")
        if style.layer is None:
            mod.role = role
            continue
        new = style.layer.from_full(mod, where, **style.options(site))
        new.role = role
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def mode_of(tp_mode: str) -> Mode:
    """The :class:`Mode` of a plan's ``tp_mode``."""
    if tp_mode not in MODES:
        raise ValueError(f"tp_mode must be one of {', '.join(MODES)}, got {tp_mode!r}")
    return importlib.import_module(f"cuboid.parallel.tensor.{MODES[tp_mode]}").MODE


def shard_model(model: nn.Module, spec, mesh) -> nn.Module:
    """Swap ``model``'s layers for those of ``mesh.plan.tp_mode`` by ``spec``'s roles (in place; meta too).

    With one tensor rank nothing is swapped; the spec's roles are only recorded on the layers.
    """
    if mesh.size("tp") == 1:
        if spec is not None:
            spec.apply_roles(model)
        return model
    if spec is None:
        raise ValueError(f"tp_mode {mesh.plan.tp_mode} shards layers by role: pass the model's sharding spec")
    mode = mode_of(mesh.plan.tp_mode)
    return parallelize_module(model, spec, mode, mode.place(mesh))


# ---------------------------------------------------------------- traffic of a training step


class Costs:
    """Base of a mode's per-layer traffic: each method returns ``(forward, backward)`` bytes one rank sends.

    ``b``: bytes of a parameter element (``dtype``), also of activations that
    are not matmul operands (lookups); ``c``: bytes of a matmul operand, the
    ``autocast`` dtype's when given (:func:`.base.to_compute` casts before the
    gathers). ``n`` rows are always counted whole (B T of the tensor group's
    batch); a mode divides them as its layout does. Layers a mode keeps whole
    cost nothing.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, autocast: Optional[torch.dtype] = None) -> None:
        self.b = torch.empty((), dtype=dtype).element_size()
        self.c = torch.empty((), dtype=autocast or dtype).element_size()

    def norm(self, h: int, n: int, bias: bool = True) -> tuple:
        return 0.0, 0.0

    def embedding(self, rows: int, h: int) -> tuple:
        return 0.0, 0.0


def step_parts(costs, config, batch: int, seq: int) -> dict:
    """The ``(forward, backward)`` bytes of a GPT-shaped training step per part: ``first`` (token and
    position embeddings), ``block`` (one transformer block: GPT's, or Llama's with grouped K/V and SwiGLU)
    and ``last`` (final norm, vocab-parallel head and loss);
    the arguments as in :func:`step_bytes`. A pipeline stage sums the parts it holds."""
    h, v = config.dim, config.vocab_size
    f = getattr(config, "hidden", None) or getattr(config, "mlp_hidden", 0) or 4 * h
    n = batch * seq
    if getattr(config, "n_kv_heads", 0):  # Llama: q, k, v apart (grouped k, v), SwiGLU, RMSNorm, no position table
        q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        block = [costs.norm(h, n, bias=False), costs.linear("column", h, q, n), costs.linear("column", h, kv, n),
                 costs.linear("column", h, kv, n), costs.linear("row", q, h, n), costs.norm(h, n, bias=False),
                 costs.linear("column", h, f, n), costs.linear("column", h, f, n), costs.linear("row", f, h, n)]
        return {"first": [costs.lookup(v, h, n)], "block": block,
                "last": [costs.norm(h, n, bias=False), costs.lm_loss(v, h, n, batch * (seq - 1))]}
    block = [costs.norm(h, n), costs.linear("column_qkv", h, 3 * h, n), costs.linear("row", h, h, n),
             costs.norm(h, n), costs.linear("column", h, f, n), costs.linear("row", f, h, n)]
    return {"first": [costs.lookup(v, h, n), costs.embedding(config.n_positions, h)], "block": block,
            "last": [costs.norm(h, n), costs.lm_loss(v, h, n, batch * (seq - 1))]}


def step_bytes(costs, config, batch: int, seq: int) -> float:
    """Bytes one rank sends in one training step (forward + backward) of a GPT-shaped model.

    ``config``: ``dim``, ``n_layers``, ``vocab_size``, ``n_positions`` and the
    MLP width ``hidden`` (or ``mlp_hidden``; 4 ``dim`` by default); ``batch`` x
    ``seq`` tokens fed to the tensor group (a dp share), the loss over the
    ``batch (seq - 1)`` shifted labels. ``costs``: a mode's ``Costs``
    (``(forward, backward)`` bytes per layer, all rows counted whole).
    """
    parts = step_parts(costs, config, batch, seq)
    everything = parts["first"] + parts["block"] * config.n_layers + parts["last"]
    return float(sum(fwd + bwd for fwd, bwd in everything))


def bytes_per_step(config, plan, batch: int, seq: int, *, dtype: torch.dtype = torch.float32,
                   autocast: Optional[torch.dtype] = None) -> float:
    """:func:`step_bytes` under ``plan``'s tensor mode (parameters in ``dtype``, matmuls in ``autocast``)."""
    return step_bytes(mode_of(plan.tp_mode).costs(plan, dtype, autocast), config, batch, seq)
