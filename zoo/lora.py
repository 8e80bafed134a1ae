"""LoRA on zoo models: targets by role, and adapters saved and loaded in ``peft``'s layout.

- :func:`target_paths`: the linears a LoRA config's ``targets`` name in a
  model (``attn``: the attention's input projections and output; ``qkv``,
  ``q``, ``k``, ``v``, ``o``: parts of it; ``mlp``: every MLP linear;
  ``gate``, ``up``, ``down``: parts of it, ``up`` being a plain MLP's fc), read
  off the family's sharding spec, so every family (GPT, BERT, ViT, Llama)
  gets them;
- :func:`attach`: adapters on those linears (:mod:`cuboid.parallel.lora`),
  initialised as peft does, the base frozen (``cuboid.load(..., lora=...)``);
- :func:`save_adapters` / :func:`load_adapters`: ``adapter_config.json`` +
  ``adapter_model.safetensors`` under peft's names for the model's Hugging
  Face architecture (``base_model.model.<HF module>.lora_A.weight``), so
  ``peft.PeftModel.from_pretrained(base, folder)`` loads them, written
  atomically under a commit file that a load verifies
  (:mod:`cuboid.zoo.checkpoint.lora_state`); loads under any plan (each
  rank keeps its slices). A fused qkv (BERT, ViT, whose HF
  layers are separate query/key/value) is saved as three peft adapters
  sharing A, B cut in three, which is the same update; GPT-2's Conv1D
  layers are saved with ``fan_in_fan_out`` as peft expects;
- :func:`merge_to_hf`: an adapter folder folded into its base model, written
  as a Hugging Face folder (``cuboid convert --merge-lora``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from cuboid.parallel import lora as plora
from cuboid.parallel.lora import LoraConfig

from .checkpoint.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_config,  # noqa: F401
                                  adapter_state)
from .checkpoint.lora_state import save_adapters  # noqa: F401
from .checkpoint.adapters import hf_modules as _rows
from .families import family_of


_ATTN = ("attn.qkv", "attn.q", "attn.k", "attn.v")
SUFFIXES = {"qkv": _ATTN, "q": ("attn.q",), "k": ("attn.k",), "v": ("attn.v",), "o": ("attn.proj",),
            "attn": _ATTN + ("attn.proj",), "mlp": ("mlp.fc", "mlp.gate", "mlp.up", "mlp.proj"),
            "gate": ("mlp.gate",), "up": ("mlp.up", "mlp.fc"), "down": ("mlp.proj",)}


def _spec(model: nn.Module):
    from .plans import SPECS

    return SPECS[family_of(model).name]


def target_paths(model: nn.Module, targets) -> list:
    """Module paths of the linears ``targets`` names (every block, whatever this rank holds)."""
    spec = _spec(model)
    head = f"{spec.blocks}.*."
    have = {k[len(head):] for k in spec.roles if k.startswith(head) and spec.roles[k] in
            ("column", "column_qkv", "column_kv", "row")}
    chosen = set()
    for t in targets:
        if t not in SUFFIXES:
            raise ValueError(f"unknown LoRA target {t!r}: one of {', '.join(SUFFIXES)}")
        found = [s for s in SUFFIXES[t] if s in have]
        if not found:
            raise ValueError(f"LoRA target {t!r} names no layer of a {family_of(model).name} block "
                             f"(its linears: {', '.join(sorted(have))})")
        chosen.update(found)
    order = [s for s in sorted(have) if s in chosen]
    return [f"{spec.blocks}.{i}.{s}" for i in range(model.config.n_layers) for s in order]


def _is_folder(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and Path(value).is_dir()


def read_config(folder) -> tuple:
    """(LoraConfig, target HF modules, the whole JSON) of a peft adapter folder."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a LoRA adapter folder: no {ADAPTER_CONFIG}")
    from .checkpoint.format import parse_json

    cfg = parse_json(path.read_bytes(), path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object (a peft adapter config)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: per-layer rank_pattern / alpha_pattern are not supported")
    modules = cfg.get("target_modules")
    if not isinstance(modules, list):
        raise ValueError(f"{path}: target_modules must be a list of module names (as cuboid writes them)")
    if isinstance(cfg.get("r"), bool) or not isinstance(cfg.get("r"), int):
        raise ValueError(f"{path}: 'r' must be a whole number (the adapters' rank)")
    conf = LoraConfig(r=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", cfg["r"])),
                      dropout=float(cfg.get("lora_dropout", 0.0)), targets=("from-folder",))
    return conf, modules, cfg


def check_record(folder) -> None:
    """An adapter folder cuboid wrote (its commit file ``lora-adapters.json``) is checked against the SHA-256s
    it records before anything is read; a peft folder from elsewhere has no record and is read as data."""
    from .checkpoint.format import ADAPTERS_COMMIT
    from .checkpoint.lora_state import verify_lora

    if (Path(folder) / ADAPTERS_COMMIT).is_file():
        verify_lora(folder)


def check_ranks(folder, r: int) -> None:
    """The config's rank ``r`` against the shapes in the weights file's header (read without loading a
    tensor), so a wrong or hostile ``r`` is refused before any adapter is allocated."""
    from .checkpoint.format import read_header

    file = Path(folder) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{folder}: no {ADAPTER_WEIGHTS}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{Path(folder) / ADAPTER_CONFIG}: r={r!r} is not a positive rank")
    _, header = read_header(file)
    for name, entry in header.items():
        dim = {".lora_A.weight": 0, ".lora_B.weight": -1}.get(name[name.rfind(".lora_"):], None)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if dim is not None and (not shape or len(shape) != 2 or shape[dim] != r):
            raise ValueError(f"{Path(folder) / ADAPTER_CONFIG}: r={r} does not match {name} of shape {shape} in "
                             f"{ADAPTER_WEIGHTS}: the config and the weights are not one adapter")


def attach(model: nn.Module, lora, *, seed: int = 0) -> nn.Module:
    """Hang LoRA adapters on ``model`` (before ``prepare``; sharded, pipeline-cut, meta or materialised) and
    freeze the rest. ``lora``: a :class:`~cuboid.parallel.lora.LoraConfig`, a dict, a ``"r=16,alpha=32"``
    string, or a peft adapter folder (its config and weights). Returns ``model``."""
    if _is_folder(lora):
        check_record(lora)
        conf, modules, _ = read_config(lora)
        check_ranks(lora, conf.r)
        wanted = set(modules)
        paths = [z[:-len(".weight")] for z, hf in _rows(model).items() if hf and set(hf) <= wanted
                 and z.endswith(".weight") and z.startswith(_spec(model).blocks + ".")]
        covered = {m for z in paths for m in _rows(model)[z + ".weight"]}
        if covered != wanted:
            raise ValueError(f"{lora}: target modules {', '.join(sorted(wanted - covered))} are not "
                             f"linears cuboid adapts (or only a part of a fused projection)")
    else:
        conf = LoraConfig.parse(lora)
        paths = target_paths(model, conf.targets)
    plora.add_adapters(model, paths, conf)
    model.lora = conf
    if not any(p.is_meta for p in model.parameters()):
        plora.init_adapters(model, seed)
        if _is_folder(lora):
            load_adapters(model, lora)
    plora.freeze_base(model)
    return model


# ---------------------------------------------------------------- peft's files


def load_adapters(model: nn.Module, path) -> None:
    """Read a peft adapter folder into ``model``'s adapters (any plan: each rank keeps its slices)."""
    from safetensors import safe_open

    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {ADAPTER_WEIGHTS}")
    conf, _, _ = read_config(path)
    rows = _rows(model)
    with safe_open(str(file), "pt") as f:
        keys = set(f.keys())

        def get(name: str) -> torch.Tensor:
            if name not in keys:
                raise KeyError(f"{file}: no tensor {name!r}")
            return f.get_tensor(name)

        for zpath, base in plora.adapted(model):
            if conf.r != base.lora_r or conf.scaling != base.lora_scaling:
                raise ValueError(f"{path}: r={conf.r}, alpha={conf.alpha} do not match the model's adapters "
                                 f"(r={base.lora_r}, alpha={base.lora_alpha})")
            mods = rows[f"{zpath}.weight"]
            a = [get(f"{PEFT_PREFIX}{m}.lora_A.weight") for m in mods]
            if any(not torch.equal(a[0], t) for t in a[1:]):
                raise ValueError(f"{file}: {', '.join(mods)} have different lora_A; cuboid's fused {zpath} "
                                 "shares one A")
            b = torch.cat([get(f"{PEFT_PREFIX}{m}.lora_B.weight") for m in mods], 0)
            base.lora_A.load_full("weight", a[0])
            base.lora_B.load_full("weight", b)


def merge_to_hf(adapters, out, *, base=None, dtype=None) -> Path:
    """The base model with ``adapters`` (a peft folder cuboid wrote) folded in, written to ``out`` as a Hugging
    Face folder (``config.json`` + ``model.safetensors``). ``base``: the base model folder (default: the
    adapter config's ``base_model_name_or_path``). One process, the whole model in memory."""
    from . import from_hf, to_hf

    _, _, cfg = read_config(adapters)
    base = base or cfg.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(f"{adapters}: base model folder {base!r} not found (pass --base)")
    model = from_hf(base, dtype=dtype)
    attach(model, adapters)
    plora.merge_adapters(model)
    for p in model.parameters():
        p.requires_grad_(True)
    return to_hf(model, out)


# ---------------------------------------------------------------- training checkpoints


def save_checkpoint(model: nn.Module, path, *, optimizer=None, scheduler=None, state: Optional[dict] = None) -> Path:
    """A LoRA run's training checkpoint: the adapters in peft's layout (peft loads the folder), the model's
    ``config.json``, the optimizer state as full tensors by parameter name, ``trainer_state.json``
    (``state``, the scheduler, every rank's RNG) and the commit file recording every file's SHA-256
    (:mod:`cuboid.zoo.checkpoint.lora_state`). Every rank calls it; the folder is renamed into place when
    complete, so an interrupted save never looks like a checkpoint."""
    from .checkpoint.lora_state import save_lora_checkpoint

    return save_lora_checkpoint(model, path, optimizer=optimizer, scheduler=scheduler, state=state)


def is_checkpoint(path) -> bool:
    """A committed LoRA training checkpoint (what :func:`save_checkpoint` writes)."""
    from .checkpoint.lora_state import is_lora_checkpoint

    return is_lora_checkpoint(path)


def load_checkpoint(model: nn.Module, path, *, optimizer=None, scheduler=None, verify: bool = True) -> dict:
    """Restore the adapters, the optimizer (resharded by parameter name: any plan or world size), the
    scheduler and (same world size) every rank's RNG from :func:`save_checkpoint`'s folder; returns the saved
    ``state``. Every recorded file is checked against its SHA-256 first (``verify=False``: the caller did,
    as :mod:`cuboid.resume` does once on rank 0); nothing in the folder is unpickled."""
    from .checkpoint.folder import resolve
    from .checkpoint.lora_state import verify_lora
    from .checkpoint.resume import load_training_state

    root = resolve(path)
    if verify:
        verify_lora(root)
    load_adapters(model, root)
    return load_training_state(root, model, optimizer=optimizer, scheduler=scheduler)["state"]
