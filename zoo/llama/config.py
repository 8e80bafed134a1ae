"""Llama-family configuration (Llama 2/3, Qwen2, Mistral) and presets with the published shapes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

ARCHS = ("llama", "qwen2", "mistral")  # the HF model_type an export writes


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
    arch: str = "llama"          # llama | qwen2 | mistral: the HF model_type written on export
    init_std: float = 0.02
    dropout: float = 0.0         # attention output dropout (HF: attention_dropout; 0 in every release)

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
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope_scaling of type {kind!r} is not supported (llama3, default)")

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
        return {"family": "llama", **d}

    def replace(self, **changes) -> "LlamaConfig":
        return replace(self, **changes)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA31 = dict(vocab_size=128256, n_positions=131072, eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)
_QWEN25 = dict(arch="qwen2", attention_bias=True, rope_theta=1000000.0, eps=1e-6)

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
    # v0.3 shapes: no sliding window
    "mistral-7b": LlamaConfig(arch="mistral", vocab_size=32768, n_positions=32768, dim=4096, n_layers=32,
                              n_heads=32, n_kv_heads=8, mlp_hidden=14336, eps=1e-5, rope_theta=1000000.0),
}
