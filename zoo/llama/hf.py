"""Llama family <-> Hugging Face Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 (text) (causal LM, sequence
classification, base model) and Qwen3-MoE / Mixtral / OLMoE / gpt-oss (causal LM; gpt-oss's own tensors:
zoo/llama/gpt_oss_hf.py).

The experts are stored as published checkpoints store them and as transformers 5's ``save_pretrained`` writes
them: one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)), the router as ``mlp.gate.weight``
(Mixtral: ``block_sparse_moe.gate.weight``)."""
from __future__ import annotations

from typing import Optional

from cuboid.zoo.hf_io import Family, TensorMap, per_expert

from . import gpt_oss_hf
from .config import FULL, SLIDING, LlamaConfig, gemma3_layers
from .model import Llama

_HEADS = {"ForCausalLM": "lm", "ForSequenceClassification": "cls", "Model": "none"}
_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3"}
ARCHITECTURES = {f"{name}{suffix}": {"head": head, "arch": arch, **({"prefixed": False} if head == "none" else {})}
                 for arch, name in _NAMES.items() for suffix, head in _HEADS.items()}
# Gemma 3's text-only classes (Gemma3ForSequenceClassification and Gemma3Model are the multimodal ones)
GEMMA3 = {"Gemma3ForCausalLM": "lm", "Gemma3TextForSequenceClassification": "cls", "Gemma3TextModel": "none"}
ARCHITECTURES.update({name: {"head": head, "arch": "gemma3", **({"prefixed": False} if head == "none" else {})}
                      for name, head in GEMMA3.items()})
MOE = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}
ARCHITECTURES.update({name: {"head": "lm", "arch": arch} for arch, name in MOE.items()})
ARCHITECTURES[gpt_oss_hf.ARCHITECTURE] = {"head": "lm", "arch": "gpt_oss"}


def rope_scaling_of(scaling, where: str = "rope_scaling"):
    """HF's rope scaling dict as the zoo keeps it: None for default RoPE; llama3 and linear kept."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    keys = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "linear": ("factor",)}
    if kind == "yarn":  # the optional keys where the file has them
        return {"rope_type": kind, **{k: scaling[k] for k in _YARN if scaling.get(k) is not None}}
    if kind not in keys:
        raise ValueError(f"{where} of type {kind!r} is not supported (llama3, linear, yarn or none)")
    return {"rope_type": kind, **{k: scaling[k] for k in keys[kind]}}


_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor",
         "mscale", "mscale_all_dim")


def _rope_scaling(d: dict):
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None
    return rope_scaling_of(d.get("rope_scaling") or params)


def _rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    return float(d.get("rope_theta", params.get("rope_theta", 10000.0)))


def _layer_types(d: dict, arch: str, window) -> Optional[tuple]:
    """Which layers slide: HF's layer_types where the file has them, else Qwen's ``max_window_layers`` (layers
    from that index on slide); None (every layer) for Mistral."""
    if window is None or arch == "mistral":
        return None
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    first = d.get("max_window_layers", 28)
    return tuple(SLIDING if i >= first else FULL for i in range(d["num_hidden_layers"]))


def config_from_hf(d: dict, arch_name: str) -> LlamaConfig:
    spec = ARCHITECTURES[arch_name]
    arch = spec["arch"]
    if arch == "gemma3":
        return config_from_gemma3(d, arch_name, spec["head"])
    if arch in MOE:
        return config_from_moe(d, arch_name, arch)
    if arch == "gpt_oss":
        return gpt_oss_hf.config_from_hf(d, _common(d, arch_name, "lm"), _rope_theta(d), _rope_scaling(d))
    _check_silu(d, arch_name)
    window = _window(d, arch == "mistral")
    bias = d.get("attention_bias", arch == "qwen2")
    return LlamaConfig(**_common(d, arch_name, spec["head"]), rope_theta=_rope_theta(d), rope_scaling=_rope_scaling(d),
                       attention_bias=bool(bias), mlp_bias=bool(d.get("mlp_bias", False)), arch=arch,
                       qk_norm=arch == "qwen3", sliding_window=window, layer_types=_layer_types(d, arch, window))


def _check_silu(d: dict, arch_name: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch_name} hidden_act {act!r} is not supported (silu)")


def _window(d: dict, always: bool):
    """The sliding window: on every layer for Mistral and Mixtral (``always``), else where use_sliding_window."""
    return d.get("sliding_window") if always or d.get("use_sliding_window", False) else None


def _gemma_options(c: LlamaConfig) -> bool:
    """Whether ``c`` uses an option only a Gemma 3 export has (or a non-SiLU MLP)."""
    return c.act != "silu" or c.gemma_norms or c.embed_scale or c.query_scale is not None \
        or c.logit_softcap is not None or c.rope_local_theta is not None


def _common(d: dict, arch_name: str, head: str) -> dict:
    """The LlamaConfig fields every architecture reads alike."""
    if head == "cls" and d.get("problem_type") not in (None, "single_label_classification"):
        raise ValueError(f"{arch_name} problem_type {d['problem_type']!r} is not supported (single-label)")
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"], n_positions=d.get("max_position_embeddings", 4096), dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"], n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads,
        mlp_hidden=d["intermediate_size"], head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        eps=d.get("rms_norm_eps", 1e-6), tie_embeddings=bool(d.get("tie_word_embeddings", False)), head=head,
        num_labels=len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2),
        pad_token_id=d.get("pad_token_id"), init_std=d.get("initializer_range", 0.02),
        dropout=float(d.get("attention_dropout") or 0.0))


def _decoder_keys(c: LlamaConfig) -> dict:
    """The config.json keys Llama, Qwen2, Mistral, Qwen3 and the mixtures of experts write alike."""
    return {
        "model_type": c.arch, "vocab_size": c.vocab_size, "max_position_embeddings": c.n_positions,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.mlp_hidden, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope,
        "tie_word_embeddings": c.tie_embeddings, "initializer_range": c.init_std, "attention_dropout": c.dropout,
        "pad_token_id": c.pad_token_id,
    }


def config_from_moe(d: dict, arch_name: str, arch: str) -> LlamaConfig:
    """Qwen3MoeConfig, MixtralConfig, OlmoeConfig: the experts' fields; a window on every layer (Qwen3-MoE with
    use_sliding_window, Mixtral) or none (OLMoE)."""
    _check_silu(d, arch_name)
    for key in ("router_jitter_noise", "clip_qkv"):  # Mixtral's training noise, OLMoE's clipping
        if d.get(key):
            raise ValueError(f"{arch_name} with {key}={d[key]!r} is not supported (set it to 0 or null)")
    window = _window(d, arch == "mixtral")
    experts = d.get("num_local_experts") if arch == "mixtral" else d.get("num_experts", d.get("num_local_experts"))
    # absent keys take transformers' config defaults (Mixtral always normalises its top-k weights)
    moe = dict(n_experts=experts, experts_per_token=d.get("num_experts_per_tok", 2 if arch == "mixtral" else 8),
               norm_topk_prob=arch == "mixtral" or bool(d.get("norm_topk_prob", False)),
               router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.01 if arch == "olmoe" else 0.001)),
               output_router_logits=bool(d.get("output_router_logits", False)))
    if arch == "qwen3_moe":
        moe.update(moe_hidden=d["moe_intermediate_size"], sparse_step=d.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
    return LlamaConfig(**_common(d, arch_name, "lm"), **moe, rope_theta=_rope_theta(d), rope_scaling=_rope_scaling(d),
                       attention_bias=bool(d.get("attention_bias", False)), arch=arch, qk_norm=arch != "mixtral",
                       qk_norm_width="full" if arch == "olmoe" else "head", sliding_window=window)


def config_to_moe(c: LlamaConfig) -> dict:
    """Qwen3MoeConfig, MixtralConfig or OlmoeConfig of a mixture-of-experts config."""
    want_norm = {"qwen3_moe": (True, "head"), "mixtral": (False, "head"), "olmoe": (True, "full")}[c.arch]
    if _gemma_options(c) or c.mlp_bias or c.layer_types is not None \
            or (c.qk_norm, c.qk_norm_width if c.qk_norm else "head") != want_norm:
        raise ValueError(f"a {MOE[c.arch]} export has SwiGLU experts, no Gemma options, no mlp_bias, the same "
                         f"window on every layer, and qk_norm/qk_norm_width {want_norm}")
    d = {**_decoder_keys(c), "num_experts_per_tok": c.experts_per_token,
         "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": c.output_router_logits}
    if c.arch == "qwen3_moe":
        d.update(num_experts=c.n_experts, moe_intermediate_size=c.expert_hidden, norm_topk_prob=c.norm_topk_prob,
                 decoder_sparse_step=c.sparse_step, mlp_only_layers=list(c.mlp_only_layers),
                 attention_bias=c.attention_bias, use_sliding_window=c.sliding_window is not None,
                 sliding_window=c.sliding_window)
        return d
    if c.sparse_layers != tuple(range(c.n_layers)) or c.moe_hidden not in (0, c.mlp_hidden):
        raise ValueError(f"a {MOE[c.arch]} export has sparse layers only, experts as wide as mlp_hidden")
    if c.arch == "mixtral":
        if c.attention_bias or not c.norm_topk_prob:
            raise ValueError("a Mixtral export has no attention bias and normalised top-k weights (norm_topk_prob)")
        d.update(num_local_experts=c.n_experts, sliding_window=c.sliding_window, router_jitter_noise=0.0)
        return d
    if c.sliding_window is not None:
        raise ValueError("an OLMoE export has no sliding window")
    d.update(num_experts=c.n_experts, norm_topk_prob=c.norm_topk_prob, attention_bias=c.attention_bias, clip_qkv=None)
    return d


def config_to_hf(c: LlamaConfig) -> dict:
    if c.arch == "gpt_oss":
        return gpt_oss_hf.config_to_hf(c, _decoder_keys(c))
    if c.attn_sinks or c.o_bias:
        raise ValueError("sinks and an output projection bias are gpt-oss's (arch 'gpt_oss')")
    if c.arch == "gemma3":
        return config_to_gemma3(c)
    if c.arch in MOE:
        if c.head != "lm":
            raise ValueError(f"{MOE[c.arch]} exports a causal LM head only, got head {c.head!r}")
        return config_to_moe(c)
    d = _decoder_keys(c)
    if _gemma_options(c) or c.qk_norm != (c.arch == "qwen3"):
        raise ValueError(f"a {_NAMES[c.arch]} export has no Gemma options, and q/k norms only for Qwen3")
    if c.arch == "llama":
        if c.sliding_window is not None:
            raise ValueError("a Llama export has no sliding window (Mistral, Qwen2 and Qwen3 have one)")
        d.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif c.arch in ("qwen2", "qwen3"):
        if c.mlp_bias or c.attention_bias != (c.arch == "qwen2"):
            raise ValueError("a Qwen2 export needs attention_bias=True and a Qwen3 one False; neither has mlp_bias")
        d.update(_qwen_window(c))
        if c.arch == "qwen3":
            d.update(attention_bias=False)
    else:
        if c.attention_bias or c.mlp_bias:
            raise ValueError("a Mistral export has no biases (attention_bias and mlp_bias must be False)")
        if c.layer_types is not None and set(c.layer_types) != {SLIDING}:
            raise ValueError("a Mistral export slides every layer or none (its config has no layer_types)")
        d.update(sliding_window=c.sliding_window)
    return _with_labels(d, c)


def _qwen_window(c: LlamaConfig) -> dict:
    """Qwen2/Qwen3's window fields: layers from ``max_window_layers`` on slide."""
    if c.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.n_layers}
    types = c.layer_types or (SLIDING,) * c.n_layers
    first = types.index(SLIDING) if SLIDING in types else c.n_layers
    if any(t != (SLIDING if i >= first else FULL) for i, t in enumerate(types)):
        raise ValueError(f"a {_NAMES[c.arch]} export slides the layers from one index on, got layer_types {types}")
    return {"use_sliding_window": True, "sliding_window": c.sliding_window, "max_window_layers": first,
            "layer_types": list(types)}


def _with_labels(d: dict, c: LlamaConfig) -> dict:
    if c.head == "cls":
        d.update(id2label={str(i): f"LABEL_{i}" for i in range(c.num_labels)},
                 label2id={f"LABEL_{i}": i for i in range(c.num_labels)})
    return d


def config_from_gemma3(d: dict, arch_name: str, head: str) -> LlamaConfig:
    """Gemma3TextConfig: rope_theta (scaled) on global layers and rope_local_base_freq on sliding ones, in the
    old keys or transformers 5's per-layer-type ``rope_parameters``."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{arch_name} hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise ValueError(f"{arch_name} with {key}={d[key]!r} is not supported")
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    if rope_scaling_of(local, "rope_parameters.sliding_attention") is not None:
        raise ValueError(f"{arch_name}: scaled RoPE on sliding layers is not supported")
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or gemma3_layers(layers, d.get("sliding_window_pattern", 6))
    return LlamaConfig(
        **_common(d, arch_name, head), arch="gemma3", qk_norm=True, act="gelu_tanh", gemma_norms=True,
        embed_scale=True, attention_bias=bool(d.get("attention_bias", False)),
        rope_theta=float(d.get("rope_theta", full.get("rope_theta", 1000000.0))),
        rope_scaling=rope_scaling_of(d.get("rope_scaling") or full),
        rope_local_theta=float(d.get("rope_local_base_freq", local.get("rope_theta", 10000.0))),
        query_scale=float(d.get("query_pre_attn_scalar", 256)), sliding_window=d.get("sliding_window"),
        layer_types=tuple(types), logit_softcap=d.get("final_logit_softcapping"))


def _int_if_whole(x: float):
    """transformers' Gemma3TextConfig types query_pre_attn_scalar as an int."""
    return int(x) if float(x).is_integer() else x


def config_to_gemma3(c: LlamaConfig) -> dict:
    if not (c.qk_norm and c.gemma_norms and c.embed_scale and c.act == "gelu_tanh") or c.mlp_bias:
        raise ValueError("a Gemma 3 export needs qk_norm, gemma_norms, embed_scale, act='gelu_tanh' and no mlp_bias")
    d = {
        "model_type": "gemma3_text", "vocab_size": c.vocab_size, "max_position_embeddings": c.n_positions,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.mlp_hidden, "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": c.eps, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope, "rope_local_base_freq": c.rope_local_theta if c.rope_local_theta is not None
        else c.rope_theta, "query_pre_attn_scalar": _int_if_whole(c.query_scale or c.head_dim),
        "sliding_window": c.sliding_window, "layer_types": list(c.layer_types or (SLIDING,) * c.n_layers),
        "final_logit_softcapping": c.logit_softcap, "attn_logit_softcapping": None,
        "tie_word_embeddings": c.tie_embeddings, "initializer_range": c.init_std, "attention_dropout": c.dropout,
        "attention_bias": c.attention_bias, "pad_token_id": c.pad_token_id,
    }
    return _with_labels(d, c)


def architecture_of(c: LlamaConfig) -> str:
    if c.arch == "gpt_oss":
        return gpt_oss_hf.ARCHITECTURE
    if c.arch in MOE:
        return MOE[c.arch]
    if c.arch == "gemma3":
        return {v: k for k, v in GEMMA3.items()}[c.head]
    return _NAMES[c.arch] + {v: k for k, v in _HEADS.items()}[c.head]


def _linear(zoo: str, hf: str, bias: bool) -> list[TensorMap]:
    return [TensorMap(f"{zoo}.weight", (f"{hf}.weight",))] + ([TensorMap(f"{zoo}.bias", (f"{hf}.bias",))] if bias else [])


def tensor_maps(c: LlamaConfig) -> list[TensorMap]:
    rows = [TensorMap("tok_emb.weight", ("embed_tokens.weight",)), TensorMap("ln_f.weight", ("norm.weight",))]
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"layers.{i}."
        if c.gemma_norms:  # a norm before and after both attention and MLP
            norms = (("ln1", "input_layernorm"), ("post_ln1", "post_attention_layernorm"),
                     ("ln2", "pre_feedforward_layernorm"), ("post_ln2", "post_feedforward_layernorm"))
        else:
            norms = (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
        if c.qk_norm:
            norms += (("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))
        rows += [TensorMap(f"{z}{zn}.weight", (f"{h}{hn}.weight",)) for zn, hn in norms]
        for zn in ("q", "k", "v"):
            rows += _linear(z + f"attn.{zn}", h + f"self_attn.{zn}_proj", c.attention_bias)
        rows += _linear(z + "attn.proj", h + "self_attn.o_proj", c.o_bias)
        if c.attn_sinks:
            rows.append(TensorMap(z + "attn.sinks.weight", (h + "self_attn.sinks",)))
        if c.arch == "gpt_oss":
            rows += gpt_oss_hf.expert_maps(c, z + "mlp.", h + "mlp.")
            continue
        if c.is_sparse(i):
            rows += _expert_maps(c, z + "mlp.", h)
            continue
        for zn, hn in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            rows += _linear(z + f"mlp.{zn}", h + f"mlp.{hn}", c.mlp_bias)
    if c.head == "lm" and not c.tie_embeddings:
        rows.append(TensorMap("lm_head.weight", ("lm_head.weight",), top=True))
    elif c.head == "cls":
        rows.append(TensorMap("classifier.weight", ("score.weight",), top=True))
    return rows


def _expert_maps(c: LlamaConfig, z: str, h: str) -> list[TensorMap]:
    """A sparse layer's router and experts (``z``: the zoo's ``blocks.N.mlp.``, ``h``: HF's ``layers.N.``)."""
    if c.arch == "mixtral":
        h, gate, up, down = h + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        h, gate, up, down = h + "mlp.", "gate_proj", "up_proj", "down_proj"
    experts = range(c.n_experts)
    return [TensorMap(z + "router.weight", (h + "gate.weight",)),
            per_expert(z + "experts.gate_up", [f"{h}experts.{e}.{p}.weight" for e in experts for p in (gate, up)], 2),
            per_expert(z + "experts.down", [f"{h}experts.{e}.{down}.weight" for e in experts], 1)]


FAMILY = Family(
    name="llama", architectures=ARCHITECTURES, base_prefix="model.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=Llama,
    # rotary tables of old checkpoints; the tied head when a writer stored it
    ignored=(".rotary_emb.inv_freq", "lm_head.weight"),
)
