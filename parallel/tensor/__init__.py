"""Tensor parallelism: one module per mode, each over its own activation layout.

- :mod:`.d1`: Megatron 1D (column / row linear, vocab-parallel embedding, head
  and cross-entropy) over the mesh's ``tp`` group.

2D (Optimus), 2.5D (Tesseract) and 3D modes are to come, over the mesh's
``tp_row`` / ``tp_col`` / ``tp_dep`` groups.
"""
from .d1 import (ColumnLinear, RowLinear, VocabEmbedding, VocabTensor, grad_norm_reducer, shard_1d,
                 tp_sharded_params, vocab_parallel_cross_entropy)

__all__ = ["ColumnLinear", "RowLinear", "VocabEmbedding", "VocabTensor", "vocab_parallel_cross_entropy",
           "shard_1d", "tp_sharded_params", "grad_norm_reducer"]
