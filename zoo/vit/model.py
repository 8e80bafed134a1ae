"""ViT: patch embedding (a linear map of flattened patches), CLS token, learned positions, pre-LN blocks."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.head import lazy
from cuboid.zoo.common import Block, Output, count_targets, init_parameters, standard_rule

from .config import ViTConfig


def patchify(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C * P * P), patches row-major, each flattened as (C, P, P)."""
    B, C, H, W = pixel_values.shape
    x = pixel_values.reshape(B, C, H // patch, patch, W // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // patch) * (W // patch), C * patch * patch)


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch = L.Linear(c.channels * c.patch_size ** 2, c.dim)  # the conv, as a matmul
        self.cls_token = L.LearnedTensor(1, 1, c.dim)
        self.pos_emb = L.LearnedTensor(1, c.n_patches + 1, c.dim)
        self.drop = L.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            Block(c.dim, c.n_heads, c.hidden, eps=c.eps, pre_ln=True, causal=False, dropout=c.dropout)
            for _ in range(c.n_layers)
        )
        self.ln_f = L.LayerNorm(c.dim, c.eps)
        self.pooler = L.Linear(c.dim, c.dim) if c.pooler else None
        if c.head == "cls":
            self.classifier = L.Linear(c.dim, c.num_labels)

    def num_targets(self, batch: dict) -> int:
        """Label positions the loss of ``batch`` averages over (data parallelism weights by it)."""
        return count_targets(batch.get("labels"), shift=False)

    def init_weights(self, seed: int = 0) -> None:
        """ViT init (as HF): truncated normal std 0.02 for weights and tokens, zero biases, norms 1/0."""
        init_parameters(self, standard_rule("trunc_normal", self.config.init_std), seed)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Output:
        x = self.embed(pixel_values)  # (B, N + 1, C)
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual)
        return self.head(x, residual, labels)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Patches, class token and positions: (B, 3, S, S) -> (B, N + 1, C)."""
        c = self.config
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c.channels, c.image_size, c.image_size):
            raise ValueError(
                f"pixel_values must be (B, {c.channels}, {c.image_size}, {c.image_size}), "
                f"got {tuple(pixel_values.shape)}"
            )
        B = pixel_values.shape[0]
        x = self.patch(patchify(pixel_values.to(self.patch.weight.dtype), c.patch_size))  # (B, N, C)
        x = torch.cat([self.cls_token().expand(B, -1, -1), x], dim=1) + self.pos_emb()  # (B, N + 1, C)
        return self.drop(x)

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None) -> Output:
        """Final norm, pooler and classifier on the blocks' output (x + residual)."""
        c = self.config
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)  # (B, N + 1, C)
        pooled = torch.tanh(self.pooler(h[:, 0])) if self.pooler is not None else None
        if c.head == "cls":
            local = self.classifier(h[:, 0])  # (B, num_labels); batch rows split under 2D/3D
            loss = self.classifier.loss_from_logits(local, labels) if labels is not None else None
            return Output(logits=lazy(self.classifier.gather_logits, local), loss=loss, last_hidden_state=h,
                          pooler_output=pooled)
        return Output(logits=h, last_hidden_state=h, pooler_output=pooled)
