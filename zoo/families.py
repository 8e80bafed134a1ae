"""The model families the zoo knows (GPT, BERT, ViT, Llama with Qwen2, Mistral, Qwen3 and Gemma 3 as its
options, DeepSeek-V3), registered one record each (:mod:`.registry`), which one a model belongs to, and its
shape.

Its own module, below both the package's front (``cuboid.zoo``) and the
checkpoint package, so that the checkpoint code finds a model's Hugging Face
mapping without importing the zoo package that uses it.

:func:`shape_of` says what the cost model reads of a config
(:class:`cuboid.parallel.cost.Shape`): each family fills the fields from its
own config, and registers that function with the cost model, which never
guesses a family itself.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from cuboid.parallel.cost.shape import Shape

from . import specs
from .bert.config import PRESETS as _BERT_PRESETS, BertConfig
from .bert.hf import FAMILY as _BERT
from .deepseek.config import PRESETS as _DEEPSEEK_PRESETS, DeepSeekConfig
from .deepseek.hf import FAMILY as _DEEPSEEK
from .deepseek.moe import update_routing_bias
from .gpt.config import PRESETS as _GPT_PRESETS, GPTConfig
from .gpt.hf import FAMILY as _GPT
from .hf_io import Family
from .llama.config import PRESETS as _LLAMA_PRESETS, LlamaConfig
from .llama.hf import FAMILY as _LLAMA
from .registry import CLASSES, HF, SHAPES, FamilyRecord, register
from .vit.config import PRESETS as _VIT_PRESETS, ViTConfig
from .vit.hf import FAMILY as _VIT

FAMILIES = HF  # family name -> its Hugging Face mapping (the registry's table)


def family_of(model: nn.Module) -> Family:
    """The Hugging Face mapping (``name``, tensor maps, ...) of the family ``model`` belongs to."""
    for fam in FAMILIES.values():
        if isinstance(model, fam.build):
            return fam
    raise TypeError(f"{type(model).__name__} is not a zoo model")


def _gpt_shape(c: GPTConfig) -> Shape:
    """GPT-2: fused qkv, a GELU MLP, the LM head tied to the token embedding."""
    return Shape(c.n_layers, c.dim, c.n_heads, c.hidden, c.vocab_size, c.n_positions, tied_head=c.head == "lm",
                 **_counts(c))


def _bert_shape(c: BertConfig) -> Shape:
    """BERT: GPT's block, an MLM head tied to the token embedding, the first token broadcast to a pooled head."""
    return Shape(c.n_layers, c.dim, c.n_heads, c.hidden, c.vocab_size, c.n_positions, tied_head=c.head == "mlm",
                 first_token_tensors=1, **_counts(c))


def _vit_shape(c: ViTConfig) -> Shape:
    """ViT: no vocabulary; the patches and the class token are the sequence, whose first token (and its
    pre-norm residual) the classifier takes."""
    return Shape(c.n_layers, c.dim, c.n_heads, c.hidden, 0, c.n_patches + 1, tied_head=False,
                 first_token_tensors=2, **_counts(c))


def _llama_shape(c: LlamaConfig) -> Shape:
    """Llama, Qwen2, Mistral, Qwen3, Gemma 3, and the mixture-of-experts Qwen3-MoE, Mixtral and OLMoE:
    grouped-query attention (head_dim apart from dim / heads), a gated MLP (or, on a sparse layer, a router and
    ``n_experts`` gated experts of ``moe_hidden`` of which each token takes ``experts_per_token``), an LM head
    tied only when the config says; sliding-window layers counted with their window. Per-head q/k norms and
    Gemma's extra norms are vectors the formulas leave out (under 0.01% of the parameters); the parameter
    counts hold them."""
    windows = [c.window_of(i) for i in range(c.n_layers)]
    windowed = [w for w in windows if w]
    experts = c.n_experts
    return Shape(c.n_layers, c.dim, c.n_heads, c.mlp_hidden, c.vocab_size, c.n_positions,
                 tied_head=c.head == "lm" and c.tie_embeddings, kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                 gated_mlp=True, window=max(windowed, default=0), window_layers=len(windowed),
                 experts=experts, top_k=c.experts_per_token if experts else 0,
                 expert_hidden=c.expert_hidden if experts else 0, sparse_layers=len(c.sparse_layers),
                 aux_loss=bool(experts and c.output_router_logits),
                 head_norm=2 * c.head_dim if c.qk_norm and c.qk_norm_width == "head" else 0, **_counts(c))


def _deepseek_shape(c: DeepSeekConfig) -> Shape:
    """DeepSeek-V3: multi-head latent attention (q through a ``q_lora_rank`` path or not, keys and values from a
    ``kv_lora_rank`` latent plus a shared RoPE key, values of ``v_head_dim``), a gated MLP on the first
    ``first_k_dense_replace`` layers, then a sigmoid router over ``n_experts`` experts of ``moe_hidden`` of which
    each token takes ``experts_per_token``, beside ``n_shared_experts`` shared ones every token takes; no aux loss."""
    experts = c.n_experts if c.moe_layers else 0
    return Shape(c.n_layers, c.dim, c.n_heads, c.mlp_hidden, c.vocab_size, c.n_positions,
                 tied_head=c.tie_embeddings, kv_heads=c.n_heads, head_dim=c.head_dim, gated_mlp=True,
                 experts=experts, top_k=c.experts_per_token if experts else 0,
                 expert_hidden=c.moe_hidden if experts else 0, sparse_layers=len(c.moe_layers),
                 shared_hidden=c.n_shared_experts * c.moe_hidden if experts else 0, q_rank=c.q_lora_rank or 0,
                 latent=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, balance_stats=False,
                 **_counts(c))


@functools.lru_cache(maxsize=64)
def _counts(config) -> dict:
    """``parameters`` and ``active_parameters`` of a config's model: the total counted on a meta build (exact by
    construction: every parameter once, tied ones once; less ``uncounted_parameters``, which transformers keeps
    as buffers), less the experts a token leaves idle (``inactive_parameters``) for the active ones."""
    from .common import count_parameters

    with torch.device("meta"):
        total = count_parameters(CLASSES[type(config)](config)) - getattr(config, "uncounted_parameters", 0)
    idle = getattr(config, "inactive_parameters", 0)
    return {"parameters": total, "active_parameters": total - idle}


def _routing_bias_step(model: nn.Module) -> None:
    """DeepSeek-V3 after each optimizer step: the routers' correction biases move by the config's
    ``moe_bias_update_rate`` (0: off)."""
    update_routing_bias(model, model.config.moe_bias_update_rate)


# the registry lines: one a family
register(FamilyRecord("gpt", GPTConfig, _GPT.build, _GPT_PRESETS, specs.GPT, _gpt_shape, _GPT))
register(FamilyRecord("bert", BertConfig, _BERT.build, _BERT_PRESETS, specs.BERT, _bert_shape, _BERT))
register(FamilyRecord("vit", ViTConfig, _VIT.build, _VIT_PRESETS, specs.VIT, _vit_shape, _VIT))
register(FamilyRecord("llama", LlamaConfig, _LLAMA.build, _LLAMA_PRESETS, specs.LLAMA, _llama_shape, _LLAMA))
register(FamilyRecord("deepseek", DeepSeekConfig, _DEEPSEEK.build, _DEEPSEEK_PRESETS, specs.DEEPSEEK,
                      _deepseek_shape, _DEEPSEEK, after_step=_routing_bias_step))


def shape_of(config) -> Shape:
    """What the cost model reads of a zoo config (:class:`cuboid.parallel.cost.Shape`)."""
    if type(config) not in SHAPES:
        raise TypeError(f"{type(config).__name__} is not a zoo config")
    return SHAPES[type(config)](config)
