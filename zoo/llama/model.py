"""Llama-family decoder (Llama 2/3, Qwen2, Mistral, Qwen3, Gemma 3, Qwen3-MoE, Mixtral, OLMoE, gpt-oss): RoPE,
RMSNorm, a gated MLP, grouped-query attention, and the options Qwen3 and Gemma 3 add (q/k norms, sliding-window
layers, sandwich norms), the mixtures of experts' sparse layers (zoo/llama/moe.py) and gpt-oss's attention sinks
(zoo/llama/gpt_oss.py)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import cuboid.kernels as kernels
from cuboid.parallel import layers as L
from cuboid.parallel.head import lazy
from cuboid.parallel.mask import Mask
from cuboid.parallel.moe import recording
from cuboid.parallel.state import balance_reduce_of
from cuboid.zoo.common import (Decoder, Output, attention_mask_of, classifier_output, count_targets, init_parameters,
                               last_tokens, linears, lm_output, pre_norm)

from .config import LlamaConfig
from .moe import SparseMLP, recorder_for, with_router_outputs
from .parts import GemmaRMSNorm, rotary


def norm_class(c: LlamaConfig) -> type:
    return GemmaRMSNorm if c.gemma_norms else L.RMSNorm


NORM_NAMES = ("ln1", "ln2", "ln_f", "post_ln1", "post_ln2", "q_norm", "k_norm")


def _is_norm_weight(name: str) -> bool:
    """Whether parameter ``name`` is a norm's weight (``blocks.3.post_ln1.weight``, ``ln_f.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in NORM_NAMES

class Attention(nn.Module):
    """Grouped-query self-attention: q (H heads), k and v (Hkv heads, each shared by H / Hkv query heads),
    rotated by RoPE in the attention core. Head counts are read off the (possibly sharded) projections.

    Layer ``layer``'s options: ``q_norm``/``k_norm`` over each head's features before RoPE (Qwen3, Gemma 3) or
    over all heads' features before the split into heads (OLMoE: ``qk_norm_width="full"``), the sliding window
    of its core, a sliding layer's own RoPE base (Gemma 3's local layers), and gpt-oss's ``sinks`` (one learned
    logit per query head in each softmax's denominator) and output bias."""

    def __init__(self, c: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.head_dim = d = c.head_dim
        self.q = L.Linear(c.dim, c.n_heads * d, bias=c.attention_bias)
        self.k = L.Linear(c.dim, c.n_kv_heads * d, bias=c.attention_bias)
        self.v = L.Linear(c.dim, c.n_kv_heads * d, bias=c.attention_bias)
        self.full_qk_norm = c.qk_norm and c.qk_norm_width == "full"
        if c.qk_norm:
            self.q_norm = norm_class(c)(c.n_heads * d if self.full_qk_norm else d, c.eps)
            self.k_norm = norm_class(c)(c.n_kv_heads * d if self.full_qk_norm else d, c.eps)
        window = c.window_of(layer)
        if window is not None and c.rope_local_theta is not None:  # a local layer: its own base, unscaled
            self.rope = L.Rotary(d, c.rope_local_theta)
        else:
            self.rope = rotary(d, c.rope_theta, c.rope)
        self.core = L.Attention(window=window)
        self.proj = L.Linear(c.n_heads * d, c.dim, bias=c.o_bias)
        if c.attn_sinks:
            self.sinks = L.LearnedTensor(c.n_heads)  # a layer so that the spec cuts it with the heads
        self.dropout = L.Dropout(c.dropout)
        # the kernel scales scores by head_dim ** -0.5; Gemma's query_pre_attn_scalar asks for another scale
        self.q_scale = None if c.query_scale is None or c.query_scale == d else (d / c.query_scale) ** 0.5

    def forward(self, x: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        q, k, v = linears(x, (self.q, self.k, self.v))  # (B, T, H * D), (B, T, Hkv * D) twice
        B, T, _ = q.shape
        if self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))  # (B, T, heads, D)
        if hasattr(self, "q_norm") and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
        if hasattr(self, "sinks"):  # (H,) this rank's heads' sink logits
            y = self.core(q, k, v, causal=True, mask=mask, rope=self.rope, sinks=self.sinks())
        else:
            y = self.core(q, k, v, causal=True, mask=mask, rope=self.rope)  # (B, H, T, D)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class GatedMLP(nn.Module):
    """proj(act(gate(x)) * up(x)), (B, T, C) -> (B, T, C): SwiGLU (silu) or GeGLU (tanh GELU, Gemma)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.act = c.act
        self.gate = L.Linear(c.dim, c.mlp_hidden, bias=c.mlp_bias)
        self.up = L.Linear(c.dim, c.mlp_hidden, bias=c.mlp_bias)
        self.proj = L.Linear(c.mlp_hidden, c.dim, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two matmuls, not one over the stacked weights (zoo.common.linears): the halves of a stacked output are
        # strided views, slower to read, and their gradients are concatenated in backward (the CPU training
        # step of bench/train_step.py's Llama shapes is faster so: bench/RESULTS.md)
        if self.act == "silu":
            return self.proj(kernels.swiglu(self.gate(x), self.up(x)))
        return self.proj(L.gelu(self.gate(x), "tanh") * self.up(x))


SwiGLU = GatedMLP  # the name of Llama's MLP


class LlamaBlock(nn.Module):
    """Pre-norm block: ``forward(x, residual) -> (x', residual')``, the hidden state being ``x' + residual'``.

    With Gemma's norms, ``post_ln1`` and ``post_ln2`` also normalise the attention's and the MLP's outputs
    before they join the residual stream (HF's post_attention_layernorm and post_feedforward_layernorm;
    ``ln2`` is then HF's pre_feedforward_layernorm)."""

    def __init__(self, c: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        norm = norm_class(c)
        self.ln1 = norm(c.dim, c.eps)
        self.attn = Attention(c, layer)
        self.ln2 = norm(c.dim, c.eps)
        self.mlp = SparseMLP(c) if c.is_sparse(layer) else GatedMLP(c)
        if c.gemma_norms:
            self.post_ln1 = norm(c.dim, c.eps)
            self.post_ln2 = norm(c.dim, c.eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                mask: Optional[Mask] = None):
        if not hasattr(self, "post_ln1"):
            return pre_norm(self, x, residual, mask)
        h, residual = (self.ln1(x), x) if residual is None else self.ln1(x, residual)
        h, residual = self.ln2(self.post_ln1(self.attn(h, mask)), residual)
        return self.post_ln2(self.mlp(h)), residual


class Llama(Decoder):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c, i) for i in range(c.n_layers))
        self.ln_f = norm_class(c)(c.dim, c.eps)
        if c.head == "lm" and not c.tie_embeddings:
            self.lm_head = L.Embedding(c.vocab_size, c.dim)  # (V, C), used as the head's weight only
        elif c.head == "cls":
            self.classifier = L.Linear(c.dim, c.num_labels, bias=False)  # HF's "score"

    def num_targets(self, batch: dict) -> int:
        """Label positions the loss of ``batch`` averages over (data parallelism weights by it)."""
        return count_targets(batch.get("labels"), shift=self.config.head == "lm")

    def init_weights(self, seed: int = 0) -> None:
        """HF Llama init: N(0, init_std) for linear and embedding weights, routers and experts, zero biases,
        norms 1 (Gemma's norms, which scale by 1 + weight: 0); gpt-oss's sinks and router bias N(0, init_std)."""
        std = self.config.init_std
        norm_init = "zeros" if self.config.gemma_norms else "ones"

        def rule(name: str, shape: torch.Size):
            if name.endswith("router.bias"):
                return "normal", std
            if name.endswith("bias"):
                return "zeros", 0.0
            if _is_norm_weight(name):  # by name: a tensor mode swaps the norm modules for its own
                return norm_init, 0.0
            return "normal", std

        init_parameters(self, rule, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                output_router_logits: Optional[bool] = None, logprobs: bool = False) -> Output:
        """``position_ids`` (B, T) or (1, T): the rotary positions (HF's), restarting at 0 at each document of a
        packed row (attention stays inside each document); 0 .. T-1 when not given.

        With sparse layers the output also has ``aux_loss`` and, when ``output_router_logits`` (default: the
        config's), ``router_logits``, and ``loss`` includes ``router_aux_loss_coef * aux_loss`` (transformers').
        ``logprobs``: also ``token_logps`` and ``token_entropy`` (B, T - 1) of ``labels[:, 1:]`` (of
        ``input_ids[:, 1:]`` without labels, and then no loss): :func:`~cuboid.zoo.common.lm_output`."""
        no_loss = logprobs and labels is None
        labels = input_ids if no_loss else labels
        out = self._forward(input_ids, attention_mask, labels, position_ids, output_router_logits, logprobs)
        if no_loss:
            out.loss = None
        return out

    def _forward(self, input_ids, attention_mask, labels, position_ids, output_router_logits, logprobs) -> Output:
        x = self.embed(input_ids)  # (B, T, C)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)
        routed = self.config.output_router_logits if output_router_logits is None else output_router_logits
        # a plan that spreads the forward's tokens over ranks sums the statistics over them (its balance_reduce)
        recorder = recorder_for(self.config, input_ids, attention_mask, keep_logits=routed,
                                reduce=balance_reduce_of(self))
        if recorder is None:
            x, residual = self.run_blocks(x, mask)
            return self.head(x, residual, labels, last=self.last_tokens(input_ids), logprobs=logprobs)
        with recording(recorder):
            x, residual = self.run_blocks(x, mask)
        out = self.head(x, residual, labels, last=self.last_tokens(input_ids), logprobs=logprobs)
        return with_router_outputs(self.config, out, recorder, labels, add_loss=routed)

    def run_blocks(self, x: torch.Tensor, mask: Optional[Mask]) -> tuple:
        """The blocks on the embeddings: ``(x, residual)``, the hidden state being their sum."""
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, mask)
        return x, residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: (B, T) ids -> (B, T, C); positions enter as rotations inside attention."""
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds n_positions {self.config.n_positions}")
        x = self.tok_emb(input_ids)
        if self.config.embed_scale:  # Gemma: the scale rounded to the table's dtype first, as transformers does
            x = x * torch.tensor(self.config.dim ** 0.5, dtype=x.dtype)
        return x

    def last_tokens(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """(B,) index of each row's last token that is not padding, which a classification head reads
        (:func:`~cuboid.zoo.common.last_tokens`); None for the other heads."""
        return last_tokens(input_ids, self.config.pad_token_id) if self.config.head == "cls" else None

    def head(self, x: torch.Tensor, residual: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
             last: Optional[torch.Tensor] = None, logprobs: bool = False) -> Output:
        """Final norm and the LM or classification head on the blocks' output (x + residual)."""
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)  # (B, T, C)
        c = self.config
        if logprobs and (c.head != "lm" or c.logit_softcap is not None):
            raise ValueError("logprobs=True needs the fused LM head: this model's head is "
                             + (f"{c.head!r}" if c.head != "lm" else "softcapped (Gemma's final logit cap)"))
        if c.head == "none":
            return Output(logits=h, last_hidden_state=h)
        if c.head == "cls":
            return classifier_output(self.classifier, h, last, labels, "Llama")
        table = self.tok_emb if c.tie_embeddings else self.lm_head
        if c.logit_softcap is not None:
            return self._capped_lm(table, h, labels)
        return lm_output(table, h, labels, logprobs)

    def _capped_lm(self, table, h: torch.Tensor, labels: Optional[torch.Tensor]) -> Output:
        """The LM head with final logit softcapping (``cap * tanh(logits / cap)``): whole logits, then the loss
        on them (the fused linear cross-entropy has no cap)."""
        cap = self.config.logit_softcap
        local = table.lm_logits(h, gather=False)  # (B, T, V) or this rank's vocab slice
        local = torch.tanh(local / cap) * cap
        loss = None
        if labels is not None:
            loss = table.loss_from_logits(local[:, :-1], labels[:, 1:].to(torch.long))
        return Output(logits=lazy(table.gather_logits, local), loss=loss, last_hidden_state=h)
