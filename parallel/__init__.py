"""cuboid.parallel: plans, meshes, parallel layers, optimizers.

``Plan`` (data) + ``Mesh`` (process groups) + ``parallelize(model, plan)``.
"""
from .apply import ShardingSpec, checkpoint_blocks, parallelize, unwrap
from .mesh import Mesh, init_distributed
from .plan import Plan

__all__ = ["Plan", "Mesh", "ShardingSpec", "init_distributed", "parallelize", "unwrap", "checkpoint_blocks"]
