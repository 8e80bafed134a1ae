"""1D tensor parallelism (2 gloo ranks): sharded layers save the same bytes as one process, and load back.

Only the layers' full-tensor interface is involved (full_tensor, full_tensor_like,
shard_slices / load_full with packed qkv and a padded vocab): nothing in the
checkpoint code knows about the mode.
"""
import json

from cuboid.kernels import use_backend
from cuboid.zoo import checkpoint

from ._child import tp_model_and_optimizer
from ..parallel.launch import free_port
from .common import spawn, wait


def test_tp2_save_matches_single_process_and_loads_back(tmp_path):
    port = free_port()
    results = wait([spawn("tp", rank, 2, port, tmp_path) for rank in range(2)], timeout=150)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{out}"
    with use_backend("torch"):
        model, opt = tp_model_and_optimizer()
    single = checkpoint.save(model, tmp_path / "single", max_shard_size="100KB", optimizer=opt, state={"step": 1})
    tp = tmp_path / "tp"
    names = sorted(p.name for p in single.iterdir())
    assert names == sorted(p.name for p in tp.iterdir())
    for name in names:
        if name not in ("trainer_state.json", "model.safetensors.index.json"):  # world size, RNG of 2 ranks
            assert (single / name).read_bytes() == (tp / name).read_bytes(), name
    a, b = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (single, tp))
    assert a["weight_map"] == b["weight_map"]
    checkpoint.verify(tp)

