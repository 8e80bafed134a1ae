"""cuboid.parallel: plans, meshes, parallel layers, optimizers.

``Plan`` (data) + ``Mesh`` (process groups) + ``shard`` / ``prepare`` (plan -> drop-in model).
"""
from .apply import (ShardingSpec, checkpoint_blocks, input_splitter, norm_reducer, parallelize, prepare,
                    set_gradient_sync, shard, unwrap)
from .mesh import Mesh, init_distributed
from .plan import Plan

__all__ = ["Plan", "Mesh", "ShardingSpec", "init_distributed", "prepare", "parallelize", "set_gradient_sync", "shard", "input_splitter", "norm_reducer", "unwrap", "checkpoint_blocks"]
