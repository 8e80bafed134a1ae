"""cuboid.parallel: plans, meshes, parallel layers, optimizers.

``Plan`` (data) + ``Mesh`` (process groups) + ``parallelize(model, plan)``.
"""
from .apply import ShardingSpec, checkpoint_blocks, input_splitter, norm_reducer, parallelize, shard, unwrap
from .mesh import Mesh, init_distributed
from .plan import Plan

__all__ = ["Plan", "Mesh", "ShardingSpec", "init_distributed", "parallelize", "shard", "input_splitter", "norm_reducer", "unwrap", "checkpoint_blocks"]
