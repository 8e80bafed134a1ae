"""DeepSeek-V3 <-> Hugging Face ``DeepseekV3ForCausalLM``.

The experts are stored as the published checkpoints store them and as transformers 5's ``save_pretrained``
writes them: one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``), the router as
``mlp.gate.weight`` with its ``mlp.gate.e_score_correction_bias``, the shared expert as
``mlp.shared_experts.{gate,up,down}_proj``."""
from __future__ import annotations

from cuboid.zoo.hf_io import Family, TensorMap, per_expert

from .config import DeepSeekConfig
from .model import DeepSeekV3

ARCHITECTURES = {"DeepseekV3ForCausalLM": {"head": "lm"}}
_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def _rope(d: dict) -> tuple:
    """(rope_theta, the yarn parameters or None) from the old keys or transformers 5's ``rope_parameters``."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    scaling = d.get("rope_scaling") or params
    theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"DeepseekV3ForCausalLM rope type {kind!r} is not supported (yarn or default)")
    return theta, {"rope_type": "yarn", **{k: scaling[k] for k in _ROPE_KEYS if scaling.get(k) is not None}}


def config_from_hf(d: dict, arch_name: str) -> DeepSeekConfig:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch_name} hidden_act {act!r} is not supported (silu)")
    heads = d["num_attention_heads"]
    if (d.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"{arch_name} with num_key_value_heads {d['num_key_value_heads']} != num_attention_heads "
                         f"{heads} is not supported (MLA expands keys and values for every head)")
    theta, rope = _rope(d)
    return DeepSeekConfig(
        vocab_size=d["vocab_size"], n_positions=d.get("max_position_embeddings", 4096), dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"], n_heads=heads, mlp_hidden=d["intermediate_size"],
        moe_hidden=d["moe_intermediate_size"], n_experts=d.get("n_routed_experts") or 0,
        n_shared_experts=d.get("n_shared_experts") or 0, experts_per_token=d.get("num_experts_per_tok") or 1,
        n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        first_k_dense_replace=d.get("first_k_dense_replace") or 0, q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"], eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=rope, rope_interleave=bool(d.get("rope_interleave", True)),
        attention_bias=bool(d.get("attention_bias", False)), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=d.get("initializer_range", 0.02), pad_token_id=d.get("pad_token_id"),
        output_router_logits=bool(d.get("output_router_logits", False)),
        dropout=float(d.get("attention_dropout") or 0.0))


def config_to_hf(c: DeepSeekConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": c.rope_theta} if c.rope is None else \
        {**c.rope, "rope_theta": c.rope_theta}
    return {
        "model_type": "deepseek_v3", "vocab_size": c.vocab_size, "max_position_embeddings": c.n_positions,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads, "intermediate_size": c.mlp_hidden, "moe_intermediate_size": c.moe_hidden,
        "n_routed_experts": c.n_experts, "n_shared_experts": c.n_shared_experts,
        "num_experts_per_tok": c.experts_per_token, "n_group": c.n_group, "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": c.norm_topk_prob,
        "first_k_dense_replace": c.first_k_dense_replace, "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.eps, "rope_parameters": rope, "rope_interleave": c.rope_interleave,
        "attention_bias": c.attention_bias, "tie_word_embeddings": c.tie_embeddings,
        "initializer_range": c.init_std, "pad_token_id": c.pad_token_id,
        "output_router_logits": c.output_router_logits, "attention_dropout": c.dropout, "num_nextn_predict_layers": 0,
    }


def architecture_of(c: DeepSeekConfig) -> str:
    return "DeepseekV3ForCausalLM"


def _w(zoo: str, hf: str, bias: bool = False) -> list:
    rows = [TensorMap(f"{zoo}.weight", (f"{hf}.weight",))]
    return rows + ([TensorMap(f"{zoo}.bias", (f"{hf}.bias",))] if bias else [])


def _mlp(z: str, h: str) -> list:
    pairs = (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj"))
    return [r for zn, hn in pairs for r in _w(z + zn, h + hn)]


def tensor_maps(c: DeepSeekConfig) -> list:
    rows = [TensorMap("tok_emb.weight", ("embed_tokens.weight",)), TensorMap("ln_f.weight", ("norm.weight",))]
    b = c.attention_bias
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"layers.{i}."
        a, s = z + "attn.", h + "self_attn."
        rows += _w(z + "ln1", h + "input_layernorm") + _w(z + "ln2", h + "post_attention_layernorm")
        if c.q_lora_rank is None:
            rows += _w(a + "q", s + "q_proj")
        else:
            rows += _w(a + "q_a", s + "q_a_proj", b) + _w(a + "q_norm", s + "q_a_layernorm")
            rows += _w(a + "q_b", s + "q_b_proj")
        rows += _w(a + "kv_a", s + "kv_a_proj_with_mqa", b) + _w(a + "kv_norm", s + "kv_a_layernorm")
        rows += _w(a + "kv_b", s + "kv_b_proj") + _w(a + "proj", s + "o_proj", b)
        if not c.is_sparse(i):
            rows += _mlp(z + "mlp.", h + "mlp.")
            continue
        m, experts = h + "mlp.", range(c.n_experts)
        rows += [TensorMap(z + "mlp.router.weight", (m + "gate.weight",)),
                 TensorMap(z + "mlp.router.bias", (m + "gate.e_score_correction_bias",)),
                 per_expert(z + "mlp.experts.gate_up",
                            [f"{m}experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj")], 2),
                 per_expert(z + "mlp.experts.down", [f"{m}experts.{e}.down_proj.weight" for e in experts], 1)]
        rows += _mlp(z + "mlp.shared.", m + "shared_experts.")
    if not c.tie_embeddings:
        rows.append(TensorMap("lm_head.weight", ("lm_head.weight",), top=True))
    return rows


FAMILY = Family(
    name="deepseek", architectures=ARCHITECTURES, base_prefix="model.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=DeepSeekV3,
    ignored=(".rotary_emb.inv_freq", "lm_head.weight"),
)
