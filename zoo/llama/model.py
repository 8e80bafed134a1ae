"""Llama-family decoder (Llama 2/3, Qwen2, Mistral): RoPE, RMSNorm, SwiGLU, grouped-query attention."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import cuboid.kernels as kernels
from cuboid.parallel import layers as L
from cuboid.parallel.head import lazy
from cuboid.parallel.mask import Mask
from cuboid.zoo.common import Decoder, Output, attention_mask_of, count_targets, init_parameters, linears, pre_norm

from .config import LlamaConfig


class Attention(nn.Module):
    """Grouped-query self-attention: q (H heads), k and v (Hkv heads, each shared by H / Hkv query heads),
    rotated by RoPE in the attention core. Head counts are read off the (possibly sharded) projections."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = d = c.head_dim
        self.q = L.Linear(c.dim, c.n_heads * d, bias=c.attention_bias)
        self.k = L.Linear(c.dim, c.n_kv_heads * d, bias=c.attention_bias)
        self.v = L.Linear(c.dim, c.n_kv_heads * d, bias=c.attention_bias)
        self.rope = L.Rotary(d, c.rope_theta, c.rope)
        self.core = L.Attention()
        self.proj = L.Linear(c.n_heads * d, c.dim, bias=False)
        self.dropout = L.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        q, k, v = linears(x, (self.q, self.k, self.v))  # (B, T, H * D), (B, T, Hkv * D) twice
        B, T, _ = q.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
        y = self.core(q, k, v, causal=True, mask=mask, rope=self.rope)  # (B, H, T, D)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * up(x)), (B, T, C) -> (B, T, C)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate = L.Linear(c.dim, c.mlp_hidden, bias=c.mlp_bias)
        self.up = L.Linear(c.dim, c.mlp_hidden, bias=c.mlp_bias)
        self.proj = L.Linear(c.mlp_hidden, c.dim, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two matmuls, not one over the stacked weights (zoo.common.linears): the halves of a stacked output are
        # strided views, slower to read, and their gradients are concatenated in backward (the CPU training
        # step of bench/train_step.py's Llama shapes is faster so: bench/RESULTS.md)
        return self.proj(kernels.swiglu(self.gate(x), self.up(x)))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``forward(x, residual) -> (x', residual')``, the hidden state being ``x' + residual'``."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.ln1 = L.RMSNorm(c.dim, c.eps)
        self.attn = Attention(c)
        self.ln2 = L.RMSNorm(c.dim, c.eps)
        self.mlp = SwiGLU(c)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                mask: Optional[Mask] = None):
        return pre_norm(self, x, residual, mask)


class Llama(Decoder):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layers))
        self.ln_f = L.RMSNorm(c.dim, c.eps)
        if c.head == "lm" and not c.tie_embeddings:
            self.lm_head = L.Embedding(c.vocab_size, c.dim)  # (V, C), used as the head's weight only
        elif c.head == "cls":
            self.classifier = L.Linear(c.dim, c.num_labels, bias=False)  # HF's "score"

    def num_targets(self, batch: dict) -> int:
        """Label positions the loss of ``batch`` averages over (data parallelism weights by it)."""
        return count_targets(batch.get("labels"), shift=self.config.head == "lm")

    def init_weights(self, seed: int = 0) -> None:
        """HF Llama init: N(0, init_std) for linear and embedding weights, zero biases, norms 1."""
        std = self.config.init_std

        def rule(name: str, shape: torch.Size):
            if name.endswith("bias"):
                return "zeros", 0.0
            if ".ln" in name or name.startswith("ln"):
                return "ones", 0.0
            return "normal", std

        init_parameters(self, rule, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None) -> Output:
        """``position_ids`` (B, T) or (1, T): the rotary positions (HF's), restarting at 0 at each document of a
        packed row (attention stays inside each document); 0 .. T-1 when not given."""
        x = self.embed(input_ids)  # (B, T, C)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, mask)
        return self.head(x, residual, labels, last=self.last_tokens(input_ids))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: (B, T) ids -> (B, T, C); positions enter as rotations inside attention."""
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds n_positions {self.config.n_positions}")
        return self.tok_emb(input_ids)

    def last_tokens(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """(B,) index of each row's last token that is not padding, which a classification head reads (as HF:
        the rightmost id not ``pad_token_id``; the last position when there is none)."""
        if self.config.head != "cls":
            return None
        T = input_ids.shape[1]
        if self.config.pad_token_id is None:
            return torch.full(input_ids.shape[:1], T - 1, device=input_ids.device)
        kept = (input_ids != self.config.pad_token_id).long()
        return (torch.arange(T, device=input_ids.device) * kept).argmax(-1)

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
             last: Optional[torch.Tensor] = None) -> Output:
        """Final norm and the LM or classification head on the blocks' output (x + residual)."""
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)  # (B, T, C)
        c = self.config
        if c.head == "none":
            return Output(logits=h, last_hidden_state=h)
        if c.head == "cls":
            if last is None:
                raise ValueError("a Llama classification head reads each row's last token from input_ids, which "
                                 "pipeline and sequence parallelism do not pass to the head: train it under dp, "
                                 "tensor parallelism or ZeRO")
            pooled = h[torch.arange(h.shape[0], device=h.device), last]  # (B, C)
            local = self.classifier(pooled)  # (B, num_labels)
            loss = self.classifier.loss_from_logits(local, labels) if labels is not None else None
            return Output(logits=lazy(self.classifier.gather_logits, local), loss=loss, last_hidden_state=h)
        table = self.tok_emb if c.tie_embeddings else self.lm_head
        # with labels (token t predicts token t + 1) the fused linear cross-entropy, vocab-parallel under tp, and
        # the (B, T, V) logits made only when read
        loss, logits = table.lm_outputs(h, labels, shift=True)
        return Output(logits=logits, loss=loss, last_hidden_state=h)
