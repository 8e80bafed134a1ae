"""Mapping zoo models to and from Hugging Face ``transformers`` checkpoints.

A family's ``hf.py`` describes its names with :class:`TensorMap` rows: one zoo
parameter made from one or more HF tensors (GPT-2's Conv1D weights are
transposed, BERT's and ViT's separate query/key/value are stacked into the fused
``qkv``, ViT's patch kernel is reshaped). Each row says how to go both ways:
``view`` turns the stored tensors into the zoo tensor *lazily* (a
:class:`Transposed`, :class:`Stacked` or :class:`Reshaped` view that a layer
slices like the full zoo tensor, reading only its own part of the file), and
``to_hf`` splits a full zoo tensor into the stored ones.

This module holds the mapping only and imports nothing of the zoo: the I/O is
the checkpoint package's, so a Hugging Face folder and a cuboid checkpoint
are read by the same reader (:mod:`cuboid.zoo.checkpoint.reader`) and written
by the same writer (:mod:`cuboid.zoo.checkpoint.writer`); ``cuboid.zoo.from_hf``
and ``to_hf`` join the two.

``transformers`` itself is never imported: configs are plain JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

Tensors = List[torch.Tensor]


def _first(stored: Sequence[Any]) -> Any:
    return stored[0]


def _identity_out(t: torch.Tensor) -> Tensors:
    return [t]


# ------------------------------------------------------------------ lazy views
#
# A *sliceable* is a full tensor or a safetensors ``get_slice`` object: it has
# a shape, and ``x[slices]`` (one slice per dim, step 1) reads just that block.
# The views below are sliceables too, shaped like the zoo tensor, so a layer's
# ``local_part(name, view)`` / ``load_full(name, view)`` reads only its slices
# through them, whatever the mapping.


def shape_of(x: Any) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x.get_shape())


def _dtype_of(x: Any):
    return x.dtype if isinstance(x, torch.Tensor) else x.get_dtype()


def _slices(idx: Any, shape: Sequence[int]) -> tuple:
    """``idx`` as one ``slice(start, stop)`` per dim (missing trailing dims: whole)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) > len(shape):
        raise IndexError(f"{len(idx)} indices for a tensor of shape {tuple(shape)}")
    out = []
    for s, n in zip(idx + (slice(None),) * (len(shape) - len(idx)), shape):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError(f"lazy views take slices with step 1, got {s!r}")
        a, b, _ = s.indices(n)
        out.append(slice(a, max(a, b)))
    return tuple(out)


def _read(x: Any, idx: tuple) -> torch.Tensor:
    return torch.as_tensor(x[idx])


class Transposed:
    """A 2-D stored (in, out) tensor seen as the zoo's (out, in): ``[a, b]`` reads ``[b, a]`` and returns its ``.t()``.

    GPT-2's Conv1D weights. The result is a view of what was read (no copy):
    the whole tensor comes back as the file's bytes in transposed layout.
    """

    def __init__(self, stored: Any) -> None:
        self.stored = stored

    def get_shape(self) -> list:
        return list(reversed(shape_of(self.stored)))

    def get_dtype(self):
        return _dtype_of(self.stored)

    def __getitem__(self, idx) -> torch.Tensor:
        a, b = _slices(idx, self.get_shape())
        return _read(self.stored, (b, a)).t()


class Stacked:
    """Stored tensors of equal trailing shape seen stacked on dim 0 (q, k, v -> the fused qkv).

    A slice of dim 0 reads only the rows of each part it covers; a slice
    inside one part is that part's rows, as read (no copy).
    """

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.rows = [shape_of(p)[0] for p in self.parts]

    def get_shape(self) -> list:
        return [sum(self.rows), *shape_of(self.parts[0])[1:]]

    def get_dtype(self):
        return _dtype_of(self.parts[0])

    def __getitem__(self, idx) -> torch.Tensor:
        first, *rest = _slices(idx, self.get_shape())
        pieces, at = [], 0
        for part, n in zip(self.parts, self.rows):
            a, b = max(first.start - at, 0), min(first.stop - at, n)
            if b > a:
                pieces.append(_read(part, (slice(a, b), *rest)))
            at += n
        if not pieces:  # an empty slice
            return _read(self.parts[0], (slice(0, 0), *rest))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


class Reshaped:
    """A stored tensor seen with another shape of the same leading dim (ViT's (D, C, p, p) patch kernel as (D, C p p)).

    A slice of dim 0 reads only those rows.
    """

    def __init__(self, stored: Any, shape: Sequence[int]) -> None:
        self.stored, self.shape = stored, tuple(shape)
        src = shape_of(stored)
        if torch.Size(src).numel() != torch.Size(self.shape).numel() or src[:1] != self.shape[:1]:
            raise ValueError(f"cannot view a stored {src} tensor as {self.shape} row by row")

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self):
        return _dtype_of(self.stored)

    def __getitem__(self, idx) -> torch.Tensor:
        first, *rest = _slices(idx, self.shape)
        src = shape_of(self.stored)
        rows = _read(self.stored, (first, *(slice(0, n) for n in src[1:])))
        return rows.reshape(rows.shape[0], *self.shape[1:])[(slice(None), *rest)]


class PerExpert:
    """One stored tensor per expert and part (gate, up; or down) seen as the zoo's (E, rows, cols) experts
    tensor: expert e is its ``per`` parts concatenated on their rows. A slice of dim 0 reads only those
    experts' tensors (expert parallelism), a slice of dim 1 only the rows of the parts it covers."""

    def __init__(self, parts: Sequence[Any], per: int) -> None:
        if len(parts) % per:
            raise ValueError(f"{len(parts)} stored tensors do not split into experts of {per} parts")
        self.experts = [Stacked(parts[i:i + per]) for i in range(0, len(parts), per)]

    def get_shape(self) -> list:
        return [len(self.experts), *self.experts[0].get_shape()]

    def get_dtype(self):
        return self.experts[0].get_dtype()

    def __getitem__(self, idx) -> torch.Tensor:
        first, *rest = _slices(idx, self.get_shape())
        chosen = [e[tuple(rest)] for e in self.experts[first]]
        if not chosen:
            return self.experts[0][tuple(rest)][None][:0]
        return torch.stack(chosen, 0)


@dataclass(frozen=True)
class TensorMap:
    """One zoo parameter <- HF tensors, with the transforms both ways.

    ``view(stored)``: the zoo tensor as a lazy sliceable over the stored
    tensors (sliceables, in ``hf`` order); ``to_hf(full)``: the stored tensors
    of a full zoo tensor.
    """

    zoo: str
    hf: Sequence[str]
    view: Callable[[Sequence[Any]], Any] = _first
    to_hf: Callable[[torch.Tensor], Tensors] = _identity_out
    top: bool = False  # a head tensor: stored outside the base model's prefix
    # another stored form of the same tensor, read where this row's tensors are absent (gpt-oss's MXFP4 experts);
    # a model is always written in this row's form
    alt: Optional["TensorMap"] = None


def weight_bias(zoo: str, hf: str) -> List[TensorMap]:
    """The ``.weight`` and ``.bias`` rows of a layer stored as it is."""
    return [TensorMap(f"{zoo}.weight", (f"{hf}.weight",)), TensorMap(f"{zoo}.bias", (f"{hf}.bias",))]


def transposed(zoo: str, hf: str) -> TensorMap:
    """A GPT-2 Conv1D weight: HF stores (in, out), the zoo (out, in)."""
    return TensorMap(zoo, (hf,), lambda s: Transposed(s[0]), lambda t: [t.t().contiguous()])


def stacked(zoo: str, hf: Sequence[str]) -> TensorMap:
    """Separate q/k/v tensors stacked on dim 0 into the fused qkv."""
    n = len(hf)
    return TensorMap(zoo, tuple(hf), Stacked, lambda t: [c.contiguous() for c in t.chunk(n, 0)])


def per_expert(zoo: str, hf: Sequence[str], per: int) -> TensorMap:
    """An experts tensor (E, rows, cols) from one stored tensor per expert and part (``hf`` expert-major:
    expert 0's ``per`` parts, then expert 1's, ...), each part a block of rows (gate then up)."""
    def to_hf(t: torch.Tensor) -> Tensors:
        return [c.contiguous() for e in t for c in e.chunk(per, 0)]

    return TensorMap(zoo, tuple(hf), lambda s: PerExpert(s, per), to_hf)


def reshaped(zoo: str, hf: str, zoo_shape: Sequence[int], hf_shape: Sequence[int]) -> TensorMap:
    return TensorMap(zoo, (hf,), lambda s: Reshaped(s[0], zoo_shape),
                     lambda t: [t.reshape(*hf_shape).contiguous()])


@dataclass
class Family:
    """What hf_io needs to know of one zoo family (filled in by its ``hf.py``)."""

    name: str
    architectures: Dict[str, dict]                    # HF architecture -> config overrides (head, ...)
    base_prefix: str                                  # "transformer." / "bert." / "vit."
    config_from_hf: Callable[[dict, str], object]    # (config.json dict, architecture) -> zoo config
    config_to_hf: Callable[[object], dict]            # zoo config -> config.json dict
    architecture_of: Callable[[object], str]          # zoo config -> HF architecture
    tensor_maps: Callable[[object], List[TensorMap]]  # zoo config -> rows
    build: Callable[[object], torch.nn.Module]
    ignored: Sequence[str] = field(default_factory=tuple)  # HF key suffixes that carry nothing (buffers)
    renames: Sequence[tuple] = field(default_factory=tuple)  # legacy HF key fragments -> current


# ------------------------------------------------------------------ folders


def read_config(path: Path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def normalise_keys(keys: Iterable[str], family: Family) -> Dict[str, str]:
    """Canonical HF name (no base prefix, legacy fragments renamed) -> stored name."""
    out = {}
    for key in keys:
        canon = key[len(family.base_prefix):] if key.startswith(family.base_prefix) else key
        for old, new in family.renames:
            canon = canon.replace(old, new)
        out[canon] = key
    return out


def architecture_from_config(cfg: dict, families: Sequence[Family], path: Path) -> tuple[Family, str]:
    archs = cfg.get("architectures") or []
    for fam in families:
        for arch in archs:
            if arch in fam.architectures:
                return fam, arch
    supported = sorted(a for fam in families for a in fam.architectures)
    got = ", ".join(archs) if archs else f"none (model_type={cfg.get('model_type')!r})"
    raise ValueError(f"{path}: unsupported architecture {got}; supported: {', '.join(supported)}")
