"""The 4-bit NF4 layers of a QLoRA model (:mod:`cuboid.parallel.quant`) in a Hugging Face folder, as
transformers + bitsandbytes save them: per weight the keys ``weight`` (packed codes), ``weight.absmax``,
``weight.quant_map``, ``weight.nested_absmax``, ``weight.nested_quant_map`` and
``weight.quant_state.bitsandbytes__nf4``, and ``quantization_config`` in config.json.

Written from any plan: under dp / ZeRO / pp every rank holds whole NF4 layers; under 1D tensor parallelism
each layer's codes and one device's scale codes are gathered from its ranks' slices (each keeps the whole
weight's second level of the double quantization), so the folder is the one-device folder bit for bit
(:func:`cuboid.parallel.quant.gathered_nf4`).
"""
from __future__ import annotations

from typing import List

import torch

from .format import CheckpointError


def nf4_sources(model: torch.nn.Module, family, prefix: str) -> List[tuple]:
    """(names, metas, fetch) of each NF4 layer (all its bitsandbytes keys, under the HF name of its weight row):
    the fields of a :class:`~.shards.Source`."""
    from cuboid.parallel.quant import gathered_nf4, gathered_nf4_meta, quantized_layers

    layers = dict(quantized_layers(model))
    if not layers:
        return []
    rows = {row.zoo: row for row in family.tensor_maps(model.config)}
    sources = []
    for path, layer in layers.items():
        row = rows.get(f"{path}.weight")
        if row is None or len(row.hf) != 1:
            raise CheckpointError(f"{path}: a 4-bit layer is written only where one stored weight is the layer's")
        name = row.hf[0] if row.top else prefix + row.hf[0]
        state = gathered_nf4_meta(layer).state_dict(name)
        keys = tuple(state)
        metas = tuple(torch.empty(v.shape, dtype=v.dtype, device="meta") for v in state.values())
        sources.append((keys, metas, lambda layer=layer, name=name: [
            t.detach().cpu().contiguous() for t in gathered_nf4(layer).state_dict(name).values()]))
    return sources


def quantization_config(model: torch.nn.Module):
    """transformers' ``quantization_config`` for a model with NF4 layers (None without)."""
    from cuboid.parallel.quant import gathered_nf4_meta, quantized_layers

    layers = quantized_layers(model)
    if not layers:
        return None
    compute = str(layers[0][1].nf4_dtype).replace("torch.", "")
    return {"_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute,
            "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": gathered_nf4_meta(layers[0][1]).double_quant,
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0, "load_in_4bit": True, "load_in_8bit": False,
            "quant_method": "bitsandbytes"}
