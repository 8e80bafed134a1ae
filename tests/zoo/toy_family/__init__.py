"""A toy model family, as a user or a test adds one: a config, a model, a sharding spec, a shape and a Hugging
Face mapping in one folder, registered with one call (:func:`register`, ``cuboid.zoo.register_family``).

The model is a small pre-norm decoder (learned positions, the zoo's shared block, RMS-free LayerNorms, an LM
head of its own, not tied), saved as a made-up ``ToyForCausalLM`` architecture."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.cost.shape import Shape
from cuboid.parallel.spec import ShardingSpec
from cuboid.zoo.common import Block, Decoder, Output, attention_mask_of, count_targets, init_parameters, lm_output
from cuboid.zoo.hf_io import Family, TensorMap


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 96         # tokens
    n_positions: int = 32        # longest sequence
    dim: int = 32                # hidden size
    n_layers: int = 2            # blocks
    n_heads: int = 4             # attention heads
    eps: float = 1e-5            # layer-norm epsilon
    head: str = "lm"             # the one head: a causal LM
    pad_token_id: Optional[int] = None

    @property
    def hidden(self) -> int:
        return 4 * self.dim

    def to_dict(self) -> dict:
        return {"family": "toy", **asdict(self)}

    def replace(self, **changes) -> "ToyConfig":
        return replace(self, **changes)


class ToyLM(Decoder):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_emb = L.Embedding(c.vocab_size, c.dim)
        self.pos_emb = L.Embedding(c.n_positions, c.dim)
        self.blocks = nn.ModuleList(Block(c.dim, c.n_heads, c.hidden, eps=c.eps, pre_ln=True, causal=True)
                                    for _ in range(c.n_layers))
        self.ln_f = L.LayerNorm(c.dim, c.eps)
        self.lm_head = L.Embedding(c.vocab_size, c.dim)  # untied: a table of its own, read as the LM head

    def num_targets(self, batch: dict) -> int:
        return count_targets(batch.get("labels"), shift=True)

    def init_weights(self, seed: int = 0) -> None:
        def rule(name: str, shape: torch.Size):
            if name.endswith("bias"):
                return "zeros", 0.0
            if ".ln" in name or name.startswith("ln"):
                return "ones", 0.0
            return "normal", 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith("proj.weight") else 0.02

        init_parameters(self, rule, seed)

    def embed(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.tok_emb(input_ids) + self.pos_emb(position_ids)  # (B, T, C)

    def last_tokens(self, input_ids: torch.Tensor) -> None:
        return None

    def head(self, x, residual, labels=None, last=None, logprobs: bool = False) -> Output:
        h, _ = self.ln_f(x, residual) if residual is not None else (self.ln_f(x), None)
        return lm_output(self.lm_head, h, labels, logprobs)

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, logprobs: bool = False):
        no_loss = logprobs and labels is None
        labels = input_ids if no_loss else labels
        x = self.embed(input_ids, position_ids)
        mask = attention_mask_of(input_ids, attention_mask, position_ids)
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, mask)
        out = self.head(x, residual, labels, logprobs=logprobs)
        if no_loss:
            out.loss = None
        return out


SPEC = ShardingSpec(roles={"tok_emb": "vocab", "pos_emb": "embedding", "ln_f": "norm", "lm_head": "vocab",
                           "blocks.*.attn.qkv": "column_qkv", "blocks.*.attn.proj": "row",
                           "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row",
                           "blocks.*.ln1": "norm", "blocks.*.ln2": "norm"},
                    first=("tok_emb", "pos_emb"), last=("ln_f", "lm_head"), shifted_labels=True)


def shape(c: ToyConfig) -> Shape:
    with torch.device("meta"):
        total = sum(p.numel() for p in ToyLM(c).parameters())
    return Shape(c.n_layers, c.dim, c.n_heads, c.hidden, c.vocab_size, c.n_positions, tied_head=False,
                 parameters=total, active_parameters=total)


def config_from_hf(d: dict, arch: str) -> ToyConfig:
    return ToyConfig(vocab_size=d["vocab_size"], n_positions=d["n_positions"], dim=d["dim"], n_layers=d["n_layers"],
                     n_heads=d["n_heads"], eps=d["eps"], pad_token_id=d.get("pad_token_id"))


def config_to_hf(c: ToyConfig) -> dict:
    return {"model_type": "toy", "vocab_size": c.vocab_size, "n_positions": c.n_positions, "dim": c.dim,
            "n_layers": c.n_layers, "n_heads": c.n_heads, "eps": c.eps, "pad_token_id": c.pad_token_id}


def tensor_maps(c: ToyConfig) -> list:
    names = ["tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"]
    for i in range(c.n_layers):
        names += [f"blocks.{i}.{m}.{w}" for m in ("ln1", "ln2", "attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
                  for w in ("weight", "bias")]
    return [TensorMap(n, (n,), top=True) for n in names]  # stored under the zoo's own names


HF = Family(name="toy", architectures={"ToyForCausalLM": {"head": "lm"}}, base_prefix="",
            config_from_hf=config_from_hf, config_to_hf=config_to_hf, architecture_of=lambda c: "ToyForCausalLM",
            tensor_maps=tensor_maps, build=ToyLM)


def record():
    from cuboid.zoo import FamilyRecord

    return FamilyRecord("toy", ToyConfig, ToyLM, {"toy-debug": ToyConfig()}, SPEC, shape, HF)


def register() -> None:
    """The one call that adds the family (once per process)."""
    from cuboid import zoo
    from cuboid.zoo import registry

    if "toy" not in registry.RECORDS:
        zoo.register_family(record())
