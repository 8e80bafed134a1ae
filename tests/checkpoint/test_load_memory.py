"""Folder loads read only this rank's slices: peak anonymous memory under tp=4 and on one device, and parity.

A random GPT of 64 MB (fp32) is saved as a sharded folder. Four gloo
ranks load it with ``cuboid.load(folder, plan="tp1d-4")`` while a thread
samples ``RssAnon`` (RSS would count the mapped file pages, which are page
cache, not the process's memory). The contract: a rank's peak is at most its
local shard + the largest single tensor + 300 MB. The test also holds the
growth during the load to that bound with 16 MB of slack instead of 300 MB
(after torch's one-time lazy set-up, see :func:`warm_up`): a reader that held
every tensor whole (the model's 64 MB) fails it. On one
device, where parts stored as they are used stay views of the mapped files,
the growth is at most the largest tensor + slack; with a cast (bf16) it is the
cast model + the largest tensor + slack. The gathered tensor-parallel values
equal the single-device load's.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch

import cuboid
from cuboid.zoo import checkpoint

from ..parallel.launch import run_world

SIZE = dict(vocab_size=8000, n_positions=256, dim=512, n_layers=4, n_heads=8)  # 16.8M parameters, 64 MB
MB = 1 << 20
SLACK = 16 * MB    # allocator, gloo groups and interpreter noise during a load
CONTRACT = 300 * MB


def rss_anon() -> int:
    """Anonymous resident memory of this process, in bytes."""
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class AnonPeak:
    """Samples ``RssAnon`` every 0.5 ms in a thread, from construction to :meth:`stop`."""

    def __init__(self) -> None:
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(5e-4)

    def stop(self) -> "AnonPeak":
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        return self


def warm_up() -> None:
    """torch's first meta -> CPU allocation sets up 33 MB of anonymous memory once per process: not the load's."""
    torch.empty_like(torch.empty(1, device="meta"), device="cpu")


def local_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def largest_bytes(folder: Path) -> int:
    ts = checkpoint.TensorFolder(folder)
    return max(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
               for s, d in (ts.shape_dtype(n) for n in ts.keys()))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = cuboid.load("gpt-debug", seed=0, **SIZE)
    return checkpoint.save(model, tmp_path_factory.mktemp("load-memory") / "gpt", max_shard_size="20MB")


def _tp_rank(folder: str) -> dict:
    import torch.distributed as dist

    from cuboid.zoo.common import sharded_parameters

    dist.init_process_group("gloo")
    torch.set_grad_enabled(False)
    warm_up()
    sample = AnonPeak()
    model = cuboid.load(folder, plan="tp1d-4")
    sample.stop()
    assert model.blocks[0].attn.qkv.weight.shape[0] == 3 * SIZE["dim"] // 4  # really sharded
    ref = dict(cuboid.load(folder).named_parameters())  # one device, in this rank
    differ = [name for name, mod, local, _ in sharded_parameters(model)
              if not torch.equal(mod.full_tensor(local), ref[name])]
    return {"base": sample.base, "peak": sample.peak, "local": local_bytes(model), "differ": differ}


def test_tp4_folder_load_reads_only_this_ranks_slices(folder):
    largest = largest_bytes(folder)
    for rank, r in enumerate(run_world(_tp_rank, 4, str(folder), timeout=120, fresh=True)):
        assert not r["differ"], f"rank {rank}: gathered values differ from one device's: {r['differ'][:5]}"
        assert r["peak"] <= r["local"] + largest + CONTRACT, (rank, r)
        grew = r["peak"] - r["base"]
        assert grew <= r["local"] + largest + SLACK, (
            f"rank {rank}: RssAnon grew by {grew / MB:.1f} MB during the load; local shard "
            f"{r['local'] / MB:.1f} MB + largest tensor {largest / MB:.1f} MB + {SLACK // MB} MB")


def _single(folder: str) -> list:
    warm_up()
    torch.set_grad_enabled(False)
    ref = cuboid.load("gpt-debug", seed=0, **SIZE)
    out = []
    for dtype in (None, torch.bfloat16):
        sample = AnonPeak()
        model = cuboid.load(folder, dtype=dtype)
        sample.stop()
        differ = [name for (name, p), q in zip(model.named_parameters(), ref.parameters())
                  if p.dtype != (dtype or torch.float32) or not torch.equal(p, q.to(p.dtype))]
        out.append({"dtype": str(dtype), "base": sample.base, "peak": sample.peak, "local": local_bytes(model),
                    "differ": differ})
        del model
    return out


def test_single_device_folder_load_does_not_copy_what_it_can_map(folder):
    """In a fresh process, as the ranks above: fp32 as stored (views of the files), then cast to bf16."""
    largest = largest_bytes(folder)
    for r in run_world(_single, 1, str(folder), timeout=120, fresh=True)[0]:
        assert not r["differ"], (r["dtype"], r["differ"][:5])
        assert r["peak"] <= r["local"] + largest + CONTRACT, r
        cast = r["local"] if r["dtype"] != "None" else 0  # a cast makes new tensors; as stored, views
        grew = r["peak"] - r["base"]
        assert grew <= cast + largest + SLACK, f"{r['dtype']}: RssAnon grew by {grew / MB:.1f} MB"
