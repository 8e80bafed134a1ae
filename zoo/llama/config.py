"""Llama-family configuration (Llama 2/3, Qwen2, Mistral, Qwen3, Gemma 3) and presets with the published shapes.

Qwen3 and Gemma 3 are options of the same decoder: per-head q/k norms, sliding-window layers with their own
RoPE base, Gemma's sandwich norms (RMSNorm scaling by ``1 + weight``), scaled embeddings, a GeGLU MLP, a
query scale apart from ``head_dim`` and a final logit softcap.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma3")  # the HF family an export writes
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
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"rope_scaling of type {kind!r} is not supported (llama3, linear, default)")
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
}
