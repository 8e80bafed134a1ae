"""cuboid.zoo: GPT, BERT and ViT, their presets, and Hugging Face interop.

- :func:`build` makes a model from a preset name or a config, on the meta
  device by default (no memory, exact parameter counts);
- :func:`materialize` allocates it on a device and runs its ``init_weights``;
- :func:`from_hf` / :func:`to_hf` read and write local ``transformers`` folders.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import torch
from torch import nn

from . import hf_io
from .bert.config import PRESETS as _BERT_PRESETS, BertConfig
from .bert.hf import FAMILY as _BERT
from .bert.model import Bert
from .common import Output, count_parameters
from .plans import READY_PLANS, SPECS
from .gpt.config import PRESETS as _GPT_PRESETS, GPTConfig
from .gpt.hf import FAMILY as _GPT
from .gpt.model import GPT
from .vit.config import PRESETS as _VIT_PRESETS, ViTConfig
from .vit.hf import FAMILY as _VIT
from .vit.model import ViT

FAMILIES = {"gpt": _GPT, "bert": _BERT, "vit": _VIT}
PRESETS = {**_GPT_PRESETS, **_BERT_PRESETS, **_VIT_PRESETS}
_CLASSES = {GPTConfig: GPT, BertConfig: Bert, ViTConfig: ViT}

Config = Union[GPTConfig, BertConfig, ViTConfig]

__all__ = ["PRESETS", "FAMILIES", "Output", "GPT", "Bert", "ViT", "GPTConfig", "BertConfig", "ViTConfig",
           "READY_PLANS", "SPECS", "build", "materialize", "spec_of", "from_hf", "to_hf", "family_of", "count_parameters", "config_of"]


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


def build(name_or_config: Union[str, Config], *, device: Union[str, torch.device] = "meta", **overrides) -> nn.Module:
    """The model for a preset or config, with parameters on ``device`` (meta: no memory)."""
    config = config_of(name_or_config, **overrides)
    with torch.device(device):
        return _CLASSES[type(config)](config)


def materialize(model: nn.Module, device: Union[str, torch.device] = "cpu", *, seed: int = 0,
                dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Allocate a (meta) model on ``device`` and initialise it from ``seed``."""
    model.to_empty(device=device)
    model.init_weights(seed)
    if dtype is not None:
        model.to(dtype)
    return model


def family_of(model: nn.Module) -> hf_io.Family:
    for fam in FAMILIES.values():
        if isinstance(model, fam.build):
            return fam
    raise TypeError(f"{type(model).__name__} is not a zoo model")


def from_hf(path: os.PathLike, *, dtype: Optional[torch.dtype] = None, device=None, strict: bool = True,
            transform=None) -> nn.Module:
    """Build the zoo model for a local HF folder (config.json + safetensors) and load its weights.

    ``transform(meta_model) -> model`` runs before allocation (sharding for a plan).
    """
    return hf_io.from_hf(path, list(FAMILIES.values()), dtype=dtype, device=device, strict=strict,
                         transform=transform)


def spec_of(model: nn.Module):
    """The sharding spec of a zoo model: its family's, with the tie between the pipeline's ends only where
    the model's head reads the token embedding (an LM or MLM head; a classifier or a backbone does not, so
    the last stage neither holds nor sums it)."""
    spec = SPECS[family_of(model).name]
    tied = set(spec.first) & set(spec.last)
    if tied and getattr(getattr(model, "config", None), "head", None) not in ("lm", "mlm"):
        spec = dataclasses.replace(spec, last=tuple(n for n in spec.last if n not in tied))
    return spec


def to_hf(model: nn.Module, path: os.PathLike):
    """Write ``model`` as a folder ``transformers.AutoModel*.from_pretrained`` loads."""
    return hf_io.save_hf(model, family_of(model), path)
