"""cuboid.parallel: plans, meshes, parallel layers, optimizers.

``Plan`` (data) + ``Mesh`` (process groups) + ``shard`` / ``prepare`` (plan -> drop-in model).
"""
from .apply import (ShardingSpec, checkpoint_blocks, input_splitter, prepare,
                    set_gradient_sync, shard, unwrap)
from .batch import pad_batch, split_batch
from .mesh import Mesh, init_distributed
from .plan import Plan

__all__ = ["Plan", "Mesh", "ShardingSpec", "init_distributed", "prepare", "set_gradient_sync", "split_batch", "shard", "input_splitter", "unwrap", "checkpoint_blocks"]
