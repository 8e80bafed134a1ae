"""Batch helpers: pad a batch with rows that weigh nothing, split it into equal micro-batches, and
cut it into the batch blocks of the tensor modes that cut the batch (2D, 2.5D, 3D).

The padding and splitting serve the training step (dp shares, micro-batches),
:class:`BatchSplit` and the pipeline (micro-batches of a schedule);
:class:`BatchSplit` is what :func:`~cuboid.parallel.prepare` installs on a
model (or hands to its pipeline's first stage) under 2D / 2.5D / 3D.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cuboid.kernels.flash_attention import doc_ids_from_positions

from .mask import Mask

HIDDEN_FIELDS = ("logits", "last_hidden_state", "pooler_output")  # activations: batch and hidden dim split

if TYPE_CHECKING:
    from .mesh import Mesh
    from .plan import Plan


def pad_rows(key, x: torch.Tensor, pad: int) -> torch.Tensor:
    """``x`` with ``pad`` rows added on dim 0 that weigh nothing: labels -100, other inputs the last row again."""
    if not pad:
        return x
    fill = torch.full_like(x[:1], -100) if key == "labels" else x[-1:]
    return torch.cat([x, fill.expand(pad, *x.shape[1:])])


def pad_batch(batch: dict, multiple: int) -> dict:
    """``batch`` padded on dim 0 to a multiple of ``multiple`` with rows that weigh nothing (:func:`pad_rows`)."""
    size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    pad = (-size) % multiple
    batch = rows_of(batch, size) if pad else batch
    return {k: pad_rows(k, v, pad) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} if pad else batch


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Split a batch dict along dim 0 into ``parts`` equal micro-batches (HF's (1, T) ``position_ids``, one row
    for all, expanded first)."""
    size = next(iter(batch.values())).shape[0]
    if size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal micro-batches")
    step = size // parts
    batch = rows_of(batch, size)
    return [{k: v[i * step:(i + 1) * step] for k, v in batch.items()} for i in range(parts)]


def rows_of(batch: dict, size: int) -> dict:
    """``batch`` with a (1, T) ``position_ids`` (Hugging Face's: the same positions for every row) expanded to
    ``size`` rows, so that cutting rows cuts it too."""
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.shape[0] == 1 and size > 1:
        return dict(batch, position_ids=positions.expand(size, *positions.shape[1:]))
    return batch


class BatchSplit:
    """Model-level input split and output gather for the tensor modes that cut the batch (2D, 2.5D, 3D).

    Installed by :func:`~cuboid.parallel.prepare` as a forward pre-hook and a
    forward hook (:meth:`install`), so that a user feeds the model its whole dp
    share in the single-device format and gets single-device outputs back:

    - before forward, every tensor input whose dim 0 is the batch is padded to
      a multiple of the mode's batch blocks (labels with -100, other inputs by
      repeating the last row, so padded rows never count in a loss) and this
      rank keeps its block (3D: attention masks in the ``inner`` layout, as a
      :class:`~cuboid.parallel.mask.Mask` with the positions when the batch gives them, and
      one-per-example labels whole, as its layers expect);
    - after forward, hidden-state fields of the :class:`Output` (in the mode's
      activation layout) and the logits are gathered to whole tensors *when
      read*, padding rows cut. The loss is already the mean over the whole
      share. Training that reads only ``loss`` gathers nothing.
    """

    def __init__(self, plan: "Plan", mesh: "Mesh") -> None:
        self.plan, self.mesh, self.parts = plan, mesh, plan.batch_parts
        self._sizes: list = []  # batch size of each forward in flight (a stack: forwards may nest)

    def _split(self, key, x: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_mode in ("2d", "2.5d"):
            from .tensor.grid import split_input

            return split_input(x, self.mesh, 0)
        from .tensor.d3 import split_input

        if key == "labels" and x.dim() == 1:  # the 3D classifier's logits are whole on every rank
            return x
        return split_input(x, self.mesh, 0, layout="inner" if key == "attention_mask" else "block")

    def install(self, model) -> None:
        """Split ``model``'s inputs before each forward and make its outputs whole after it."""
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)

    def cut(self, key, x, batch: int, pad: int):
        """Input ``key`` of a ``batch``-row batch: ``pad`` weightless rows added, this rank's block kept
        (anything that is not a batch-sized tensor passes unchanged)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
            return x
        return self._split(key, pad_rows(key, x, pad))

    def cut_inputs(self, inputs: dict, batch: int, pad: int) -> dict:
        """Every input of ``inputs`` cut (:meth:`cut`). Under 3D with ``position_ids``, ``attention_mask``
        becomes the attention cores' :class:`~cuboid.parallel.mask.Mask` (:meth:`core_mask`): the cores
        hold other rows than the embeddings, which take ``position_ids`` in the block layout."""
        out = {k: self.cut(k, v, batch, pad) for k, v in inputs.items()}
        if self.plan.tp_mode == "3d" and isinstance(inputs.get("position_ids"), torch.Tensor):
            out["attention_mask"] = self.core_mask(inputs.get("attention_mask"), inputs["position_ids"], batch, pad)
        return out

    def core_mask(self, attention_mask, position_ids: torch.Tensor, batch: int, pad: int) -> Mask:
        """The 3D attention cores' :class:`~cuboid.parallel.mask.Mask` (the ``inner`` layout's rows): its
        document ids counted on the whole rows, then cut. The key mask stays whole-shaped where the batch gave
        one (a pipeline stream's shape must not depend on its values)."""
        positions = position_ids.long().expand(batch, -1) if position_ids.shape[0] != batch else position_ids.long()
        keep = attention_mask.to(torch.bool) if isinstance(attention_mask, torch.Tensor) else None
        whole = Mask(keep, positions, doc_ids_from_positions(positions))
        return whole.map(lambda t: self._split("attention_mask", pad_rows(None, t, pad)))

    def before(self, module, args, kwargs):
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        batch = first.shape[0] if first is not None else 0
        pad = (-batch) % self.parts
        self._sizes.append((batch, pad))
        args = tuple(self.cut(None, v, batch, pad) for v in args)
        return args, self.cut_inputs(kwargs, batch, pad)

    def _gather_hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_mode in ("2d", "2.5d"):
            from .tensor.grid import gather_output

            return gather_output(x, self.mesh, 0, hidden=True)
        from .tensor.d3 import gather_output

        return gather_output(x, self.mesh, 0, layout="block", hidden=True)

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row outputs of this rank's batch block (the head's rows, replicated over the vocab slices) ->
        the whole batch on every rank."""
        if self.plan.tp_mode in ("2d", "2.5d"):
            from .tensor.grid import gather_output

            return gather_output(x, self.mesh, 0)
        from .tensor.d3 import gather_output

        return gather_output(x, self.mesh, 0, layout="block")

    def after(self, module, args, kwargs, output):
        batch, pad = self._sizes.pop()
        return self.whole(output, batch, pad)

    def whole(self, output, batch: int = 0, pad: int = 0):
        """``output``'s fields made whole when read: plain tensor fields (activations in the mode's layout;
        per-token outputs, one value per row and position) gathered over the grid, ``pad`` padding rows cut
        (``batch`` rows kept); in place, returned."""
        if not hasattr(output, "defer"):
            return output
        for name in HIDDEN_FIELDS + ("token_logps", "token_entropy"):
            if not output.is_deferred(name):
                output.defer(name, self._gather_hidden if name in HIDDEN_FIELDS else self._gather_rows)
            if pad:
                output.defer(name, lambda t: t[:batch])
        return output


def input_splitter(plan: "Plan", mesh: "Mesh"):
    """``batch -> batch``: this rank's block of a batch under the plan's tensor mode (None when none is cut).

    :func:`~cuboid.parallel.prepare` installs the same split on the model
    itself, so callers of a prepared model never need this; it serves
    layer-level tests and benches.
    """
    if mesh.size("tp") == 1 or plan.tp_mode == "1d":
        return None
    split = BatchSplit(plan, mesh)
    return lambda batch: {k: split._split(k, v) for k, v in batch.items()}
