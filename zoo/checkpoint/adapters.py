"""LoRA adapters in ``peft``'s layout: their names, tensors and config (``cuboid.zoo.lora`` reads them back).

``adapter_config.json`` + ``adapter_model.safetensors`` under peft's names for
the model's Hugging Face architecture (``base_model.model.<HF module>.lora_A.weight``),
so ``peft.PeftModel.from_pretrained(base, folder)`` loads them. A fused qkv
(BERT, ViT, whose HF layers are separate query/key/value) is saved as three
peft adapters sharing A, B cut in three, which is the same update; GPT-2's
Conv1D layers are saved with ``fan_in_fan_out`` as peft expects.

:mod:`.lora_state` writes them (``save_adapters``: the folder peft loads, under a
commit file, what ``checkpoint.save`` writes for a LoRA model), while
:mod:`cuboid.zoo.lora` (targets, attach, load, merge, training checkpoints)
builds on both.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from cuboid.parallel import lora as plora
from cuboid.parallel import zero

from ..families import family_of
from .shards import hf_prefix

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def hf_modules(model: nn.Module) -> dict:
    """zoo weight name -> (HF module names, in the row's order) for the model's architecture."""
    family = family_of(model)
    prefix = hf_prefix(model, family)
    out = {}
    for row in family.tensor_maps(model.config):
        out[row.zoo] = [(h if row.top else prefix + h)[:-len(".weight")] for h in row.hf]
    return out


def adapter_state(model: nn.Module) -> dict:
    """peft name -> full adapter tensor (CPU) of every adapter this rank holds. A collective over each
    adapter's shard group (and ZeRO-3's dp group): every rank of the model calls it."""
    zero.reshard(model)
    rows, out = hf_modules(model), {}
    for path, base in plora.adapted(model):
        mods = rows[f"{path}.weight"]
        a = base.lora_A.full_tensor("weight").detach().cpu()
        b = base.lora_B.full_tensor("weight").detach().cpu()
        for m, bm in zip(mods, b.chunk(len(mods), 0)):
            out[f"{PEFT_PREFIX}{m}.lora_A.weight"] = a.contiguous().clone()
            out[f"{PEFT_PREFIX}{m}.lora_B.weight"] = bm.contiguous().clone()
    return out


def adapter_config(model: nn.Module, modules, base: Optional[str] = None) -> dict:
    conf = model.lora
    family = family_of(model)
    head = getattr(model.config, "head", None)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM" if head == "lm" else None, "r": conf.r,
            "lora_alpha": conf.alpha, "lora_dropout": conf.dropout, "target_modules": sorted(modules),
            "fan_in_fan_out": family.name == "gpt", "bias": "none", "base_model_name_or_path": base,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None}
