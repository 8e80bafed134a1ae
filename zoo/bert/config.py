"""BERT configuration and presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522      # WordPiece vocabulary
    n_positions: int = 512       # learned position table
    type_vocab_size: int = 2     # token_type_ids range (segment A/B)
    dim: int = 768               # hidden size
    n_layers: int = 12           # transformer blocks (post-LN)
    n_heads: int = 12            # attention heads; dim % n_heads == 0
    mlp_hidden: int = 3072       # intermediate size
    eps: float = 1e-12           # layer-norm epsilon
    dropout: float = 0.0         # hidden dropout (HF default 0.1; 0 keeps runs deterministic)
    head: str = "mlm"            # "mlm" (BertForMaskedLM), "cls" (BertForSequenceClassification), "none" (BertModel)
    num_labels: int = 2          # classes for head="cls"
    pooler: Optional[bool] = None  # tanh pooler on the first token; None: as HF (all heads but "mlm")
    init_std: float = 0.02       # normal init std

    def __post_init__(self) -> None:
        if self.pooler is None:
            object.__setattr__(self, "pooler", self.head != "mlm")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head not in ("mlm", "cls", "none"):
            raise ValueError(f"head must be 'mlm', 'cls' or 'none', got {self.head!r}")
        if self.head == "cls" and not self.pooler:
            raise ValueError("head='cls' classifies the pooled output: it needs pooler=True")
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")

    @property
    def hidden(self) -> int:
        return self.mlp_hidden

    def to_dict(self) -> dict:
        return {"family": "bert", **asdict(self)}

    def replace(self, **changes) -> "BertConfig":
        if "head" in changes and "pooler" not in changes:
            changes["pooler"] = None  # re-derive for the new head
        return replace(self, **changes)


PRESETS = {
    "bert-debug": BertConfig(vocab_size=512, n_positions=128, dim=64, n_layers=2, n_heads=4, mlp_hidden=256),
    "bert-base": BertConfig(),
    "bert-large": BertConfig(dim=1024, n_layers=24, n_heads=16, mlp_hidden=4096),
}
