"""Data parallelism on 2 gloo processes (127.0.0.1): one writer, the same bytes as one process."""
import json

import cuboid
from cuboid.zoo import checkpoint

from ..parallel.launch import free_port
from .common import spawn, wait


def test_two_rank_data_parallel_save_and_load(tmp_path):
    port = free_port()
    results = wait([spawn("dp", rank, 2, port, tmp_path) for rank in range(2)], timeout=150)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{out}"
        assert (tmp_path / f"ok-rank{rank}").is_file()
    # rank 0 wrote every file, rank 1 none
    log0 = (tmp_path / "hook-rank0.log").read_text().split()
    assert "done" in log0 and any(s.startswith("file:model-") for s in log0)
    assert not (tmp_path / "hook-rank1.log").exists()
    # byte-identical to a single-process save of the same model
    single = checkpoint.save(cuboid.load("gpt-debug", seed=0), tmp_path / "single", max_shard_size="100KB")
    files = sorted(p.name for p in single.iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "dp").iterdir())
    for name in files:
        assert (single / name).read_bytes() == (tmp_path / "dp" / name).read_bytes(), name
    # the training state holds both ranks' RNG states
    state = json.loads((tmp_path / "dp-train" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(state["rng"]) == 2 and state["rng"][0] != state["rng"][1]
    assert state["plan"] == {"name": "dp", "dp": 2}
    checkpoint.verify(tmp_path / "dp-train")
