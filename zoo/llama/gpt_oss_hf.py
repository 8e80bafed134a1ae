"""gpt-oss <-> Hugging Face ``GptOssForCausalLM``: the config's fields and the tensors gpt-oss stores its own way.

transformers keeps the experts as ``x @ W`` matrices with gate and up interleaved: ``mlp.experts.gate_up_proj``
(E, C, 2I), gate at even columns, ``gate_up_proj_bias`` (E, 2I) alike, ``down_proj`` (E, I, C), ``down_proj_bias``
(E, C); the router is ``mlp.router`` (weight and bias), the sinks ``self_attn.sinks`` (H,). The released
checkpoints store the expert matrices as MXFP4 (``gate_up_proj_blocks`` (E, 2I, C/32, 16) and ``_scales``
(E, 2I, C/32), the rows already in ``x W^T`` layout; ``down_proj_blocks`` (E, C, I/32, 16)): read through
:func:`~cuboid.zoo.llama.gpt_oss.dequantize_mxfp4` into the model's dtype, as transformers does without its
kernels. A model is always written unquantized (``to_hf``): training moved the weights off the MXFP4 grid.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from cuboid.zoo.hf_io import TensorMap, shape_of

from .config import LlamaConfig, gpt_oss_layers
from .gpt_oss import deinterleave, dequantize_mxfp4, interleave

ARCHITECTURE = "GptOssForCausalLM"


def config_from_hf(d: dict, common: dict, rope_theta: float, rope_scaling) -> LlamaConfig:
    """GptOssConfig (``common``: the fields every Llama-family config reads alike)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{ARCHITECTURE} hidden_act {d['hidden_act']!r} is not supported (silu)")
    q = d.get("quantization_config")
    if q and q.get("quant_method") != "mxfp4":
        raise ValueError(f"{ARCHITECTURE} quantization_config {q.get('quant_method')!r} is not read (mxfp4 is)")
    layers = d["num_hidden_layers"]
    return LlamaConfig(
        **common, arch="gpt_oss", rope_theta=rope_theta, rope_scaling=rope_scaling,
        attention_bias=bool(d.get("attention_bias", True)), o_bias=bool(d.get("attention_bias", True)),
        attn_sinks=True, sliding_window=d.get("sliding_window"),
        layer_types=tuple(d.get("layer_types") or gpt_oss_layers(layers)),
        n_experts=d.get("num_local_experts", d.get("num_experts", 128)),
        experts_per_token=d.get("num_experts_per_tok", d.get("experts_per_token", 4)),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(d.get("output_router_logits", False)),
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)))


def config_to_hf(c: LlamaConfig, decoder_keys: dict) -> dict:
    """GptOssConfig of a gpt-oss config (``decoder_keys``: what every Llama-family export writes)."""
    if c.head != "lm" or not c.attn_sinks or c.attention_bias != c.o_bias or c.qk_norm or c.gemma_norms \
            or c.sparse_layers != tuple(range(c.n_layers)) or c.moe_hidden not in (0, c.mlp_hidden):
        raise ValueError(f"a {ARCHITECTURE} export has an LM head, sinks, the same bias on q/k/v and o, no q/k "
                         "or Gemma norms, and experts as wide as mlp_hidden on every layer")
    d = {k: v for k, v in decoder_keys.items() if k not in ("rope_theta", "rope_scaling")}
    rope = {"rope_type": "default", **(c.rope or {}), "rope_theta": c.rope_theta}
    d.update(rope_parameters=rope, attention_bias=c.attention_bias, sliding_window=c.sliding_window,
             layer_types=list(c.layer_types or (("sliding_attention",) * c.n_layers)),
             num_local_experts=c.n_experts, num_experts_per_tok=c.experts_per_token,
             router_aux_loss_coef=c.router_aux_loss_coef, output_router_logits=c.output_router_logits,
             swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
    return d


class _Experts:
    """A lazy zoo-shaped view of stored expert tensors (a slice of dim 0 reads only those experts):
    ``make(stored experts) -> zoo experts`` turns what was read into the zoo's layout."""

    def __init__(self, stored: Sequence[Any], shape: Sequence[int], make) -> None:
        self.stored, self.shape, self.make = list(stored), tuple(shape), make

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self):
        return torch.float32

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        first, *rest = idx + (slice(None),) * (len(self.shape) - len(idx))
        parts = [torch.as_tensor(s[(first,) + tuple(slice(0, n) for n in shape_of(s)[1:])]) for s in self.stored]
        return self.make(*parts)[(slice(None), *rest)]


def _gate_up(s):  # (E, C, 2I) interleaved -> (E, 2I, C), gate rows first
    E, C, I2 = shape_of(s[0])
    return _Experts(s, (E, I2, C), lambda t: deinterleave(t.transpose(1, 2), 1))


def _down(s):  # (E, I, C) -> (E, C, I)
    E, I, C = shape_of(s[0])
    return _Experts(s, (E, C, I), lambda t: t.transpose(1, 2))


def _bias(s):  # (E, 2I) interleaved -> gate then up
    return _Experts(s, shape_of(s[0]), lambda t: deinterleave(t, 1))


def _mxfp4(rows_interleaved: bool):
    def view(s):
        E, rows, groups, _ = shape_of(s[0])
        make = (lambda b, sc: deinterleave(dequantize_mxfp4(b, sc), 1)) if rows_interleaved else dequantize_mxfp4
        return _Experts(s, (E, rows, groups * 32), make)
    return view


def _mxfp4_shapes(t: torch.Tensor) -> list:
    """What an MXFP4 folder stores for a zoo (E, rows, cols) tensor; the shapes only (a model is written
    unquantized, so only the reader's check calls it, on meta tensors)."""
    if not t.is_meta:
        raise ValueError("gpt-oss experts are written unquantized (to_hf), not as MXFP4")
    E, rows, cols = t.shape
    if cols % 32:
        raise ValueError(f"MXFP4 packs rows of 32 values: an experts tensor of {cols} columns cannot be stored so")
    return [torch.empty(E, rows, cols // 32, 16, dtype=torch.uint8, device="meta"),
            torch.empty(E, rows, cols // 32, dtype=torch.uint8, device="meta")]


def expert_maps(c: LlamaConfig, z: str, h: str) -> list[TensorMap]:
    """A gpt-oss layer's router and experts (``z``: ``blocks.N.mlp.``, ``h``: ``layers.N.mlp.``); the expert
    matrices read from MXFP4 blocks and scales where the folder has those instead."""
    e = h + "experts."
    quant = {name: TensorMap(z + f"experts.{zoo}", (f"{e}{name}_blocks", f"{e}{name}_scales"),
                             _mxfp4(name == "gate_up_proj"), _mxfp4_shapes)
             for zoo, name in (("gate_up", "gate_up_proj"), ("down", "down_proj"))}
    return [TensorMap(z + "router.weight", (h + "router.weight",)),
            TensorMap(z + "router.bias", (h + "router.bias",)),
            TensorMap(z + "experts.gate_up", (e + "gate_up_proj",), _gate_up,
                      lambda t: [interleave(t, 1).transpose(1, 2).contiguous()], alt=quant["gate_up_proj"]),
            TensorMap(z + "experts.gate_up_bias", (e + "gate_up_proj_bias",), _bias,
                      lambda t: [interleave(t, 1).contiguous()]),
            TensorMap(z + "experts.down", (e + "down_proj",), _down, lambda t: [t.transpose(1, 2).contiguous()],
                      alt=quant["down_proj"]),
            TensorMap(z + "experts.down_bias", (e + "down_proj_bias",))]
