"""cuboid.parallel: plans, meshes, parallel layers, optimizers.

``Plan`` (data) + ``Mesh`` (process groups) + ``shard`` / ``prepare`` (plan -> drop-in model), whose
result carries a :class:`ParallelState` (``model.parallel``, read through :func:`state_of`).
:func:`adapters_off`: a LoRA model's base outputs, under every plan.
"""
from .batch import input_splitter, pad_batch, split_batch
from .lora import adapters_off
from .mask import Mask
from .mesh import Mesh, init_distributed
from .plan import Plan
from .prepare import prepare, set_gradient_sync, shard, unwrap
from .recompute import checkpoint_blocks, recompute_blocks
from .spec import ShardingSpec
from .state import ParallelState, planned, state_of

__all__ = ["Plan", "Mesh", "ShardingSpec", "ParallelState", "init_distributed", "prepare", "set_gradient_sync",
           "split_batch", "shard", "input_splitter", "unwrap", "checkpoint_blocks", "recompute_blocks", "state_of", "pad_batch",
           "planned", "Mask", "adapters_off"]
