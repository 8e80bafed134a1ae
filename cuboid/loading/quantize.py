"""``cuboid.load(..., quantize="nf4")``: a 4-bit NF4 base (QLoRA), quantized while it is read.

The model is built on the meta device and cut for the plan as any load; the
linears transformers would quantize (every linear of the blocks; not the
embeddings, norms, LM head, routers or stacked experts) become NF4 layers
(:mod:`cuboid.parallel.quant`) before anything is allocated, so the rest of
the model is read as usual while those weights are not. Each of them is then
read whole from the memory-mapped shards, one tensor at a time, quantized as
one device quantizes it (bitsandbytes' layout, bit for bit) and cut to this
rank's part: the process holds the 4-bit model plus one full-precision
tensor, never the full-precision model. A folder transformers + bitsandbytes
saved in 4 bits (``quantization_config`` in config.json; per weight the keys
``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4``) is
read as it is, without quantizing again, under any plan. A preset is built and initialised
first (a test-sized model) and quantized from its own weights, gathered over
tensor parallelism where they are cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from cuboid.kernels.nf4 import NF4Weight
from cuboid.parallel.quant import (block_linears, check_quantize, check_whole_blocks, quantize_linears,
                                   quantized_layers)

BNB_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4")


def prequantized(cfg: dict, path) -> bool:
    """Whether config.json says transformers + bitsandbytes saved the folder in 4-bit NF4 (other 4-bit and
    8-bit layouts are refused in one sentence)."""
    q = cfg.get("quantization_config")
    if not q or q.get("quant_method") == "mxfp4":  # gpt-oss's experts: dequantized as they load (zoo/llama)
        return False
    if q.get("quant_method") != "bitsandbytes" or not q.get("load_in_4bit"):
        raise ValueError(f"{path}: quantization_config {q.get('quant_method')!r} (4-bit: {q.get('load_in_4bit')}) is "
                         f"not read; cuboid reads bitsandbytes' 4-bit NF4 folders")
    if q.get("bnb_4bit_quant_type", "fp4") != "nf4":
        raise ValueError(f"{path}: bitsandbytes 4-bit type {q.get('bnb_4bit_quant_type')!r} is not read; cuboid "
                         f"reads nf4")
    return True
from cuboid.zoo import hf_io
from cuboid.zoo.families import family_of


def folder_is_4bit(path) -> bool:
    """Whether the folder ``path`` holds a transformers + bitsandbytes 4-bit NF4 model."""
    return prequantized(hf_io.read_config(Path(path)), path)


def _folder_views(model: nn.Module, path: Path) -> dict:
    """zoo name -> lazy view of the stored tensors, for the rows of the model's family (headers only)."""
    from cuboid.zoo.checkpoint.folder import resolve
    from cuboid.zoo.checkpoint.reader import TensorFolder

    folder = TensorFolder(resolve(path), "model")
    family = family_of(model)
    stored = hf_io.normalise_keys(folder.keys(), family)
    views = {}
    for row in family.tensor_maps(model.config):
        if all(h in stored for h in row.hf):
            views[row.zoo] = (row, [stored[h] for h in row.hf], folder)
    return views


def from_folder(path, *, dtype, device, transform, head: Optional[str] = None,
                num_labels: Optional[int] = None, seed: int = 0) -> nn.Module:
    """A folder's model with its blocks' linears in NF4 (the module docstring says how); ``head``,
    ``num_labels``, ``seed``: read under a new classification head, as :func:`cuboid.zoo.from_hf` takes them."""
    from cuboid.zoo.checkpoint.format import CheckpointError
    from cuboid.zoo.checkpoint.reader import read_new
    from cuboid.zoo.heads import folder_config, unexplained

    path = Path(path)
    cfg = hf_io.read_config(path)
    family, config, stored = folder_config(path, head, num_labels)
    with torch.device("meta"):
        model = family.build(config)
    model = transform(model)
    if dtype is not None:
        model.to(dtype)
    paths = quantize_linears(model, block_linears(model))
    problems = read_new(model, path, device=device, strict=False, seed=seed)  # all but the quantized weights
    problems = unexplained(problems, model, family, stored)  # (a new head's tensors: initialised)
    views = _folder_views(model, path)
    names = {f"{p}.weight" for p in paths}
    absent = [n for n in names if n not in views]
    stored4 = prequantized(cfg, path)
    quant_keys = {k + sfx for n in names if n in views for k in views[n][1]
                  for sfx in (("",) + BNB_SUFFIXES if stored4 else ("",))}
    unexpected = [k for k in problems["unexpected"] if k not in quant_keys]
    if problems["missing"] or problems["mismatched"] or unexpected or absent:
        lines = [f"{what}: {', '.join(v)}" for what, v in (("missing", problems["missing"] + absent),
                                                           ("mismatched", problems["mismatched"]),
                                                           ("unexpected", unexpected)) if v]
        raise CheckpointError(f"{path}: checkpoint does not fit the {family.name} model; " + "; ".join(lines))
    for p, layer in quantized_layers(model):
        row, stored, folder = views[f"{p}.weight"]
        if stored4:
            if len(stored) != 1 or row.view is not hf_io._first:
                raise ValueError(f"{path}: {p}.weight is stored as {len(stored)} tensor(s) under a transform; a "
                                 f"4-bit folder is read only where one stored weight is the layer's weight")
            keys = set(folder.keys())
            parts = {f"weight{sfx}": folder.get_tensor(stored[0] + sfx) for sfx in ("",) + BNB_SUFFIXES
                     if stored[0] + sfx in keys}
            layer.set_quantized(_stored_nf4(parts, f"{path}: {stored[0]}").to(device))
            continue
        full = row.view([folder.get_slice(n) for n in stored])[:]  # one tensor, from the mapped file
        layer.set_full(torch.as_tensor(full).to(device=device, dtype=layer.nf4_dtype))
        del full
    return model


def _stored_nf4(parts: dict, where: str) -> NF4Weight:
    """A stored 4-bit weight's tensors (``weight``, ``weight.absmax``, ..., its quant state) as an
    :class:`NF4Weight`; a one-line CheckpointError naming ``where`` (the folder and the tensor) when they are
    damaged or in a layout cuboid's NF4 layers do not hold (a blocksize other than bitsandbytes' default)."""
    from cuboid.kernels.nf4 import BLOCKSIZE
    from cuboid.zoo.checkpoint.format import CheckpointError

    try:
        qw = NF4Weight.from_state_dict(parts, "weight")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        what = f"no {e.args[0]!r} entry" if isinstance(e, KeyError) else " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"{where}: its 4-bit quant state is not readable ({what})") from None
    if qw.blocksize != BLOCKSIZE:
        raise CheckpointError(f"{where}: quantized with blocksize {qw.blocksize}; cuboid's NF4 layers hold "
                              f"bitsandbytes' default blocksize {BLOCKSIZE} only (dequantize the folder, or "
                              f"save it with blocksize {BLOCKSIZE})")
    return qw


def quantize_model(model: nn.Module) -> nn.Module:
    """A materialised model's blocks' linears made NF4 from their own weights (gathered where tensor parallelism
    cuts them: every rank calls in module order)."""
    mods = dict(model.named_modules())
    for p in block_linears(model):
        full = mods[p].full_tensor("weight")
        quantize_linears(model, [p])
        mods[p].set_full(full.to(mods[p].nf4_dtype))
        del full
    return model


@dataclass
class AdaptedBuilder:
    """A model builder (:class:`cuboid.loading.builder.ModelBuilder`: ``builder(plan, mesh)`` is the meta model a
    rank holds) whose meta models carry what ``cuboid.load(..., quantize=, lora=)`` adds: the blocks' linears
    as NF4 layers (shapes only) and LoRA adapters (``lora``: a LoRA spec; with ``quantize`` and no spec,
    cuboid's LoRA defaults). What the planner prices for a QLoRA or LoRA run."""

    base: Any
    quantize: Optional[str] = None
    lora: Any = None

    def __post_init__(self) -> None:
        self.quantize = check_quantize(self.quantize)
        if self.quantize and self.lora is None:  # a 4-bit base trains through adapters only
            self.lora = {}

    @property
    def config(self):
        return self.base.config

    @property
    def name(self) -> str:
        return self.base.name

    def __call__(self, plan, mesh=None) -> nn.Module:
        from cuboid.zoo.lora import attach

        model = self.base(plan, mesh)
        if self.quantize:
            for _, layer in quantized_layers(model) if quantize_linears(model, block_linears(model)) else ():
                check_whole_blocks(layer)  # a tp cut through NF4's blocks: BlockCutError (the load refuses it)
                for name, b in list(layer.named_buffers(recurse=False)):  # shapes only: the adapters follow
                    setattr(layer, name, b.to("meta"))
        if self.lora is not None:
            attach(model, self.lora, seed=0, quiet=True)
        return model
