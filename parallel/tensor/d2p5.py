"""2.5D tensor parallelism (Tesseract, Wang et al., arXiv 2105.14500) on a d x q x q grid of ``tp``.

**Grid.** Tensor rank ``t = k q^2 + i q + j`` sits at depth k, row i, column j
of the mesh's ``tp_grid`` (d, q, q): ``tp_row`` (same k, i; indexed by j),
``tp_col`` (same k, j; by i), ``tp_dep`` (same i, j; by k). Each depth k is
a 2D grid of :mod:`.d2`, and the layers are :mod:`.d2`'s with the depth axis
switched on (thin subclasses).

**Layout.** The input X is split into d q row blocks and q column blocks, the
d q row blocks stacked as d layers of q: rank (k, i, j) holds
``X[k q + i, j]`` = (B / (d q), T, H / q): batch block ``k q + i``, hidden
block j (:func:`.grid.split_input` splits model inputs so). Weights are cut
over (i, j) exactly as in 2D, (in/q, out/q) blocks (vectors in q^2 pieces),
and *replicated over depth*: each depth layer runs SUMMA on its own batch
rows, and every parameter's gradient is all-reduced over ``tp_dep`` inside
the layer's backward (a ``copy_to`` on the local shard), so gradients are
complete when backward ends, with no extra step. Losses average over all
d q batch blocks (``tp_col`` then ``tp_dep``).

**Communication** (exact bytes per layer: :class:`.grid.Costs` with depth d;
per training step: :func:`bytes_per_step`): every layer moves what its 2D
counterpart moves on its own batch rows (N = B T / (d q) local rows), and in
backward every parameter's local piece adds one gradient all-reduce over
``tp_dep`` (``2 (d-1)/d`` times its bytes, once per use); the losses add an
fp32 (sum, count) pair over ``tp_dep``.

Against 2D on the same P = d q^2 ranks (side Q = q sqrt(d)), a Linear's
activation gather shrinks from ``B T in / Q`` to ``B T in / (d q)`` (by
sqrt(d)) while its weight gather grows from ``out in / Q`` to ``out in / q``
and the depth all-reduce of the 1/q^2 weight shards is added: depth pays off
when activations outweigh weights (large B T), Tesseract's trade.
"""
from __future__ import annotations

import torch

from cuboid.parallel.tensor.d2 import (Embedding2D, Head2D, LayerNorm2D, LearnedTensor2D, Linear2D, VocabEmbedding2D,
                                       VocabTensor2D)
from cuboid.parallel.tensor.engine import Mode, parallelize_module, step_bytes
from cuboid.parallel.tensor.grid import Costs, Grid, batch_mean, cross_entropy, gather_output, split_input, styles

__all__ = ["Linear2p5D", "LayerNorm2p5D", "VocabEmbedding2p5D", "VocabTensor2p5D", "Embedding2p5D", "LearnedTensor2p5D",
           "Head2p5D", "shard_2p5d", "bytes_per_step", "split_input", "gather_output", "cross_entropy", "batch_mean",
           "Grid", "CLASSES", "STYLES", "MODE"]


class Linear2p5D(Linear2D):
    """:class:`.d2.Linear2D` on depth layer k's batch rows; weight grads all-reduced over ``tp_dep``."""

    _MODE = "2.5d"


class LayerNorm2p5D(LayerNorm2D):
    """:class:`.d2.LayerNorm2D` with depth; w, b grads all-reduced over ``tp_dep``."""

    _MODE = "2.5d"


class VocabEmbedding2p5D(VocabEmbedding2D):
    """:class:`.d2.VocabEmbedding2D` with depth: ids (B/(dq), T); the loss averages over all d q blocks."""

    _MODE = "2.5d"


class VocabTensor2p5D(VocabTensor2D):
    _MODE = "2.5d"


class Embedding2p5D(Embedding2D):
    _MODE = "2.5d"


class LearnedTensor2p5D(LearnedTensor2D):
    _MODE = "2.5d"


class Head2p5D(Head2D):
    """:class:`.d2.Head2D` with depth: (B/(dq), .., C) replicated over the row."""

    _MODE = "2.5d"


CLASSES = {"linear": Linear2p5D, "norm": LayerNorm2p5D, "vocab": VocabEmbedding2p5D, "vocab_tensor": VocabTensor2p5D,
           "embedding": Embedding2p5D, "tensor": LearnedTensor2p5D, "head": Head2p5D}


STYLES = styles(CLASSES)
MODE = Mode("2.5D", STYLES, Grid.of, Costs.of)


def shard_2p5d(model, spec, mesh_or_grid):
    """:func:`.d2.shard_2d` with the 2.5D layers, on a 2.5D Mesh (or a :class:`Grid` with depth)."""
    return parallelize_module(model, spec, MODE, Grid.of(mesh_or_grid))


def bytes_per_step(config, plan, batch: int, seq: int, *, dtype=torch.float32, autocast=None) -> float:
    """Bytes one rank sends in a GPT-shaped training step under 2.5D (:func:`.engine.step_bytes`)."""
    return step_bytes(Costs.of(plan, dtype, autocast), config, batch, seq)
