"""A model's sharding spec: what each layer *is* (module path patterns -> role), and where it repeats.

The spec is data the zoo writes once per family; :func:`~cuboid.parallel.shard`
reads the roles, and activation recompute, sequence splits and pipeline
stages read ``blocks``, ``first`` and ``last``.
"""
from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn


@dataclass(frozen=True)
class ShardingSpec:
    """What each layer of a model *is*: module path patterns -> role.

    ``roles`` maps glob patterns (``blocks.*.attn.qkv``) to ``column``,
    ``column_qkv``, ``column_kv`` (grouped key/value heads), ``row``,
    ``vocab``, ``embedding``, ``norm`` or ``replicate``; the tensor
    modes decide what a role means on their grid. ``blocks`` names the
    repeated blocks (activation recompute and pipeline stages cut there);
    ``first`` and ``last`` name the modules of the pipeline's ends.
    """

    roles: dict = field(default_factory=dict)
    blocks: str = "blocks"
    shifted_labels: bool = False  # token t's label is token t + 1 (a causal LM head shifts): sp aligns them
    pooled_first: bool = False    # the head reads position 0 (a pooler): sp gives every rank the true first token
    # the head reads each row's last token that is not padding (a decoder's classifier): the (B,) indices
    # ``model.last_tokens(input_ids)`` go to ``model.head(..., last=)``; sp gathers the rows for it, pp carries them
    pooled_last: bool = False
    per_token: bool = True  # the head's logits have one row per token (LM, MLM, a backbone), not one per example
    first: tuple = ()   # top-level modules the first pipeline stage owns (embeddings)
    last: tuple = ()    # those the last stage owns (final norm, pooler, heads); a module in both is tied

    def role_of(self, path: str) -> Optional[str]:
        """The role of the first pattern (in ``roles``' order) that ``path`` matches, as ``fnmatchcase``; None."""
        return _role_table(tuple(self.roles.items()))(path)

    def apply_roles(self, model: nn.Module) -> None:
        """Set ``role`` on every cuboid layer the spec names."""
        for path, mod in model.named_modules():
            role = self.role_of(path)
            if role is not None and hasattr(mod, "role"):
                mod.role = role


@functools.lru_cache(maxsize=64)
def _role_table(roles: tuple):
    """``path -> role`` for the ``(pattern, role)`` pairs ``roles``: the patterns compiled once and every path's
    answer kept (a load asks for each module's role several times, and the specs are a few fixed tables)."""
    matchers = [(re.compile(fnmatch.translate(pattern)).match, role) for pattern, role in roles]
    known: dict = {}

    def role_of(path: str) -> Optional[str]:
        if path not in known:
            known[path] = next((role for match, role in matchers if match(path)), None)
        return known[path]

    return role_of


def blocks_of(spec: Optional[ShardingSpec]) -> str:
    """The name of the repeated blocks: the spec's, or ``blocks`` for a model without a spec."""
    return spec.blocks if spec is not None else "blocks"
