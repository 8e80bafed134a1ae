"""Mapping zoo models to and from Hugging Face ``transformers`` checkpoints.

A family's ``hf.py`` describes its names with :class:`TensorMap` rows: one zoo
parameter made from one or more HF tensors (GPT-2's Conv1D weights are
transposed, BERT's and ViT's separate query/key/value are stacked into the fused
``qkv``). This module does the rest for every family: read a local HF folder
(``config.json`` + ``model.safetensors`` or a sharded index), build the zoo
model, load the weights with errors that name the key and both shapes, and
write a folder ``transformers.AutoModel*.from_pretrained`` loads.

``transformers`` itself is never imported: configs are plain JSON.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .common import sharded_parameters

Tensors = List[torch.Tensor]


def _identity_in(ts: Tensors) -> torch.Tensor:
    return ts[0]


def _identity_out(t: torch.Tensor) -> Tensors:
    return [t]


@dataclass(frozen=True)
class TensorMap:
    """One zoo parameter <- HF tensors, with the transforms both ways."""

    zoo: str
    hf: Sequence[str]
    to_zoo: Callable[[Tensors], torch.Tensor] = _identity_in
    to_hf: Callable[[torch.Tensor], Tensors] = _identity_out
    top: bool = False  # a head tensor: stored outside the base model's prefix
    kind: str = ""     # "transposed" / "stacked" / "reshaped" when built by those helpers (lazy readers use it)


def weight_bias(zoo: str, hf: str) -> List[TensorMap]:
    """The ``.weight`` and ``.bias`` rows of a layer stored as it is."""
    return [TensorMap(f"{zoo}.weight", (f"{hf}.weight",)), TensorMap(f"{zoo}.bias", (f"{hf}.bias",))]


def transposed(zoo: str, hf: str) -> TensorMap:
    """A GPT-2 Conv1D weight: HF stores (in, out), the zoo (out, in)."""
    return TensorMap(zoo, (hf,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()],
                     kind="transposed")


def stacked(zoo: str, hf: Sequence[str]) -> TensorMap:
    """Separate q/k/v tensors stacked on dim 0 into the fused qkv."""
    n = len(hf)
    return TensorMap(zoo, tuple(hf), lambda ts: torch.cat(ts, 0),
                     lambda t: [c.contiguous() for c in t.chunk(n, 0)], kind="stacked")


def reshaped(zoo: str, hf: str, zoo_shape: Sequence[int], hf_shape: Sequence[int]) -> TensorMap:
    return TensorMap(zoo, (hf,), lambda ts: ts[0].reshape(*zoo_shape),
                     lambda t: [t.reshape(*hf_shape).contiguous()], kind="reshaped")


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


# ----------------------------------------------------------------------- reading


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: no config.json")
    with open(cfg_path) as f:
        return json.load(f)


class SafetensorsFolder:
    """Lazy, name-addressed access to the tensors of a folder's safetensors files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif single.is_file():
            weight_map = None
        else:
            extra = " (only PyTorch .bin weights found: convert them to safetensors)" if any(
                path.glob("*.bin")) else ""
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json{extra}")
        self._handles: Dict[str, object] = {}
        if weight_map is None:
            self.weight_map = {k: "model.safetensors" for k in self._open("model.safetensors").keys()}
        else:
            for name, file in weight_map.items():
                self._check_name(file, name)
            self.weight_map = dict(weight_map)

    def _check_name(self, file: str, tensor: str) -> None:
        p = Path(file)
        if p.is_absolute() or ".." in p.parts or len(p.parts) != 1:
            raise ValueError(f"{self.path}: shard name {file!r} for {tensor} escapes the folder")

    def _open(self, file: str):
        h = self._handles.get(file)
        if h is None:
            full = self.path / file
            if not full.is_file():
                raise FileNotFoundError(f"{self.path}: the index names {file}, which does not exist")
            h = safe_open(str(full), framework="pt")
            self._handles[file] = h
        return h

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        return self._open(self.weight_map[name]).get_tensor(name)


def _normalise_keys(folder: SafetensorsFolder, family: Family) -> Dict[str, str]:
    """Canonical HF name (no base prefix, legacy fragments renamed) -> stored name."""
    out = {}
    for key in folder.keys():
        canon = key[len(family.base_prefix):] if key.startswith(family.base_prefix) else key
        for old, new in family.renames:
            canon = canon.replace(old, new)
        out[canon] = key
    return out


def load_hf_weights(model: torch.nn.Module, family: Family, path: Path, *, strict: bool = True) -> dict:
    """Load a local HF folder's tensors into ``model``; returns {missing, unexpected, mismatched}.

    With ``strict`` any problem is a ``ValueError`` that names every key with both shapes.
    """
    folder = SafetensorsFolder(path)
    stored = _normalise_keys(folder, family)
    params = {name: (mod, local) for name, mod, local, _ in sharded_parameters(model)}
    used, missing, mismatched = set(), [], []
    loads = []
    for row in family.tensor_maps(model.config):
        if row.zoo not in params:
            continue
        if not all(h in stored for h in row.hf):
            missing.extend(h for h in row.hf if h not in stored)
            continue
        used.update(row.hf)
        full = row.to_zoo([folder.get(stored[h]) for h in row.hf])
        mod, local = params[row.zoo]
        want = tuple(mod.full_shape(local))
        if tuple(full.shape) != want:
            mismatched.append(f"{' + '.join(row.hf)} -> {row.zoo}: checkpoint {tuple(full.shape)}, model {want}")
            continue
        loads.append((mod, local, full))
    unexpected = [k for k in stored if k not in used and not k.endswith(tuple(family.ignored))]
    problems = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    if strict and any(problems.values()):
        lines = [f"{kind}: {', '.join(v)}" for kind, v in problems.items() if v]
        raise ValueError(f"{path}: weights do not fit the {family.name} model; " + "; ".join(lines))
    for mod, local, full in loads:
        mod.load_full(local, full)
    return problems


# ----------------------------------------------------------------------- writing


def hf_state_dict(model: torch.nn.Module, family: Family) -> Dict[str, torch.Tensor]:
    """The model's full tensors under HF names (with the architecture's prefix)."""
    arch = family.architecture_of(model.config)
    prefix = family.base_prefix if family.architectures[arch].get("prefixed", True) else ""
    params = {name: (mod, local) for name, mod, local, _ in sharded_parameters(model)}
    out = {}
    for row in family.tensor_maps(model.config):
        if row.zoo not in params:
            continue
        mod, local = params[row.zoo]
        for hf_name, t in zip(row.hf, row.to_hf(mod.full_tensor(local))):
            out[hf_name if row.top else prefix + hf_name] = t.detach().cpu().contiguous()
    return out


def save_hf(model: torch.nn.Module, family: Family, path: os.PathLike) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, family)
    cfg = family.config_to_hf(model.config)
    cfg["architectures"] = [family.architecture_of(model.config)]
    dtype = next(iter(tensors.values())).dtype
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return path


def architecture_from_config(cfg: dict, families: Sequence[Family], path: Path) -> tuple[Family, str]:
    archs = cfg.get("architectures") or []
    for fam in families:
        for arch in archs:
            if arch in fam.architectures:
                return fam, arch
    supported = sorted(a for fam in families for a in fam.architectures)
    got = ", ".join(archs) if archs else f"none (model_type={cfg.get('model_type')!r})"
    raise ValueError(f"{path}: unsupported architecture {got}; supported: {', '.join(supported)}")


def from_hf(path: os.PathLike, families: Sequence[Family], *, dtype: Optional[torch.dtype] = None,
            device=None, strict: bool = True, transform: Optional[Callable] = None) -> torch.nn.Module:
    """Build the zoo model for a local HF folder and load its weights.

    ``transform(model)`` runs on the meta-device model before anything is
    allocated (the tensor modes shard there), so a rank allocates and reads only
    its own slices.
    """
    path = Path(path)
    cfg = read_config(path)
    family, arch = architecture_from_config(cfg, families, path)
    config = family.config_from_hf(cfg, arch)
    with torch.device("meta"):
        model = family.build(config)
    if transform is not None:
        model = transform(model)
    model.to_empty(device=device or "cpu")
    model.init_weights(0)  # anything the checkpoint lacks (strict=False) is initialised, not garbage
    load_hf_weights(model, family, path, strict=strict)
    if dtype is not None:
        model.to(dtype)
    return model
