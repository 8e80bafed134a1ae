"""DeepSeek-V3 decoder: multi-head latent attention (zoo/deepseek/mla.py), RMSNorm, the first
``first_k_dense_replace`` layers' gated MLP and then DeepSeek's mixture of experts (zoo/deepseek/moe.py).

Written like the Llama family's decoder, whose pieces it reuses (the pre-norm block, the gated MLP, the fused
LM head): ``tok_emb``, ``blocks.N.{ln1, attn, ln2, mlp}``, ``ln_f``, ``lm_head``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.mask import Mask
from cuboid.parallel.moe import Recorder, recording
from cuboid.zoo.common import Decoder, Output, attention_mask_of, count_targets, init_parameters, lm_output, pre_norm
from cuboid.zoo.llama.moe import MoeOutput

from .config import DeepSeekConfig
from .mla import MLA
from .moe import DeepSeekMoE, gated_mlp

NORM_NAMES = ("ln1", "ln2", "ln_f", "q_norm", "kv_norm")


class DeepSeekBlock(nn.Module):
    """Pre-norm block: ``forward(x, residual) -> (x', residual')``, the hidden state being ``x' + residual'``."""

    def __init__(self, c: DeepSeekConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln1 = L.RMSNorm(c.dim, c.eps)
        self.attn = MLA(c)
        self.ln2 = L.RMSNorm(c.dim, c.eps)
        self.mlp = DeepSeekMoE(c) if c.is_sparse(layer) else gated_mlp(c.dim, c.mlp_hidden)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, mask: Optional[Mask] = None):
        return pre_norm(self, x, residual, mask)


class DeepSeekV3(Decoder):
    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(DeepSeekBlock(c, i) for i in range(c.n_layers))
        self.ln_f = L.RMSNorm(c.dim, c.eps)
        if not c.tie_embeddings:
            self.lm_head = L.Embedding(c.vocab_size, c.dim)  # (V, C), used as the head's weight only

    def num_targets(self, batch: dict) -> int:
        return count_targets(batch.get("labels"), shift=True)

    def init_weights(self, seed: int = 0) -> None:
        """transformers' init: N(0, init_std) for linear, embedding, router and expert weights; norms 1; biases
        (the routers' correction biases too) 0."""
        std = self.config.init_std

        def rule(name: str, shape: torch.Size):
            parts = name.split(".")
            if parts[-1] == "bias":
                return "zeros", 0.0
            if parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in NORM_NAMES:
                return "ones", 0.0
            return "normal", std

        init_parameters(self, rule, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                output_router_logits: Optional[bool] = None, logprobs: bool = False) -> Output:
        """As the Llama family's forward. With ``output_router_logits`` (default: the config's) the output also
        has ``router_logits`` (one (B*T, E) fp32 tensor per sparse layer, transformers'); DeepSeek-V3 has no
        auxiliary loss (``aux_loss`` None): its balance comes from the correction bias."""
        no_loss = logprobs and labels is None
        labels = input_ids if no_loss else labels
        x = self.embed(input_ids)  # (B, T, C)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)
        routed = self.config.output_router_logits if output_router_logits is None else output_router_logits
        if routed and self.config.moe_layers:
            recorder = Recorder(self.config.experts_per_token, keep_logits=True)
            with recording(recorder):
                x, residual = self.run_blocks(x, mask)
        else:
            recorder = None
            x, residual = self.run_blocks(x, mask)
        out = self.head(x, residual, labels, logprobs=logprobs)
        if no_loss:
            out.loss = None
        if recorder is None:
            return out
        return MoeOutput(**{n: out.raw(n) for n in Output.FIELDS}, router_logits=tuple(recorder.logits))

    def run_blocks(self, x: torch.Tensor, mask: Optional[Mask]) -> tuple:
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, mask)
        return x, residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds n_positions {self.config.n_positions}")
        return self.tok_emb(input_ids)

    def last_tokens(self, input_ids: torch.Tensor) -> None:
        return None  # a causal LM head reads every position

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
             last: Optional[torch.Tensor] = None, logprobs: bool = False) -> Output:
        """Final norm and the LM head on the blocks' output (x + residual)."""
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)  # (B, T, C)
        table = self.tok_emb if self.config.tie_embeddings else self.lm_head
        return lm_output(table, h, labels, logprobs)
