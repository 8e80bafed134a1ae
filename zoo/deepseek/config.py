"""DeepSeek-V3 configuration (DeepSeek-V3/R1, Kimi K2 and the models trained from them) and presets.

A decoder with multi-head latent attention (MLA) and a mixture of experts:

- **MLA**: queries through an optional low-rank path (``q_lora_rank``: ``q_a`` -> RMSNorm -> ``q_b``; None: one
  ``q`` projection); keys and values from one latent of ``kv_lora_rank`` numbers per token (RMSNorm'd) and a
  RoPE key of ``qk_rope_head_dim`` numbers shared by every head. A query/key head has ``qk_nope_head_dim +
  qk_rope_head_dim`` features, a value head ``v_head_dim``. RoPE (YaRN with ``mscale`` / ``mscale_all_dim``
  at the real sizes) rotates the last ``qk_rope_head_dim`` features only, in DeepSeek's interleaved pair order
  (``rope_interleave``).
- **MoE**: the layers from ``first_k_dense_replace`` on hold ``n_experts`` routed experts beside
  ``n_shared_experts`` shared ones (one gated MLP of ``n_shared_experts * moe_hidden``); sigmoid scores, the
  top ``topk_group`` of ``n_group`` groups (each group's score: the sum of its top two), then the top
  ``experts_per_token`` experts of those groups, chosen on score + ``e_score_correction_bias`` and weighed by
  the score alone (normalised when ``norm_topk_prob``, times ``routed_scaling_factor``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

ROPE_KINDS = ("default", "yarn")


@dataclass(frozen=True)
class DeepSeekConfig:
    vocab_size: int = 129280
    n_positions: int = 163840       # max_position_embeddings
    dim: int = 7168                 # hidden size
    n_layers: int = 61
    n_heads: int = 128
    mlp_hidden: int = 18432         # the dense layers' gated-MLP width (intermediate_size)
    moe_hidden: int = 2048          # each routed (and shared) expert's width (moe_intermediate_size)
    n_experts: int = 256            # routed experts of a sparse layer (n_routed_experts)
    n_shared_experts: int = 1       # shared experts, run as one gated MLP of n_shared_experts * moe_hidden
    experts_per_token: int = 8      # num_experts_per_tok
    n_group: int = 8                # expert groups; each token's experts come from topk_group of them
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3  # the first layers are dense
    q_lora_rank: Optional[int] = 1536  # None: a plain q projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple] = None  # sorted (key, value) pairs of HF's rope_parameters (yarn), or None
    rope_interleave: bool = True    # the RoPE features are interleaved pairs (DeepSeek's layout)
    attention_bias: bool = False    # biases of q_a / q, kv_a and o_proj
    tie_embeddings: bool = False
    head: str = "lm"                # a causal LM head (DeepseekV3ForCausalLM)
    init_std: float = 0.02
    pad_token_id: Optional[int] = None
    output_router_logits: bool = False  # the forward returns each sparse layer's router logits (transformers')
    dropout: float = 0.0            # attention dropout (0 in every release)
    # a training option, not HF's: after each optimizer step every router's correction bias += rate *
    # sign(mean load - load) (the family's after_step, zoo/families.py); 0: off
    moe_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.rope is not None and self.rope.get("rope_type", self.rope.get("type")) not in ROPE_KINDS:
            raise ValueError(f"DeepSeek-V3 rope_scaling must be of type yarn or default, got {self.rope}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 2, got {self.qk_rope_head_dim}")
        if self.head != "lm":
            raise ValueError(f"DeepSeek-V3 has a causal LM head only, got head {self.head!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be a positive int or None, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ValueError(f"first_k_dense_replace must lie in [0, n_layers {self.n_layers}], got "
                             f"{self.first_k_dense_replace}")
        if self.n_experts:
            self._check_routing()

    def _check_routing(self) -> None:
        E, G = self.n_experts, self.n_group
        if G < 1 or E % G or E // G < 2:
            raise ValueError(f"{E} experts must split into n_group {G} groups of at least 2 (a group's score "
                             "is the sum of its top two)")
        if not 1 <= self.topk_group <= G:
            raise ValueError(f"topk_group must be between 1 and n_group {G}, got {self.topk_group}")
        if not 1 <= self.experts_per_token <= self.topk_group * (E // G):
            raise ValueError(f"experts_per_token {self.experts_per_token} must be between 1 and the "
                             f"{self.topk_group * (E // G)} experts of the top {self.topk_group} groups")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (from ``first_k_dense_replace`` on)."""
        return bool(self.n_experts) and layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> tuple:
        """Indices of the sparse layers. (Not named ``sparse_layers``: the plans' router statistics are the
        Switch auxiliary loss of the Llama family's MoEs, which DeepSeek-V3 has none of.)"""
        return tuple(i for i in range(self.n_layers) if self.is_sparse(i))

    @property
    def n_kv_heads(self) -> int:
        """Keys and values are expanded from the latent for every head (multi-head after expansion)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """A query/key head's features (the kernel's ``D``); values have ``v_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers the generation cache keeps per token and layer: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def hidden(self) -> int:
        return self.mlp_hidden

    @property
    def rope(self) -> Optional[dict]:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def inactive_parameters(self) -> int:
        """Routed-expert parameters a token does not use: ``n_experts - experts_per_token`` experts (three
        matrices of ``dim x moe_hidden``) of every sparse layer."""
        return len(self.moe_layers) * (self.n_experts - self.experts_per_token) * 3 * self.dim * self.moe_hidden

    @property
    def uncounted_parameters(self) -> int:
        """The routers' correction biases (E per sparse layer): parameters here, so that checkpoints and plans
        carry them, buffers in transformers, whose parameter count leaves them out (so does the zoo's)."""
        return len(self.moe_layers) * self.n_experts

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = self.rope
        return {"family": "deepseek", **d}

    def replace(self, **changes) -> "DeepSeekConfig":
        return replace(self, **changes)


# DeepSeek-V3's published config.json (YaRN from 4k to 160k positions)
_V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS = {
    "deepseek-v3": DeepSeekConfig(rope_scaling=_V3_YARN),
    # tests: both attention paths are options (q_lora_rank), 8 experts in 4 groups, a shared expert, one dense layer
    "deepseek-v3-debug": DeepSeekConfig(vocab_size=512, n_positions=128, dim=64, n_layers=3, n_heads=4,
                                        mlp_hidden=96, moe_hidden=32, n_experts=8, n_shared_experts=1,
                                        experts_per_token=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                        v_head_dim=12, rope_scaling={**_V3_YARN, "factor": 4.0,
                                                                     "original_max_position_embeddings": 32}),
}
