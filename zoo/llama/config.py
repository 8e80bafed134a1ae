"""Llama-family configuration (Llama 2/3, Qwen2, Mistral, Qwen3, Gemma 3, Qwen3-MoE, Mixtral, OLMoE, gpt-oss) and
presets with the published shapes.

Qwen3 and Gemma 3 are options of the same decoder: per-head q/k norms, sliding-window layers with their own
RoPE base, Gemma's sandwich norms (RMSNorm scaling by ``1 + weight``), scaled embeddings, a GeGLU MLP, a
query scale apart from ``head_dim`` and a final logit softcap. The mixture-of-experts families are too: a layer
is sparse (a router and ``n_experts`` gated MLPs, ``experts_per_token`` of them per token) where
:meth:`LlamaConfig.is_sparse` says, and OLMoE's q/k norms span every head's features (``qk_norm_width="full"``).
gpt-oss (``arch="gpt_oss"``) adds a learned sink logit per head (``attn_sinks``), a biased output projection
(``o_bias``), YaRN RoPE, and experts with biases, a biased router whose top-k logits are softmaxed,
and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``): zoo/llama/gpt_oss.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

# the HF family written
ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types entries
ACTS = ("silu", "gelu_tanh")  # the gated MLP's activation: SwiGLU, or GeGLU (gelu_pytorch_tanh)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    n_positions: int = 4096      # max_position_embeddings (RoPE has no table; the longest sequence accepted)
    dim: int = 4096              # hidden size
    n_layers: int = 32
    n_heads: int = 32            # query heads
    n_kv_heads: int = 0          # key/value heads (grouped-query attention); 0: n_heads
    mlp_hidden: int = 11008      # SwiGLU width (intermediate_size)
    head_dim: int = 0            # 0: dim // n_heads
    eps: float = 1e-6            # RMSNorm epsilon
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple] = None  # sorted (key, value) pairs of HF's rope_scaling (type "llama3"), or None
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    mlp_bias: bool = False
    tie_embeddings: bool = False  # the LM head is the token embedding
    head: str = "lm"             # "lm" (*ForCausalLM), "cls" (*ForSequenceClassification), "none" (*Model)
    num_labels: int = 2          # classes for head="cls"
    pad_token_id: Optional[int] = None  # head="cls" pools each row's last token that is not this id
    arch: str = "llama"          # llama | qwen2 | mistral | qwen3 | gemma3: the HF family written on export
    init_std: float = 0.02
    dropout: float = 0.0         # attention output dropout (HF: attention_dropout; 0 in every release)
    qk_norm: bool = False        # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    sliding_window: Optional[int] = None  # keys a sliding layer's query sees, itself included (None: no window)
    layer_types: Optional[tuple] = None   # per layer SLIDING or FULL; None: every layer SLIDING when there is a window
    rope_local_theta: Optional[float] = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_theta
    act: str = "silu"            # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    gemma_norms: bool = False    # Gemma: every RMSNorm scales by 1 + weight in fp32, and norms after attention and MLP
    embed_scale: bool = False    # token embeddings times sqrt(dim), rounded to their dtype (Gemma)
    query_scale: Optional[float] = None  # attention scores scaled by query_scale ** -0.5 (Gemma's query_pre_attn_scalar); None: head_dim
    logit_softcap: Optional[float] = None  # LM logits cap * tanh(logits / cap) (HF final_logit_softcapping)
    # mixture of experts (HF num_experts / num_local_experts, num_experts_per_tok, moe_intermediate_size, ...)
    n_experts: int = 0           # experts of a sparse layer; 0: every layer dense
    experts_per_token: int = 2   # top-k experts each token is sent to
    moe_hidden: int = 0          # each expert's gated-MLP width; 0: mlp_hidden (Mixtral)
    norm_topk_prob: bool = True  # the k routing weights divided by their sum
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in `loss`
    output_router_logits: bool = False   # as HF: the load-balancing loss joins `loss` only when true
    sparse_step: int = 1         # every sparse_step-th layer is sparse (HF decoder_sparse_step)
    mlp_only_layers: tuple = ()  # layers kept dense whatever sparse_step says
    qk_norm_width: str = "head"  # q/k norm over each head ("head": Qwen3) or over all heads' features ("full": OLMoE)
    # gpt-oss (arch "gpt_oss": its biased router and experts)
    attn_sinks: bool = False     # a learned logit per query head joining each softmax's denominator (HF sinks)
    o_bias: bool = False         # the attention output projection's bias (gpt-oss's o_proj)
    swiglu_alpha: float = 1.702  # the experts' clamped SwiGLU: (up + 1) * gate * sigmoid(alpha * gate) ...
    swiglu_limit: float = 7.0    # ... gate clamped above at limit, up to [-limit, limit]

    def __post_init__(self) -> None:
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head not in ("lm", "cls", "none"):
            raise ValueError(f"head must be 'lm', 'cls' or 'none', got {self.head!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if isinstance(self.rope_scaling, dict):  # frozen and hashable: kept as sorted pairs
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in ("llama3", "linear", "yarn", "default"):
                raise ValueError(f"rope_scaling of type {kind!r} is not supported (llama3, linear, yarn, default)")
        self._check_layers()

    def _check_layers(self) -> None:
        """The sliding-window and Gemma fields: types per layer, a positive window, a known activation."""
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of the {self.n_layers} "
                                 f"layers, got {self.layer_types}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.act not in ACTS:
            raise ValueError(f"act must be one of {', '.join(ACTS)}, got {self.act!r}")
        self._check_experts()

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: a top-k within the experts, a positive step, known layers."""
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(self.mlp_only_layers)))
        if self.qk_norm_width not in ("head", "full"):
            raise ValueError(f"qk_norm_width must be 'head' or 'full', got {self.qk_norm_width!r}")
        if self.arch == "gpt_oss" and not self.n_experts:
            raise ValueError("a gpt_oss config has experts on every layer (n_experts > 0)")
        if not self.n_experts:
            return
        if self.n_experts < 0 or not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token must be between 1 and n_experts {self.n_experts}, got "
                             f"{self.experts_per_token}")
        if self.sparse_step < 1:
            raise ValueError(f"sparse_step must be a positive int, got {self.sparse_step}")
        if any(not 0 <= i < self.n_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must be layer indices below n_layers {self.n_layers}, got "
                             f"{self.mlp_only_layers}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (HF Qwen3-MoE's rule, every layer for Mixtral
        and OLMoE, whose sparse_step is 1)."""
        return bool(self.n_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    @property
    def sparse_layers(self) -> tuple:
        """Indices of the sparse layers."""
        return tuple(i for i in range(self.n_layers) if self.is_sparse(i))

    @property
    def expert_hidden(self) -> int:
        """Each expert's gated-MLP width."""
        return self.moe_hidden or self.mlp_hidden

    @property
    def inactive_parameters(self) -> int:
        """Expert parameters a token does not use: ``(n_experts - experts_per_token)`` experts of every sparse
        layer (active parameters = total - this)."""
        biases = 2 * self.expert_hidden + self.dim if self.arch == "gpt_oss" else 0  # gpt-oss's experts have biases
        per_expert = 3 * self.dim * self.expert_hidden + biases
        return len(self.sparse_layers) * (self.n_experts - self.experts_per_token) * per_expert

    def window_of(self, layer: int) -> Optional[int]:
        """The window of layer ``layer``'s attention: ``sliding_window`` on a sliding layer, else None."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] != SLIDING):
            return None
        return self.sliding_window

    @property
    def hidden(self) -> int:
        return self.mlp_hidden

    @property
    def rope(self) -> Optional[dict]:
        """``rope_scaling`` as HF's dict (None: plain RoPE)."""
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = self.rope
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return {"family": "llama", **d}

    def replace(self, **changes) -> "LlamaConfig":
        return replace(self, **changes)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA31 = dict(vocab_size=128256, n_positions=131072, eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)
_QWEN25 = dict(arch="qwen2", attention_bias=True, rope_theta=1000000.0, eps=1e-6)
_QWEN3 = dict(arch="qwen3", qk_norm=True, vocab_size=151936, n_positions=40960, rope_theta=1000000.0, head_dim=128)
# Gemma 3: five sliding layers to one global layer, local RoPE base 10k, GeGLU, sandwich norms, scaled embeddings
_GEMMA3 = dict(arch="gemma3", qk_norm=True, act="gelu_tanh", gemma_norms=True, embed_scale=True, tie_embeddings=True,
               head_dim=256, query_scale=256.0, rope_theta=1000000.0, rope_local_theta=10000.0, vocab_size=262144)


def gemma3_layers(n_layers: int, every: int = 6) -> tuple:
    """Gemma 3's layer types: every ``every``-th layer global, the others sliding (HF's sliding_window_pattern)."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers))


_MOE_DEBUG = dict(vocab_size=512, n_positions=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=160,
                  n_experts=8, experts_per_token=2, moe_hidden=32)
_QWEN3_MOE = dict(arch="qwen3_moe", qk_norm=True, rope_theta=1000000.0, norm_topk_prob=True, router_aux_loss_coef=0.001)
_MIXTRAL = dict(arch="mixtral", eps=1e-5, rope_theta=1000000.0, norm_topk_prob=True, router_aux_loss_coef=0.02)
_OLMOE = dict(arch="olmoe", qk_norm=True, qk_norm_width="full", eps=1e-5, norm_topk_prob=False,
              router_aux_loss_coef=0.01)

def gpt_oss_layers(n_layers: int) -> tuple:
    """gpt-oss's layer types: sliding and full alternating, the first sliding (HF GptOssConfig's default)."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n_layers))


# gpt-oss: biased q/k/v/o, sinks, YaRN (factor 32 over 4096 positions), windows of 128 on every other layer;
# the released config.json's values (transformers' GptOssConfig defaults are the 120b's)
_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GPT_OSS = dict(arch="gpt_oss", attention_bias=True, o_bias=True, attn_sinks=True, eps=1e-5, rope_theta=150000.0,
                rope_scaling=_GPT_OSS_YARN, vocab_size=201088, n_positions=131072, dim=2880, mlp_hidden=2880,
                head_dim=64, n_heads=64, n_kv_heads=8, sliding_window=128, experts_per_token=4)

PRESETS = {
    "llama-debug": LlamaConfig(vocab_size=512, n_positions=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               mlp_hidden=160),
    "llama3.2-1b": LlamaConfig(**{**_LLAMA31, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}}, dim=2048,
                               n_layers=16, n_heads=32, n_kv_heads=8, mlp_hidden=8192, tie_embeddings=True),
    "llama3.1-8b": LlamaConfig(**_LLAMA31, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_hidden=14336),
    "llama3.1-70b": LlamaConfig(**_LLAMA31, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_hidden=28672),
    "qwen2.5-0.5b": LlamaConfig(**_QWEN25, vocab_size=151936, n_positions=32768, dim=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, mlp_hidden=4864, tie_embeddings=True),
    "qwen2.5-7b": LlamaConfig(**_QWEN25, vocab_size=152064, n_positions=131072, dim=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, mlp_hidden=18944),
    "qwen3-debug": LlamaConfig(arch="qwen3", qk_norm=True, vocab_size=512, n_positions=128, dim=64, n_layers=2,
                               n_heads=4, n_kv_heads=2, head_dim=24, mlp_hidden=160),
    "gemma3-debug": LlamaConfig(**{**_GEMMA3, "vocab_size": 512, "head_dim": 32, "query_scale": 24.0}, n_positions=128,
                                dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=160, sliding_window=8,
                                layer_types=gemma3_layers(2, 2)),
    "qwen3-0.6b": LlamaConfig(**_QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, mlp_hidden=3072,
                              tie_embeddings=True),
    "qwen3-8b": LlamaConfig(**_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, mlp_hidden=12288),
    "gemma-3-1b": LlamaConfig(**_GEMMA3, n_positions=32768, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                              mlp_hidden=6912, sliding_window=512, layer_types=gemma3_layers(26)),
    # v0.3 shapes: no sliding window
    "mistral-7b": LlamaConfig(arch="mistral", vocab_size=32768, n_positions=32768, dim=4096, n_layers=32,
                              n_heads=32, n_kv_heads=8, mlp_hidden=14336, eps=1e-5, rope_theta=1000000.0),
    # mixtures of experts (tiny ones for tests: 8 experts, top 2, width 32; the first Qwen3-MoE layer dense).
    # Mixtral and OLMoE have no dense layer: their experts' width is HF's intermediate_size (mlp_hidden)
    "qwen3-moe-debug": LlamaConfig(**_QWEN3_MOE, **_MOE_DEBUG, head_dim=24, mlp_only_layers=(0,)),
    "mixtral-debug": LlamaConfig(**{**_MOE_DEBUG, "moe_hidden": 0, "mlp_hidden": 32}, **_MIXTRAL),
    "olmoe-debug": LlamaConfig(**{**_MOE_DEBUG, "moe_hidden": 0, "mlp_hidden": 32}, **_OLMOE),
    "qwen3-30b-a3b": LlamaConfig(**_QWEN3_MOE, vocab_size=151936, n_positions=40960, dim=2048, n_layers=48,
                                 n_heads=32, n_kv_heads=4, head_dim=128, mlp_hidden=6144, n_experts=128,
                                 experts_per_token=8, moe_hidden=768),
    "mixtral-8x7b": LlamaConfig(**_MIXTRAL, vocab_size=32000, n_positions=32768, dim=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, mlp_hidden=14336, n_experts=8, experts_per_token=2),
    # a tiny gpt-oss for tests: 4 layers (sliding, full, ...) with windows of 4, 4 experts of width 32, top 2
    "gpt-oss-debug": LlamaConfig(**{**_GPT_OSS, "vocab_size": 512, "n_positions": 128, "dim": 64, "mlp_hidden": 32,
                                    "head_dim": 16, "n_heads": 4, "n_kv_heads": 2, "sliding_window": 4,
                                    "experts_per_token": 2, "rope_scaling": {**_GPT_OSS_YARN, "factor": 4.0,
                                                                             "original_max_position_embeddings": 32}},
                                 n_layers=4, n_experts=4, layer_types=gpt_oss_layers(4)),
    "gpt-oss-20b": LlamaConfig(**_GPT_OSS, n_layers=24, n_experts=32, layer_types=gpt_oss_layers(24)),
    "gpt-oss-120b": LlamaConfig(**_GPT_OSS, n_layers=36, n_experts=128, layer_types=gpt_oss_layers(36)),
    "olmoe-1b-7b": LlamaConfig(**_OLMOE, vocab_size=50304, n_positions=4096, dim=2048, n_layers=16, n_heads=16,
                               n_kv_heads=16, mlp_hidden=1024, n_experts=64, experts_per_token=8),
}
