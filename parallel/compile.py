"""Per-block ``torch.compile``, the plan's ``compile`` field (torchtitan's per-block compile).

Each repeated block (the spec's ``blocks``, e.g. ``blocks`` or ``layers``) is
compiled in place with :meth:`torch.nn.Module.compile`: the module keeps its
class, its parameter names and its place in the model, so checkpoints,
optimizers, the pipeline's stage cuts and ZeRO's per-block units see the
same modules as without compile. One block's code is compiled once and
reused by every block of the same shapes (Dynamo caches on the code, its
guards on the parameters' shapes and dtypes). The model's embeddings, final
norm and head stay eager, as in torchtitan: they run once a step.

Blocks are compiled without ``fullgraph``: under a plan a block's forward
may hold what Dynamo does not trace (a collective's host-side byte count, a
tensor-parallel dropout's seed draw), and there the block falls back to eager
for that piece instead of failing. On one device and under the plans the
tests run (dp, ZeRO-3, tp1d, pp) the values equal eager's.

The kernels need nothing more: their Triton paths are custom ops
that each kernel file registers (:mod:`cuboid.kernels.library` says how) and their torch paths plain
torch.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

__all__ = ["BACKEND", "compile_blocks", "compiled_blocks"]

BACKEND = "inductor"  # what the plan's ``compile`` uses; tests on CPU set "aot_eager" (no C++ code generation)


def _blocks(model: nn.Module, blocks: str) -> list:
    """The blocks of ``model.<blocks>``, in order."""
    try:
        container = model.get_submodule(blocks)
    except AttributeError:
        raise ValueError(f"compile: the model has no {blocks!r} blocks to compile (its sharding spec names them)") \
            from None
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        raise ValueError(f"compile: {blocks!r} is a {type(container).__name__}, not a list of blocks")
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def compile_blocks(model: nn.Module, blocks: str = "blocks", *, backend: Optional[str] = None,
                   options: Optional[dict[str, Any]] = None) -> nn.Module:
    """Compile each block of ``model.<blocks>`` in place (``block.compile(backend=...)``); returns ``model``.

    ``blocks``: the dotted name of the blocks' container (the spec's ``blocks``); ``backend``, ``options``:
    as :func:`torch.compile`'s (None: :data:`BACKEND`; ``"aot_eager"`` traces without inductor's code
    generation). Compiling
    again does nothing more. Under a pipeline plan only the blocks this rank holds are present; each is
    compiled the same way.
    """
    for block in _blocks(model, blocks):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(backend=backend or BACKEND, options=options)
    return model


def compiled_blocks(model: nn.Module, blocks: str = "blocks") -> list[bool]:
    """Per block of ``model.<blocks>``: whether it runs compiled."""
    return [getattr(b, "_compiled_call_impl", None) is not None for b in _blocks(model, blocks)]
