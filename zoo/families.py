"""The model families the zoo knows (GPT, BERT, ViT, Llama) and which one a model belongs to.

Its own module, below both the package's front (``cuboid.zoo``) and the
checkpoint package, so that the checkpoint code finds a model's Hugging Face
mapping without importing the zoo package that uses it.
"""
from __future__ import annotations

from torch import nn

from .bert.hf import FAMILY as _BERT
from .gpt.hf import FAMILY as _GPT
from .hf_io import Family
from .llama.hf import FAMILY as _LLAMA
from .vit.hf import FAMILY as _VIT

FAMILIES = {"gpt": _GPT, "bert": _BERT, "vit": _VIT, "llama": _LLAMA}


def family_of(model: nn.Module) -> Family:
    for fam in FAMILIES.values():
        if isinstance(model, fam.build):
            return fam
    raise TypeError(f"{type(model).__name__} is not a zoo model")
