"""BERT: token + position + segment embeddings, post-LN blocks, pooler, MLM / classifier heads."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.head import lazy
from cuboid.zoo.common import Block, Output, attention_mask_of, count_targets, init_parameters, standard_rule

from .config import BertConfig


class Bert(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.pos_emb = L.Embedding(c.n_positions, c.dim)
        self.type_emb = L.Embedding(c.type_vocab_size, c.dim)
        self.ln_emb = L.LayerNorm(c.dim, c.eps)
        self.drop = L.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            Block(c.dim, c.n_heads, c.hidden, eps=c.eps, pre_ln=False, causal=False, dropout=c.dropout)
            for _ in range(c.n_layers)
        )
        self.pooler = L.Linear(c.dim, c.dim) if c.pooler else None
        if c.head == "mlm":
            self.mlm_dense = L.Linear(c.dim, c.dim)
            self.mlm_ln = L.LayerNorm(c.dim, c.eps)
            self.mlm_bias = L.LearnedTensor(c.vocab_size)  # decoder weight is tok_emb (tied)
        elif c.head == "cls":
            self.classifier = L.Linear(c.dim, c.num_labels)

    def num_targets(self, batch: dict) -> int:
        """Label positions the loss of ``batch`` averages over (data parallelism weights by it)."""
        return count_targets(batch.get("labels"), shift=False)

    def init_weights(self, seed: int = 0) -> None:
        """BERT init: N(0, 0.02) for linear and embedding weights, zero biases, norms 1/0."""
        init_parameters(self, standard_rule("normal", self.config.init_std, zero=("mlm_bias.weight",)), seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> Output:
        x = self.embed(input_ids, token_type_ids, position_ids)  # (B, T, C)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)  # packed rows: one document per restart
        for block in self.blocks:
            x, _ = block(x, None, mask)
        return self.head(x, None, labels)

    def embed(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
              position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token + position + segment embeddings, normed: (B, T) ids -> (B, T, C)."""
        T = input_ids.shape[1]
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions {self.config.n_positions}")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids) + self.type_emb(token_type_ids)
        return self.drop(self.ln_emb(x))

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
             labels: Optional[torch.Tensor] = None) -> Output:
        """Pooler and the MLM / classifier head on the blocks' output (post-LN: no residual stream)."""
        c = self.config
        if residual is not None:
            x = x + residual
        pooled = torch.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None  # (B, C)
        if c.head == "mlm":
            h = self.mlm_ln(L.gelu(self.mlm_dense(x)))
            # the tied decoder with its bias: with labels the fused linear cross-entropy (vocab-parallel under tp)
            # and the (B, T, V) logits made only when read
            loss, logits = self.tok_emb.lm_outputs(h, labels, self.mlm_bias())
        elif c.head == "cls":
            local = self.classifier(self.drop(pooled))  # (B, num_labels); batch rows split under 2D/3D
            loss = self.classifier.loss_from_logits(local, labels) if labels is not None else None
            logits = lazy(self.classifier.gather_logits, local)
        else:
            logits, loss = x, None
        return Output(logits=logits, loss=loss, last_hidden_state=x, pooler_output=pooled)
