"""Tensor parallelism: one engine, one table per mode.

- :mod:`.base`: the one base of every sharded layer (:class:`~.base.Sharded`
  over :class:`~.base.Axes` and :class:`~.base.Cut`: full shapes, slices,
  packed segments, padding, full tensors, norm placements).
- :mod:`.engine`: the walker (:func:`shard_model`, :func:`~.engine.parallelize_module`)
  that applies a mode's role -> layer table (:class:`~.engine.Style` rows),
  and :func:`bytes_per_step`, the traffic of a training step from the mode's
  per-layer ``Costs``.
- the modes, each stating its layout and communication: :mod:`.d1` (Megatron
  1D over ``tp``), :mod:`.d2` (Optimus 2D on a q x q grid) and :mod:`.d2p5`
  (Tesseract 2.5D, d x q x q) over the grid of :mod:`.grid`, :mod:`.d3` (3D on
  a q x q x q cube).
"""
from .base import Axes, Cut, Sharded
from .d1 import ColumnLinear, RowLinear, VocabEmbedding, VocabTensor, shard_1d, vocab_parallel_cross_entropy
from .d2 import shard_2d
from .d2p5 import shard_2p5d
from .d3 import shard_3d
from .engine import MODES, Mode, Style, bytes_per_step, mode_of, parallelize_module, shard_model


__all__ = ["shard_model", "bytes_per_step", "parallelize_module", "mode_of", "MODES", "Mode", "Style", "Sharded",
           "Axes", "Cut", "ColumnLinear", "RowLinear", "VocabEmbedding", "VocabTensor", "vocab_parallel_cross_entropy",
           "shard_1d", "shard_2d", "shard_2p5d", "shard_3d"]
