"""cuboid.kernels: Triton kernels with torch references and autograd Functions.

One file per op (docs/architecture.md). The public functions choose their backend
explicitly (see :mod:`cuboid.kernels._backend`). Submodules are imported on
first use, so ``import cuboid.kernels`` does no work: no Triton import, no
device probing, no autotuning.
"""
from __future__ import annotations

import importlib
import sys
import types

from ._backend import BACKENDS, auto_backend, interpreter_active, resolve_backend, use_backend

# public name -> submodule that defines it
_EXPORTS = {
    "attention": "flash_attention",
    "attention_ref": "flash_attention",
    "layer_norm": "norm",
    "layer_norm_ref": "norm",
    "rms_norm": "norm",
    "rms_norm_ref": "norm",
    "adamw_step": "optim",
    "lamb_step": "optim",
    "lars_step": "optim",
    "grad_norm_sq": "optim",
    "rope": "rope",
    "rope_ref": "rope",
    "rope_tables": "rope",
    "swiglu": "swiglu",
    "swiglu_ref": "swiglu",
    "linear_cross_entropy": "linear_cross_entropy",
    "linear_cross_entropy_ref": "linear_cross_entropy",
}

# op name -> what `cuboid info` reports backends for
OPS = ("attention", "layer_norm", "rms_norm", "rope", "swiglu", "linear_cross_entropy", "adamw_step", "lamb_step",
       "lars_step")

__all__ = ["BACKENDS", "OPS", "auto_backend", "interpreter_active", "resolve_backend", "use_backend", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cuboid.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``cuboid.kernels.rope`` the function when its submodule ``kernels/rope.py`` is imported.

    Python sets a package attribute to a submodule when that submodule is first
    imported, so ``from cuboid.kernels.rope import rope_ref`` would otherwise
    turn ``cuboid.kernels.rope`` (and ``swiglu``) into the module. The module
    itself stays reachable by ``importlib.import_module("cuboid.kernels.rope")``.
    """

    def __setattr__(self, name, value):
        if (isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
