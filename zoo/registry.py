"""The zoo's families, one record each, in one registry.

A :class:`FamilyRecord` says everything the rest of cuboid needs of a family: its config and model classes,
its presets, its sharding spec, the shape the cost model reads, its Hugging Face mapping, and its training
hooks (``after_step``: what the family does after each optimizer step, such as DeepSeek-V3's routing-bias
update). :func:`register` files a record in the tables below, which the zoo's front (``cuboid.zoo``), the
checkpoint code and the cost model read; nothing above the zoo names a family's module. Adding a family is
its folder plus one ``register`` call (zoo/families.py holds the zoo's own; a test or a user may register
theirs through ``cuboid.zoo.register_family``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from torch import nn

from cuboid.parallel.cost.shape import Shape, register_shape
from cuboid.parallel.spec import ShardingSpec

from .hf_io import Family


@dataclass(frozen=True)
class FamilyRecord:
    """One model family, as the registry files it."""

    name: str                                   # the family's name ("gpt", "llama", ...): its spec's key
    config: type                                # the config dataclass (``replace``, ``to_dict``)
    model: type                                 # the model class, built as ``model(config)``
    presets: Mapping[str, Any]                  # preset name -> config
    spec: ShardingSpec                          # what each layer is (parallel/spec.py)
    shape: Callable[[Any], Shape]               # config -> the cost model's Shape
    hf: Family                                  # the Hugging Face mapping (zoo/hf_io.py)
    # after each optimizer step, on every rank: ``after_step(model)``; the model's config carries its options
    after_step: Optional[Callable[[nn.Module], None]] = None


RECORDS: dict = {}   # name -> FamilyRecord
PRESETS: dict = {}   # preset name -> config, every family's
CLASSES: dict = {}   # config class -> model class
SPECS: dict = {}     # family name -> ShardingSpec
HF: dict = {}        # family name -> hf_io.Family
SHAPES: dict = {}    # config class -> shape function


def register(record: FamilyRecord) -> FamilyRecord:
    """File ``record`` in every table; a name, config class or preset another family holds is refused, and so is
    a record whose Hugging Face mapping builds another class. Returns the record."""
    if not isinstance(record, FamilyRecord):
        raise TypeError(f"a family is registered as a FamilyRecord, got {type(record).__name__}")
    if record.name in RECORDS:
        raise ValueError(f"a family named {record.name!r} is registered already")
    if record.config in CLASSES:
        raise ValueError(f"config class {record.config.__name__} belongs to a registered family already")
    clash = sorted(set(record.presets) & set(PRESETS))
    if clash:
        raise ValueError(f"presets {', '.join(clash)} of family {record.name!r} are another family's")
    if record.hf.build is not record.model or record.hf.name != record.name:
        raise ValueError(f"family {record.name!r}: its Hugging Face mapping names {record.hf.name!r} and builds "
                         f"{getattr(record.hf.build, '__name__', record.hf.build)}, not {record.model.__name__}")
    RECORDS[record.name] = record
    PRESETS.update(record.presets)
    CLASSES[record.config] = record.model
    SPECS[record.name] = record.spec
    HF[record.name] = record.hf
    SHAPES[record.config] = record.shape
    register_shape(record.config, record.shape)
    return record


def record_of(model: nn.Module) -> FamilyRecord:
    """The record of the family ``model`` (a zoo model, unwrapped) belongs to."""
    for record in RECORDS.values():
        if isinstance(model, record.model):
            return record
    raise TypeError(f"{type(model).__name__} is not a zoo model")


def after_step(model: nn.Module) -> None:
    """The family's ``after_step`` hook on ``model`` (a zoo model, unwrapped); nothing for a family without one.
    Every rank calls it after the same optimizer step."""
    hook = record_of(model).after_step
    if hook is not None:
        hook(model)
