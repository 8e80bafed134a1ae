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

from cuboid.zoo.llama.gpt_oss import interleave

from ..families import family_of
from .shards import hf_prefix

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# the 4-bit base the adapters were trained on (QLoRA): transformers' BitsAndBytesConfig as a dict, beside
# peft's config (which has no such field; an unknown key there makes peft warn)
BASE_QUANTIZATION = "base_quantization_config.json"


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (``cuboid.zoo.lora.attach``): read off its config ``model.lora``,
    the same on every rank, not off the layers this rank holds (a pipeline stage may hold no adapted layer,
    an experts-only adapter leaves every linear plain)."""
    return getattr(model, "lora", None) is not None


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
    adapter's shard group (and ZeRO-3's dp group, and ``ep`` for the experts'): every rank of the model
    calls it."""
    zero.reshard(model)
    rows, out = hf_modules(model), {}
    for path, base in plora.adapted(model):
        mods = rows[f"{path}.weight"]
        a = base.lora_A.full_tensor("weight").detach().cpu()
        b = base.lora_B.full_tensor("weight").detach().cpu()
        for m, bm in zip(mods, b.chunk(len(mods), 0)):
            out[f"{PEFT_PREFIX}{m}.lora_A.weight"] = a.contiguous().clone()
            out[f"{PEFT_PREFIX}{m}.lora_B.weight"] = bm.contiguous().clone()
    for path, experts in plora.adapted_experts(model):
        for name in experts.lora_weights:
            a = experts.full_tensor(f"lora_{name}_A").detach().cpu()  # (E, r, in)
            b = experts.full_tensor(f"lora_{name}_B").detach().cpu()  # (E, out, r)
            key = PEFT_PREFIX + expert_adapter_name(model, path, name, experts.lora_weights)
            if interleaved_gate_up(model, name):
                b = interleave(b, 1)
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = expert_to_peft(a, b)
    return out


# peft's names of transformers' stacked expert weights (Qwen3-MoE, Mixtral, OLMoE: model.layers.N.mlp.experts)
PEFT_EXPERT_WEIGHTS = {"gate_up": "gate_up_proj", "down": "down_proj"}


def expert_module(model: nn.Module, path: str) -> str:
    """The transformers module of the experts layer at zoo ``path`` (``blocks.N.mlp.experts``)."""
    prefix = hf_prefix(model, family_of(model))
    block = path.split(".")[1]
    return f"{prefix}layers.{block}.mlp.experts"


def expert_adapter_name(model: nn.Module, path: str, name: str, names) -> str:
    """peft's module name (without its ``base_model.model.`` prefix) of the adapter on the stacked weight
    ``name`` of the experts at ``path``, ``names`` being every adapted weight of that layer: peft wraps each
    targeted parameter around the previous one in the module's order, so all but the last sit under
    ``base_layer.`` once per later wrapper."""
    names = [n for n in plora.EXPERT_WEIGHTS if n in names]
    return expert_module(model, path) + ".base_layer" * (len(names) - 1 - names.index(name))


def interleaved_gate_up(model: nn.Module, name: str) -> bool:
    """Whether transformers interleaves the output rows of the experts' weight ``name`` (gpt-oss's gate_up_proj:
    gate at even columns), so that its lora_B rows are stored interleaved
    (:func:`~cuboid.zoo.llama.gpt_oss.interleave`)."""
    return name == "gate_up" and getattr(model.config, "arch", None) == "gpt_oss"


def expert_to_peft(a, b) -> tuple:
    """Stacked adapters A (E, r, in), B (E, out, r) as peft's ParamWrapper stores them: lora_A (E r, in)
    expert-major, lora_B (out, r E) rank-major (its ``reshape(out, r, E)``)."""
    e, r, _ = a.shape
    return a.reshape(e * r, -1).contiguous().clone(), b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()


def expert_from_peft(a, b, experts: int) -> tuple:
    """:func:`expert_to_peft`'s inverse: (A (E, r, in), B (E, out, r))."""
    r = a.shape[0] // experts
    return a.reshape(experts, r, a.shape[1]), b.reshape(b.shape[0], r, experts).permute(2, 0, 1).contiguous()


def adapter_config(model: nn.Module, modules, base: Optional[str] = None) -> dict:
    """peft's ``adapter_config.json`` for ``model``'s adapters on the HF ``modules``; adapters on the stacked
    experts (``model.lora_experts``: the weights adapted, the same on every rank) as ``target_parameters``."""
    conf = model.lora
    family = family_of(model)
    head = getattr(model.config, "head", None)
    experts = [f"mlp.experts.{PEFT_EXPERT_WEIGHTS[n]}" for n in model.lora_experts]
    return ({"target_parameters": experts} if experts else {}) | {
            "peft_type": "LORA", "task_type": "CAUSAL_LM" if head == "lm" else None, "r": conf.r,
            "lora_alpha": conf.alpha, "lora_dropout": conf.dropout, "target_modules": sorted(modules),
            "fan_in_fan_out": family.name == "gpt", "bias": "none", "base_model_name_or_path": base,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None}


def base_quantization(model: nn.Module) -> Optional[dict]:
    """What the adapters' base was quantized to, when its linears are NF4 (a QLoRA model; None otherwise), as
    transformers' ``BitsAndBytesConfig(...).to_dict()`` spells it (``BitsAndBytesConfig.from_dict`` reads it):
    4-bit NF4 in blocks of 64, double quantization as the layers hold it, the dtype the weights were read in
    (what they dequantize to)."""
    from cuboid.parallel.quant import quantized_layers

    from cuboid.kernels.nf4 import BLOCKSIZE  # the NF4 layers' values per scale

    layers = [layer for _, layer in quantized_layers(model)]
    if not layers:
        return None
    layer = layers[0]
    double = layer.weight_nested_absmax.numel() > 0 or layer.weight_absmax_codes.numel() > 0
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": bool(double),
            "bnb_4bit_compute_dtype": str(layer.nf4_dtype).removeprefix("torch."),
            "bnb_4bit_quant_storage": "uint8", "blocksize": BLOCKSIZE}


def recorded_quantization(folder) -> Optional[dict]:
    """The base quantization an adapter folder records (:data:`BASE_QUANTIZATION`), read as data; None when it
    records none. A file that is not a JSON object naming bitsandbytes' 4-bit NF4 is refused in one sentence."""
    from pathlib import Path

    from .format import CheckpointError, parse_json

    file = Path(folder) / BASE_QUANTIZATION
    if not file.is_file():
        return None
    record = parse_json(file.read_bytes(), file)
    if not isinstance(record, dict) or record.get("quant_method") != "bitsandbytes" \
            or record.get("bnb_4bit_quant_type") != "nf4" or not record.get("load_in_4bit"):
        raise CheckpointError(f"{file}: not a record of a bitsandbytes 4-bit NF4 base (quant_method "
                              f"{record.get('quant_method') if isinstance(record, dict) else None!r})")
    return record
