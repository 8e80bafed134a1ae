"""The spec's memoised role lookup and the layers' ``to_empty``: the same answers as the plain rules they replace.

``ShardingSpec.role_of`` keeps each path's role per table of patterns: it must give fnmatch's first match for
every module of every zoo family, follow a spec whose ``roles`` change, and tell apart specs with the same
patterns in another order. ``layers.to_empty`` must allocate what ``nn.Module.to_empty`` does: the same names,
shapes, strides, dtypes, ``requires_grad`` and placements.
"""
import dataclasses
import fnmatch

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.spec import ShardingSpec
from cuboid.zoo import build, spec_of


def _plain_role(spec: ShardingSpec, path: str):
    return next((role for pattern, role in spec.roles.items() if fnmatch.fnmatchcase(path, pattern)), None)


def test_role_of_is_fnmatchs_first_match_on_every_family():
    seen = set()
    for name in ("gpt-debug", "bert-debug", "vit-debug", "llama-debug", "qwen3-moe-debug", "gemma3-debug",
                 "deepseek-v3-debug", "gpt-oss-debug"):
        model = build(name)
        spec = spec_of(model)
        paths = [p for p, _ in model.named_modules()] + ["", "blocks", "nothing.here", "blocks.0.attn.nope"]
        for _ in range(2):  # the first pass fills the table, the second reads it
            assert [spec.role_of(p) for p in paths] == [_plain_role(spec, p) for p in paths]
        seen.add(type(model).__name__)
    assert seen == {"GPT", "Bert", "ViT", "Llama", "DeepSeekV3"}


def test_role_of_follows_changed_roles_and_order():
    spec = ShardingSpec(roles={"blocks.*.fc": "column", "blocks.*": "norm"})
    assert spec.role_of("blocks.0.fc") == "column"
    spec.roles["blocks.*.fc"] = "row"  # the dict is the spec's: a changed role is read
    assert spec.role_of("blocks.0.fc") == "row"
    reordered = dataclasses.replace(spec, roles={"blocks.*": "norm", "blocks.*.fc": "row"})
    assert reordered.role_of("blocks.0.fc") == "norm"  # first match wins, in the new order
    assert spec.role_of("blocks.0.fc") == "row"
    assert spec.role_of("head") is None


class _Odd(L.ShardedModule):
    """A layer with a transposed (non-contiguous) buffer, an integer buffer and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3))
        self.frozen = nn.Parameter(torch.empty(2, 5), requires_grad=False)
        self.register_buffer("t", torch.empty(3, 4).t())
        self.register_buffer("ids", torch.empty(7, dtype=torch.int64))


def _layout(model: nn.Module) -> list:
    out = [(n, tuple(p.shape), p.stride(), p.dtype, p.device.type, p.requires_grad, L.placement_of(p))
           for n, p in model.named_parameters()]
    return out + [(n, tuple(b.shape), b.stride(), b.dtype, b.device.type) for n, b in model.named_buffers()]


def test_to_empty_allocates_what_module_to_empty_does():
    for make in (lambda: build("llama-debug"), lambda: build("gpt-debug"), lambda: nn.Sequential(_Odd(), _Odd())):
        with torch.device("meta"):
            ours, torchs = make(), make()
        assert L.to_empty(ours, "cpu") is ours
        torchs.to_empty(device="cpu")
        assert _layout(ours) == _layout(torchs)
        assert all(not p.is_meta for p in ours.parameters())
