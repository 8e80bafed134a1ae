"""GPT-2 configuration and presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257      # GPT-2 BPE vocabulary
    n_positions: int = 1024      # longest sequence (learned position table)
    dim: int = 768               # hidden size
    n_layers: int = 12           # transformer blocks
    n_heads: int = 12            # attention heads; dim % n_heads == 0
    mlp_hidden: int = 0          # MLP width; 0 means 4 * dim
    eps: float = 1e-5            # layer-norm epsilon
    dropout: float = 0.0         # residual/embedding/attention-output dropout
    activation: str = "gelu_new" # "gelu_new" (tanh approximation, GPT-2) or "gelu"
    head: str = "lm"             # "lm": tied LM head (GPT2LMHeadModel), "cls" (GPT2ForSequenceClassification), "none"
    num_labels: int = 2          # classes (outputs) for head="cls"
    pad_token_id: Optional[int] = None  # head="cls" pools each row's last token that is not this id
    init_std: float = 0.02       # normal init std; residual projections scaled by 1/sqrt(2 n_layers)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head not in ("lm", "cls", "none"):
            raise ValueError(f"head must be 'lm', 'cls' or 'none', got {self.head!r}")
        if self.activation not in ("gelu_new", "gelu"):
            raise ValueError(f"activation must be 'gelu_new' or 'gelu', got {self.activation!r}")

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 4 * self.dim

    def to_dict(self) -> dict:
        return {"family": "gpt", **asdict(self)}

    def replace(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


PRESETS = {
    "gpt-debug": GPTConfig(vocab_size=512, n_positions=128, dim=64, n_layers=2, n_heads=4),
    "gpt2": GPTConfig(),
    "gpt2-medium": GPTConfig(dim=1024, n_layers=24, n_heads=16),
    "gpt2-large": GPTConfig(dim=1280, n_layers=36, n_heads=20),
    "gpt2-xl": GPTConfig(dim=1600, n_layers=48, n_heads=25),
}
