"""cuboid.zoo: GPT, BERT, ViT and the Llama family (Llama, Qwen2, Mistral, Qwen3, Gemma 3), their presets, and
Hugging Face interop.

- :func:`build` makes a model from a preset name or a config, on the meta
  device by default (no memory, exact parameter counts);
- :func:`materialize` allocates it on a device and runs its ``init_weights``;
- :func:`from_hf` / :func:`to_hf` read and write local ``transformers`` folders;
- :func:`adapters_off`: a LoRA model (``cuboid.load(..., lora=...)``) computes its base model's outputs
  within the block (:mod:`cuboid.parallel.lora`).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from cuboid.parallel.layers import to_empty
from cuboid.parallel.lora import adapters_off

from . import hf_io
from .bert.config import BertConfig
from .bert.model import Bert
from .common import Output, count_parameters
from .deepseek.config import DeepSeekConfig
from .deepseek.model import DeepSeekV3
from .families import FAMILIES, family_of
from .plans import READY_PLANS, SPECS
from .gpt.config import GPTConfig
from .gpt.model import GPT
from .llama.config import LlamaConfig
from .llama.model import Llama
from .registry import CLASSES as _CLASSES, PRESETS, FamilyRecord, after_step, record_of, register as register_family
from .vit.config import ViTConfig
from .vit.model import ViT

Config = Union[GPTConfig, BertConfig, ViTConfig, LlamaConfig, DeepSeekConfig]

__all__ = ["PRESETS", "FAMILIES", "Output", "GPT", "Bert", "ViT", "Llama", "DeepSeekV3", "GPTConfig", "BertConfig", "ViTConfig", "LlamaConfig",
           "DeepSeekConfig", "READY_PLANS", "SPECS", "build", "materialize", "spec_of", "from_hf", "to_hf", "family_of", "count_parameters", "config_of",
           "adapters_off", "FamilyRecord", "register_family", "record_of", "after_step", "set_options"]


def config_of(name_or_config: Union[str, Config], **overrides) -> Config:
    """A preset's config (with ``overrides`` applied), or the config itself."""
    if isinstance(name_or_config, str):
        if name_or_config not in PRESETS:
            raise ValueError(f"unknown model preset {name_or_config!r}; presets: {', '.join(PRESETS)}")
        config = PRESETS[name_or_config]
    elif type(name_or_config) in _CLASSES:
        config = name_or_config
    else:
        raise TypeError(f"expected a preset name or a zoo config, got {type(name_or_config).__name__}")
    return config.replace(**overrides) if overrides else config


def set_options(model: nn.Module, **options) -> None:
    """Set training options that are fields of ``model``'s config (``moe_bias_update_rate`` of DeepSeek-V3's,
    read by its family's ``after_step``); a field its family's config lacks is a one-line ``ValueError``."""
    config = model.config
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not an option of {record_of(model).name} models "
                         f"({type(config).__name__} has no such field)")
    model.config = config.replace(**options)


def build(name_or_config: Union[str, Config], *, device: Union[str, torch.device] = "meta", **overrides) -> nn.Module:
    """The model for a preset or config, with parameters on ``device`` (meta: no memory)."""
    config = config_of(name_or_config, **overrides)
    with torch.device(device):
        return _CLASSES[type(config)](config)


def materialize(model: nn.Module, device: Union[str, torch.device] = "cpu", *, seed: int = 0,
                dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Allocate a (meta) model on ``device`` and initialise it from ``seed``."""
    to_empty(model, device)
    model.init_weights(seed)
    if dtype is not None:
        model.to(dtype)
    return model


def from_hf(path: os.PathLike, *, dtype: Optional[torch.dtype] = None, device=None, strict: bool = True,
            transform=None, head: Optional[str] = None, num_labels: Optional[int] = None, seed: int = 0) -> nn.Module:
    """Build the zoo model for a local folder (HF's or a cuboid checkpoint) and load its weights.

    The model is built on the meta device; ``transform(meta_model) -> model``
    runs there (the tensor modes shard it for a plan), and ``dtype`` casts it
    there, before anything is allocated. :func:`cuboid.zoo.checkpoint.reader.read_new`
    then validates every tensor and reads only this rank's slices; on CPU,
    parts read as they are stored stay backed by the mapped files
    (copy-on-write), as ``transformers`` keeps them. ``device="meta"`` checks
    names and shapes and returns the model unallocated.

    ``head`` (``"cls"``) reads a folder of another head (a ``*ForCausalLM``) under a new classification head of
    ``num_labels`` outputs, as ``AutoModelForSequenceClassification.from_pretrained`` does: the body loads, the
    new head is initialised from ``seed``, the old head's tensors are dropped (:mod:`cuboid.zoo.heads`).
    """
    from .checkpoint.reader import CheckpointError, read_new  # late: the checkpoint package loads on first use
    from .heads import folder_config, unexplained

    path = Path(path)
    family, config, stored = folder_config(path, head, num_labels)
    with torch.device("meta"):
        model = family.build(config)
    if transform is not None:
        model = transform(model)
    if dtype is not None:
        model.to(dtype)  # on meta: free; every tensor is cast as it is read
    if config is stored:
        read_new(model, path, device=device or "cpu", strict=strict)
        return model
    problems = read_new(model, path, device=device or "cpu", strict=False, seed=seed)  # the new head: initialised
    left = unexplained(problems, model, family, stored)
    if strict and any(left.values()):
        raise CheckpointError(f"{path}: checkpoint does not fit the {family.name} model; "
                              + "; ".join(f"{kind}: {', '.join(v)}" for kind, v in left.items() if v))
    return model


def spec_of(model: nn.Module):
    """The sharding spec of a zoo model: its family's, with the tie between the pipeline's ends only where
    the model's head reads the token embedding (a tied LM or MLM head; a classifier, a backbone or an untied
    LM head does not, so the last stage neither holds nor sums it), and ``pooled_last`` only where the head is a
    decoder's classifier."""
    spec = SPECS[family_of(model).name]
    tied = set(spec.first) & set(spec.last)
    config = getattr(model, "config", None)
    reads_table = getattr(config, "head", None) in ("lm", "mlm") and getattr(config, "tie_embeddings", True)
    if tied and not reads_table:
        spec = dataclasses.replace(spec, last=tuple(n for n in spec.last if n not in tied))
    if spec.pooled_last and getattr(config, "head", None) != "cls":  # only a classifier reads the last tokens
        spec = dataclasses.replace(spec, pooled_last=False)
    per_token = getattr(config, "head", "none") in ("lm", "mlm", "none")
    if spec.per_token != per_token:
        spec = dataclasses.replace(spec, per_token=per_token)
    return spec


def to_hf(model: nn.Module, path: os.PathLike):
    """Write ``model`` as a folder ``transformers.AutoModel*.from_pretrained`` loads.

    ``config.json`` + ``model.safetensors``, through :func:`cuboid.zoo.checkpoint.writer.export`.
    """
    from .checkpoint.writer import export  # late: the checkpoint package loads on first use

    family_of(model)  # not a zoo model: a TypeError before anything is written
    return export(model, path)
