"""LoRA on zoo models: targets by role, and adapters saved and loaded in ``peft``'s layout.

- :func:`target_paths`: the linears a LoRA config's ``targets`` name in a
  model (``attn``: the attention's input projections and output; ``qkv``,
  ``q``, ``k``, ``v``, ``o``: parts of it; ``mlp``: every MLP linear;
  ``gate``, ``up``, ``down``: parts of it, ``up`` being a plain MLP's fc), read
  off the family's sharding spec, so every family (GPT, BERT, ViT, Llama)
  gets them;
- a mixture of experts (Qwen3-MoE, Mixtral, OLMoE): ``experts`` (and
  ``mlp``) adapt every sparse layer's stacked ``gate_up`` and ``down`` per
  expert, as peft's ``target_parameters`` on transformers' fused
  ``mlp.experts.gate_up_proj`` / ``down_proj`` (peft's ``ParamWrapper``:
  no dropout); the dense MLP layers of such a model (``mlp_only_layers``)
  take none, because peft 0.21 on transformers 5 renames a sparse model's
  ``gate_proj``/``up_proj``/``down_proj`` targets to the experts' fused
  parameters, so it could not load them;
- :func:`attach`: adapters on those linears (:mod:`cuboid.parallel.lora`),
  initialised as peft does, the base frozen (``cuboid.load(..., lora=...)``),
  and one line saying how many parameters train and whether the experts do
  (:func:`describe`);
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
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from cuboid.parallel import lora as plora
from cuboid.parallel.lora import LoraConfig

from .checkpoint.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_EXPERT_WEIGHTS, PEFT_PREFIX,  # noqa: F401
                                  adapter_config, adapter_state, expert_adapter_name, expert_from_peft,
                                  interleaved_gate_up)
from .checkpoint.adapters import hf_modules as _rows
from .checkpoint.lora_state import save_adapters  # noqa: F401
from .families import family_of
from .llama.gpt_oss import deinterleave


# DeepSeek-V3's latent attention: q_a, q_b (the q low-rank path) and kv_a, kv_b (the latent's, for keys and
# values alike), peft's q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj
_MLA_Q, _MLA_KV = ("attn.q_a", "attn.q_b"), ("attn.kv_a", "attn.kv_b")
_ATTN = ("attn.qkv", "attn.q", "attn.k", "attn.v") + _MLA_Q + _MLA_KV
SUFFIXES = {"qkv": _ATTN, "q": ("attn.q",) + _MLA_Q, "k": ("attn.k",) + _MLA_KV, "v": ("attn.v",) + _MLA_KV,
            "o": ("attn.proj",),
            "attn": _ATTN + ("attn.proj",), "mlp": ("mlp.fc", "mlp.gate", "mlp.up", "mlp.proj"),
            "gate": ("mlp.gate",), "up": ("mlp.up", "mlp.fc"), "down": ("mlp.proj",), "experts": ()}
EXPERT_TARGETS = ("mlp", "experts")  # the targets that take a sparse layer's experts (gate_up and down)


def _spec(model: nn.Module):
    from .plans import SPECS

    return SPECS[family_of(model).name]


def _has_experts(model: nn.Module) -> bool:
    return bool(getattr(model.config, "n_experts", 0))


def expert_paths(model: nn.Module) -> list:
    """Module paths of the sparse layers' experts (``blocks.N.mlp.experts``, every sparse block)."""
    c = model.config
    if not _has_experts(model):
        return []
    return [f"{_spec(model).blocks}.{i}.mlp.experts" for i in range(c.n_layers) if c.is_sparse(i)]


def target_paths(model: nn.Module, targets) -> list:
    """Module paths of the linears ``targets`` names (every block, whatever this rank holds); a sparse
    layer's experts are :func:`expert_paths` (``mlp`` and ``experts`` take them)."""
    spec = _spec(model)
    head = f"{spec.blocks}.*."
    have = {k[len(head):] for k in spec.roles if k.startswith(head) and spec.roles[k] in
            ("column", "column_qkv", "column_kv", "row", "replicate")}  # replicate: MLA's latent projections
    if _has_experts(model):  # peft reads a sparse model's MLP names as its experts' (module docstring)
        have = {s for s in have if not s.startswith("mlp.")}
    chosen = set()
    for t in targets:
        if t not in SUFFIXES:
            raise ValueError(f"unknown LoRA target {t!r}: one of {', '.join(SUFFIXES)}")
        if t in ("gate", "up", "down") and _has_experts(model):
            raise ValueError(f"LoRA target {t!r} on a mixture of experts: peft reads gate_proj/up_proj/down_proj "
                             "there as the experts' own (fused into gate_up_proj), so adapters on the dense MLP "
                             "layers would not load in peft; use the target 'experts' (or 'mlp')")
        found = [s for s in SUFFIXES[t] if s in have]
        if t == "experts" and not _has_experts(model):
            raise ValueError(f"LoRA target 'experts': the {family_of(model).name} model has no mixture of experts")
        if not found and t not in EXPERT_TARGETS:
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
    """A folder cuboid wrote (an adapter folder's ``lora-adapters.json`` or a training checkpoint's
    ``lora-checkpoint.json``) is checked against the SHA-256s its commit file records before anything is read;
    a peft folder from elsewhere has no record and is read as data."""
    from .checkpoint.format import lora_commit
    from .checkpoint.lora_state import verify_lora

    if lora_commit(Path(folder)) is not None:
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
        stacked = ".experts.lora_" in name or ".experts.base_layer.lora_" in name  # r x E rows: peft's experts
        if dim is not None and (not shape or len(shape) != 2 or (shape[dim] % r if stacked else shape[dim] != r)):
            raise ValueError(f"{Path(folder) / ADAPTER_CONFIG}: r={r} does not match {name} of shape {shape} in "
                             f"{ADAPTER_WEIGHTS}: the config and the weights are not one adapter")


def attach(model: nn.Module, lora, *, seed: int = 0, quiet: bool = False) -> nn.Module:
    """Hang LoRA adapters on ``model`` (before ``prepare``; sharded, pipeline-cut, meta or materialised) and
    freeze the rest. ``lora``: a :class:`~cuboid.parallel.lora.LoraConfig`, a dict, a ``"r=16,alpha=32"``
    string, or a peft adapter folder (its config and weights). Rank 0 prints :func:`describe`'s line (the
    adapters' count and share, and whether the experts are adapted) unless ``quiet``. Returns ``model``."""
    if _is_folder(lora):
        check_record(lora)
        conf, modules, cfg = read_config(lora)
        check_ranks(lora, conf.r)
        rows = {z: hf for z, hf in _rows(model).items() if hf and z.endswith(".weight")
                and z.startswith(_spec(model).blocks + ".")}
        # peft's rule: a target names a module whole or by its last name parts ("q_proj")
        wanted = {h for hf in rows.values() for h in hf if any(h == t or h.endswith("." + t) for t in modules)}
        paths = [z[:-len(".weight")] for z, hf in rows.items() if set(hf) <= wanted]
        covered = {m for z in paths for m in rows[z + ".weight"]}
        unmatched = [t for t in modules if not any(h == t or h.endswith("." + t) for h in covered)]
        if covered != wanted or unmatched:
            missing = sorted(wanted - covered) + unmatched
            raise ValueError(f"{lora}: target modules {', '.join(missing)} are not "
                             f"linears cuboid adapts (or only a part of a fused projection)")
        weights = _expert_weights_of(lora, cfg, model)
    else:
        conf = LoraConfig.parse(lora)
        paths = target_paths(model, conf.targets)
        weights = plora.EXPERT_WEIGHTS if _has_experts(model) and set(conf.targets) & set(EXPERT_TARGETS) else ()
    experts = expert_paths(model) if weights else []
    plora.add_adapters(model, paths, conf)
    plora.add_expert_adapters(model, experts, weights, conf)
    model.lora, model.lora_experts, model.lora_paths = conf, tuple(weights), (tuple(paths), tuple(experts))
    if not any(p.is_meta for p in model.parameters()):
        plora.init_adapters(model, seed)
        if _is_folder(lora):
            load_adapters(model, lora)
    plora.freeze_base(model)
    if not quiet and _rank() == 0:
        print(describe(model), file=sys.stderr, flush=True)
    return model


def _expert_weights_of(folder, cfg: dict, model: nn.Module) -> tuple:
    """The stacked expert weights a peft config's ``target_parameters`` adapt (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``: every sparse layer's), in module order; a one-line error for anything else."""
    targets = cfg.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{Path(folder) / ADAPTER_CONFIG}: target_parameters must be a list of parameter names")
    by_peft = {v: k for k, v in PEFT_EXPERT_WEIGHTS.items()}
    found = set()
    for t in targets:
        name = t.rpartition(".")[2]
        if not _has_experts(model) or name not in by_peft or t not in (f"experts.{name}", f"mlp.experts.{name}"):
            raise ValueError(f"{Path(folder) / ADAPTER_CONFIG}: target parameter {t!r} is not one cuboid adapts "
                             "(mlp.experts.gate_up_proj or mlp.experts.down_proj of a mixture of experts)")
        found.add(by_peft[name])
    return tuple(n for n in plora.EXPERT_WEIGHTS if n in found)


def describe(model: nn.Module) -> str:
    """One line: the adapters' trainable parameters and their share of the model's (the whole model's, every
    stage and shard), and whether a mixture of experts' experts are adapted (so nobody trains a fraction of a
    percent by accident)."""
    from .common import count_parameters

    conf, weights = model.lora, model.lora_experts
    whole = model
    if any(True for _ in _placeholders(model)):  # a pipeline stage holds part of the model: count a meta build
        from . import build

        whole = build(model.config)
        paths, experts = model.lora_paths
        plora.add_adapters(whole, paths, conf)
        plora.add_expert_adapters(whole, experts, weights, conf)
    adapters = sum(int(torch.Size(shape).numel()) for shape in _adapter_shapes(whole))
    total = count_parameters(whole) + _quantized_weights(whole) - adapters
    line = (f"LoRA r={conf.r} alpha={conf.alpha:g}: {adapters:,} trainable adapter parameters, "
            f"{adapters / max(total, 1):.3%} of the model's {total:,}")
    if _has_experts(model):
        in_experts = sum(int(torch.Size(m.full_shape(n)).numel()) for _, m in _experts_layers(whole)
                         for n in plora.EXPERT_WEIGHTS)
        share = f"{in_experts / max(total, 1):.0%} of the model's parameters"
        n = len(expert_paths(model))
        line += (f"; the experts of {n} sparse layer{'s' * (n != 1)} are adapted "
                 f"({', '.join(weights)}; {share})" if weights else
                 f"; the experts are NOT adapted ({share} are in them): add the target 'experts' (or 'mlp') "
                 "to train them")
    return line


def _quantized_weights(model: nn.Module) -> int:
    """The values of the frozen NF4 weights (QLoRA's base; buffers, not parameters), counted unpacked: the
    weights the model has, as peft's ``print_trainable_parameters`` counts a 4-bit model's."""
    from cuboid.parallel.quant import quantized_layers

    return sum(int(torch.Size(layer.nf4_full_shape).numel()) for _, layer in quantized_layers(model))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _placeholders(model: nn.Module):
    return (m for m in model.modules() if getattr(m, "placeholder", False))


def _experts_layers(model: nn.Module) -> list:
    from cuboid.parallel.moe import Experts

    return [(p, m) for p, m in model.named_modules() if isinstance(m, Experts)]


def _adapter_shapes(model: nn.Module) -> list:
    """The full shapes of every adapter parameter of ``model``."""
    out = [layer.full_shape("weight") for _, base in plora.adapted(model) for layer in (base.lora_A, base.lora_B)]
    return out + [m.full_shape(f"lora_{n}_{ab}") for _, m in plora.adapted_experts(model) for n in m.lora_weights
                  for ab in "AB"]


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
        for zpath, experts in plora.adapted_experts(model):
            if conf.r != experts.lora_r or conf.scaling != experts.lora_scaling:
                raise ValueError(f"{path}: r={conf.r}, alpha={conf.alpha} do not match the model's adapters "
                                 f"(r={experts.lora_r}, alpha={experts.lora_alpha})")
            for name in experts.lora_weights:
                key = PEFT_PREFIX + expert_adapter_name(model, zpath, name, experts.lora_weights)
                a, b = get(f"{key}.lora_A.weight"), get(f"{key}.lora_B.weight")
                n = experts.n_experts
                if a.dim() != 2 or b.dim() != 2 or a.shape[0] != conf.r * n or b.shape[1] != conf.r * n:
                    raise ValueError(f"{file}: {key} has shapes {tuple(a.shape)}, {tuple(b.shape)}: not rank "
                                     f"{conf.r} adapters of {n} experts")
                a, b = expert_from_peft(a, b, n)
                if interleaved_gate_up(model, name):  # gpt-oss: gate and up rows interleaved in peft's B
                    b = deinterleave(b, 1)
                experts.load_full(f"lora_{name}_A", a)
                experts.load_full(f"lora_{name}_B", b)


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


def save_checkpoint(model: nn.Module, path, *, optimizer=None, scheduler=None, state: Optional[dict] = None,
                    base: Optional[str] = None, tokenizer=None, generation_config: Optional[dict] = None) -> Path:
    """A LoRA run's training checkpoint: the adapters in peft's layout (peft loads the folder), the model's
    ``config.json``, the optimizer state as full tensors by parameter name, ``trainer_state.json``
    (``state``, the scheduler, every rank's RNG) and the commit file recording every file's SHA-256
    (:mod:`cuboid.zoo.checkpoint.lora_state`). Every rank calls it; the folder is renamed into place when
    complete, so an interrupted save never looks like a checkpoint. ``base`` (the base model folder peft's
    config names), ``tokenizer`` and ``generation_config`` are written as in ``final/``."""
    from .checkpoint.lora_state import save_lora_checkpoint

    return save_lora_checkpoint(model, path, optimizer=optimizer, scheduler=scheduler, state=state, base=base,
                                tokenizer=tokenizer, generation_config=generation_config)


def is_checkpoint(path) -> bool:
    """A committed LoRA training checkpoint (what :func:`save_checkpoint` writes)."""
    from .checkpoint.lora_state import is_lora_checkpoint

    return is_lora_checkpoint(path)


def load_checkpoint(model: nn.Module, path, *, optimizer=None, scheduler=None, verify: bool = True) -> dict:
    """Restore the adapters, the optimizer (resharded by parameter name: any plan or world size), the
    scheduler and (same world size) every rank's RNG from :func:`save_checkpoint`'s folder; returns the saved
    ``state``. Every recorded file is checked against its SHA-256 first (``verify=False``: the caller did,
    as :mod:`cuboid.train.resume` does once on rank 0); nothing in the folder is unpickled."""
    from .checkpoint.folder import resolve
    from .checkpoint.lora_state import verify_lora
    from .checkpoint.resume import load_training_state

    root = resolve(path)
    if verify:
        verify_lora(root)
    load_adapters(model, root)
    return load_training_state(root, model, optimizer=optimizer, scheduler=scheduler)["state"]
