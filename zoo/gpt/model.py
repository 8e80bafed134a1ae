"""GPT-2: learned positions, pre-LN blocks, causal attention, tied LM head (or a classification head on each
row's last token that is not padding, GPT2ForSequenceClassification's ``score``)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.zoo.common import (Block, Decoder, Output, attention_mask_of, classifier_output, count_targets,
                               init_parameters, last_tokens, lm_output)

from .config import GPTConfig


class GPT(Decoder):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.pos_emb = L.Embedding(c.n_positions, c.dim)
        self.drop = L.Dropout(c.dropout)
        approx = "tanh" if c.activation == "gelu_new" else "none"
        self.blocks = nn.ModuleList(
            Block(c.dim, c.n_heads, c.hidden, eps=c.eps, pre_ln=True, causal=True,
                  approximate=approx, dropout=c.dropout)
            for _ in range(c.n_layers)
        )
        self.ln_f = L.LayerNorm(c.dim, c.eps)
        # the LM head is the token embedding, transposed (tied)
        if c.head == "cls":
            self.classifier = L.Linear(c.dim, c.num_labels, bias=False)  # HF's "score"

    def num_targets(self, batch: dict) -> int:
        """Label positions the loss of ``batch`` averages over (data parallelism weights by it)."""
        return count_targets(batch.get("labels"), shift=self.config.head == "lm")

    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 init: N(0, 0.02); residual projections N(0, 0.02 / sqrt(2 n_layers)); norms 1/0."""
        std, n = self.config.init_std, self.config.n_layers

        def rule(name: str, shape: torch.Size):
            if name.endswith("bias"):
                return "zeros", 0.0
            if name.startswith("ln") or ".ln" in name:
                return "ones", 0.0
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                return "normal", std / math.sqrt(2 * n)
            return "normal", std

        init_parameters(self, rule, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                logprobs: bool = False) -> Output:
        """``logprobs``: also ``token_logps`` and ``token_entropy`` (B, T - 1) of ``labels[:, 1:]`` (of
        ``input_ids[:, 1:]`` without labels, and then no loss): :func:`~cuboid.zoo.common.lm_output`."""
        no_loss = logprobs and labels is None
        labels = input_ids if no_loss else labels
        x = self.embed(input_ids, position_ids)  # (B, T, C)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)  # packed rows: one document per restart
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, mask)
        out = self.head(x, residual, labels, last=self.last_tokens(input_ids), logprobs=logprobs)
        if no_loss:
            out.loss = None
        return out

    def embed(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token + position embeddings: (B, T) ids -> (B, T, C)."""
        T = input_ids.shape[1]
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions {self.config.n_positions}")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0)
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(position_ids))

    def last_tokens(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """(B,) index of each row's last token that is not padding, which a classification head reads
        (:func:`~cuboid.zoo.common.last_tokens`); None for the other heads."""
        return last_tokens(input_ids, self.config.pad_token_id) if self.config.head == "cls" else None

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
             last: Optional[torch.Tensor] = None, logprobs: bool = False) -> Output:
        """Final norm and the tied LM head (or the classifier at each row's ``last`` token) on the blocks'
        output (x + residual): the model's Output."""
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)  # (B, T, C)
        if self.config.head != "lm" and logprobs:
            raise ValueError(f"logprobs=True needs the LM head; this GPT's head is {self.config.head!r}")
        if self.config.head == "none":
            return Output(logits=h, last_hidden_state=h)
        if self.config.head == "cls":
            return classifier_output(self.classifier, h, last, labels, "GPT")
        return lm_output(self.tok_emb, h, labels, logprobs)
