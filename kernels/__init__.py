"""cuboid.kernels: Triton kernels with torch references and autograd Functions.

One file per op (docs/architecture.md); each file registers its Triton path as
torch custom ops (``torch.ops.cuboid.*``; :mod:`cuboid.kernels.library` says
how) when imported. The public functions choose their backend
explicitly (see :mod:`cuboid.kernels._backend`). Submodules are imported on
first use, so ``import cuboid.kernels`` does no work: no Triton import, no
device probing, no autotuning.

Imported under the bare name ``kernels`` (a script or ``python -c`` in the
repository root, where this folder comes first on ``sys.path``), the folder
is not this package: Hugging Face's ``kernels`` distribution, which
``transformers`` imports, is meant. The module then hands over to that
distribution, found on ``sys.path`` without the repository root, and puts it
in ``sys.modules["kernels"]``, so the import gives what it gives anywhere else;
nothing of this package is defined under that name.
"""
from __future__ import annotations

import importlib
import sys
import types


def _hand_over() -> None:
    """Load the installed ``kernels`` distribution in this folder's place (the module docstring says why)."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named 'kernels' is installed: {root}/kernels is cuboid.kernels, not "
                                  "Hugging Face's kernels distribution, which `import kernels` means", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds once this file ends
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _hand_over()
else:
    from ._backend import BACKENDS, auto_backend, interpreter_active, resolve_backend, use_backend

# public name -> submodule that defines it
_EXPORTS = {
    "attention": "flash_attention",
    "attention_ref": "attention_torch",
    "attention_backward": "flash_attention",
    "doc_ids_from_positions": "attention_torch",
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
    "grouped_mm": "grouped_gemm",
    "grouped_mm_ref": "grouped_gemm",
    "quantize_nf4": "nf4",
    "dequantize_nf4": "nf4_linear",
    "nf4_linear": "nf4_linear",
    "nf4_linear_ref": "nf4_linear",
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


if __name__ != "kernels":  # handed over: sys.modules["kernels"] is the distribution
    sys.modules[__name__].__class__ = _Package
