"""Llama family <-> Hugging Face Llama / Qwen2 / Mistral (causal LM, sequence classification, base model)."""
from __future__ import annotations

from cuboid.zoo.hf_io import Family, TensorMap

from .config import LlamaConfig
from .model import Llama

_HEADS = {"ForCausalLM": "lm", "ForSequenceClassification": "cls", "Model": "none"}
_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
ARCHITECTURES = {f"{name}{suffix}": {"head": head, "arch": arch, **({"prefixed": False} if head == "none" else {})}
                 for arch, name in _NAMES.items() for suffix, head in _HEADS.items()}


def _rope_scaling(d: dict):
    scaling = d.get("rope_scaling") or (d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling of type {kind!r} is not supported (llama3 or none)")
    keep = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {"rope_type": "llama3", **{k: scaling[k] for k in keep[1:]}}


def _rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    return float(d.get("rope_theta", params.get("rope_theta", 10000.0)))


def config_from_hf(d: dict, arch_name: str) -> LlamaConfig:
    spec = ARCHITECTURES[arch_name]
    arch = spec["arch"]
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch_name} hidden_act {act!r} is not supported (silu)")
    positions = d.get("max_position_embeddings", 4096)
    window = d.get("sliding_window")
    uses_window = window is not None and (arch == "mistral" or d.get("use_sliding_window", False))
    if uses_window and window < positions:
        raise ValueError(f"{arch_name} with sliding-window attention (sliding_window={window} < "
                         f"max_position_embeddings={positions}) is not supported: cuboid's attention is full")
    if spec["head"] == "cls" and d.get("problem_type") not in (None, "single_label_classification"):
        raise ValueError(f"{arch_name} problem_type {d['problem_type']!r} is not supported (single-label)")
    heads = d["num_attention_heads"]
    bias = d.get("attention_bias", arch == "qwen2")
    return LlamaConfig(
        vocab_size=d["vocab_size"], n_positions=positions, dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads, mlp_hidden=d["intermediate_size"],
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(d), rope_scaling=_rope_scaling(d), attention_bias=bool(bias),
        mlp_bias=bool(d.get("mlp_bias", False)), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        head=spec["head"], num_labels=len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2),
        pad_token_id=d.get("pad_token_id"), arch=arch, init_std=d.get("initializer_range", 0.02),
    )


def config_to_hf(c: LlamaConfig) -> dict:
    d = {
        "model_type": c.arch, "vocab_size": c.vocab_size, "max_position_embeddings": c.n_positions,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.mlp_hidden, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope,
        "tie_word_embeddings": c.tie_embeddings, "initializer_range": c.init_std, "attention_dropout": c.dropout,
        "pad_token_id": c.pad_token_id,
    }
    if c.arch == "llama":
        d.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif c.arch == "qwen2":  # Qwen2 always has q/k/v biases
        if not c.attention_bias or c.mlp_bias:
            raise ValueError("a Qwen2 export needs attention_bias=True and mlp_bias=False")
        d.update(use_sliding_window=False, sliding_window=None)
    else:
        if c.attention_bias or c.mlp_bias:
            raise ValueError("a Mistral export has no biases (attention_bias and mlp_bias must be False)")
        d.update(sliding_window=None)
    if c.head == "cls":
        d.update(id2label={str(i): f"LABEL_{i}" for i in range(c.num_labels)},
                 label2id={f"LABEL_{i}": i for i in range(c.num_labels)})
    return d


def architecture_of(c: LlamaConfig) -> str:
    return _NAMES[c.arch] + {v: k for k, v in _HEADS.items()}[c.head]


def _linear(zoo: str, hf: str, bias: bool) -> list[TensorMap]:
    return [TensorMap(f"{zoo}.weight", (f"{hf}.weight",))] + ([TensorMap(f"{zoo}.bias", (f"{hf}.bias",))] if bias else [])


def tensor_maps(c: LlamaConfig) -> list[TensorMap]:
    rows = [TensorMap("tok_emb.weight", ("embed_tokens.weight",)), TensorMap("ln_f.weight", ("norm.weight",))]
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"layers.{i}."
        rows += [TensorMap(z + "ln1.weight", (h + "input_layernorm.weight",)),
                 TensorMap(z + "ln2.weight", (h + "post_attention_layernorm.weight",))]
        for zn in ("q", "k", "v"):
            rows += _linear(z + f"attn.{zn}", h + f"self_attn.{zn}_proj", c.attention_bias)
        rows += _linear(z + "attn.proj", h + "self_attn.o_proj", False)
        for zn, hn in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            rows += _linear(z + f"mlp.{zn}", h + f"mlp.{hn}", c.mlp_bias)
    if c.head == "lm" and not c.tie_embeddings:
        rows.append(TensorMap("lm_head.weight", ("lm_head.weight",), top=True))
    elif c.head == "cls":
        rows.append(TensorMap("classifier.weight", ("score.weight",), top=True))
    return rows


FAMILY = Family(
    name="llama", architectures=ARCHITECTURES, base_prefix="model.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=Llama,
    # rotary tables of old checkpoints; the tied head when a writer stored it
    ignored=(".rotary_emb.inv_freq", "lm_head.weight"),
)
