"""ViT configuration and presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224        # square input side, pixels
    patch_size: int = 16         # square patch side; image_size % patch_size == 0
    channels: int = 3            # input channels
    dim: int = 768               # hidden size
    n_layers: int = 12           # transformer blocks (pre-LN)
    n_heads: int = 12            # attention heads; dim % n_heads == 0
    mlp_hidden: int = 3072       # MLP width
    eps: float = 1e-12           # layer-norm epsilon (HF ViT default)
    dropout: float = 0.0         # hidden dropout
    head: str = "cls"            # "cls" (ViTForImageClassification) or "none" (ViTModel)
    num_labels: int = 1000       # classes for head="cls"
    pooler: Optional[bool] = None  # tanh pooler on the CLS token; None: as HF (ViTModel only)
    init_std: float = 0.02       # truncated-normal init std

    def __post_init__(self) -> None:
        if self.pooler is None:
            object.__setattr__(self, "pooler", self.head == "none")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.head not in ("cls", "none"):
            raise ValueError(f"head must be 'cls' or 'none', got {self.head!r}")
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def hidden(self) -> int:
        return self.mlp_hidden

    def to_dict(self) -> dict:
        return {"family": "vit", **asdict(self)}

    def replace(self, **changes) -> "ViTConfig":
        if "head" in changes and "pooler" not in changes:
            changes["pooler"] = None  # re-derive for the new head
        return replace(self, **changes)


PRESETS = {
    "vit-debug": ViTConfig(image_size=32, patch_size=8, dim=64, n_layers=2, n_heads=4, mlp_hidden=128,
                           num_labels=10),
    "vit-base-16": ViTConfig(),
    "vit-large-16": ViTConfig(dim=1024, n_layers=24, n_heads=16, mlp_hidden=4096),
    "vit-huge-14": ViTConfig(patch_size=14, dim=1280, n_layers=32, n_heads=16, mlp_hidden=5120),
}
