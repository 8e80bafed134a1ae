"""Which tensor goes in which file: pure planning from shapes and dtypes.

A :class:`Source` is one fetch (one ``full_tensor`` call on a layer, one
optimizer-state gather, or one tensor read by the converter) yielding one or
more stored tensors: a GPT-2 ``c_attn`` weight is one fetch and one tensor, a
BERT ``qkv`` is one fetch and three (query, key, value). Planning only looks
at ``Source.metas``, fresh meta tensors with the stored shapes and dtypes, so
it never touches data; the split itself is ``huggingface_hub``'s
:func:`split_torch_state_dict_into_shards` (HF's shard names, HF's size units:
"5GB" is 5 * 10**9 bytes, a tensor bigger than the limit gets its own file).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple, Union

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from ..common import sharded_parameters
from .. import hf_io
from ..families import family_of
from .format import CheckpointError

Size = Union[int, str, None]
UNLIMITED = 1 << 62


@dataclass
class Source:
    """Stored tensors ``names`` (shapes/dtypes in ``metas``), produced together by ``fetch()``."""

    names: Tuple[str, ...]
    metas: Tuple[torch.Tensor, ...]
    fetch: Callable[[], Sequence[torch.Tensor]]


@dataclass
class ShardPlan:
    """``files``: file name -> stored names (plan order); one file means no index."""

    files: Dict[str, List[str]]
    weight_map: Dict[str, str]
    total_size: int
    metas: Dict[str, torch.Tensor]

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1


def meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def plan_shards(sources: Sequence[Source], stem: str, max_shard_size: Size) -> ShardPlan:
    """Split ``sources`` into ``{stem}-0000i-of-0000N.safetensors`` files (``{stem}.safetensors`` if one)."""
    metas: Dict[str, torch.Tensor] = {}
    for src in sources:
        for name, m in zip(src.names, src.metas):
            if name in metas:
                raise CheckpointError(f"tensor name {name!r} planned twice")
            metas[name] = m
    limit = UNLIMITED if max_shard_size is None else max_shard_size
    if isinstance(limit, int) and limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {limit}")
    split = split_torch_state_dict_into_shards(metas, filename_pattern=stem + "{suffix}.safetensors",
                                               max_shard_size=limit)
    if not split.filename_to_tensors:  # an empty state (no tensors) is still one (empty) file
        split.filename_to_tensors = {f"{stem}.safetensors": []}
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    weight_map = {n: f for f, names in files.items() for n in names}
    return ShardPlan(files=files, weight_map=weight_map, total_size=int(split.metadata["total_size"]), metas=metas)


# ------------------------------------------------------------------ the model


def hf_prefix(model: torch.nn.Module, family: hf_io.Family) -> str:
    arch = family.architecture_of(model.config)
    return family.base_prefix if family.architectures[arch].get("prefixed", True) else ""


def _fetch_row(row: hf_io.TensorMap, mod, local: str) -> Callable[[], List[torch.Tensor]]:
    def fetch() -> List[torch.Tensor]:
        return [t.detach().cpu().contiguous() for t in row.to_hf(mod.full_tensor(local))]

    return fetch


def model_sources(model: torch.nn.Module) -> List[Source]:
    """One source per zoo parameter, under the HF names of the model's architecture.

    Tied weights are one parameter, hence stored once (GPT-2's LM head is
    ``wte``, BERT's decoder is ``word_embeddings``), as ``save_pretrained`` does.
    """
    family = family_of(model)
    prefix = hf_prefix(model, family)
    params = {name: (mod, local, p) for name, mod, local, p in sharded_parameters(model)}
    sources, covered = [], set()
    for row in family.tensor_maps(model.config):
        if row.zoo not in params:
            continue
        covered.add(row.zoo)
        mod, local, p = params[row.zoo]
        hf_metas = row.to_hf(meta(mod.full_shape(local), p.dtype))
        names = tuple(h if row.top else prefix + h for h in row.hf)
        sources.append(Source(names, tuple(meta(m.shape, m.dtype) for m in hf_metas), _fetch_row(row, mod, local)))
    extra = [n for n in params if n not in covered]
    if extra:
        raise CheckpointError(f"{type(model).__name__}: parameters without a Hugging Face name: {', '.join(extra)}")
    from .quant_sources import nf4_sources  # a QLoRA base's 4-bit layers, in bitsandbytes' keys

    return sources + [Source(*fields) for fields in nf4_sources(model, family, prefix)]
