"""A LoRA adapter folder (a fine-tune's ``final/``, ``save_adapters``, ``checkpoint.save`` of a LoRA model) is
written as every folder cuboid writes (issue 39): temporary folder, fsync, rename, a commit record of every
file's SHA-256 with the tokenizer's files inside it; a failure mid-write leaves the previous folder, only
cuboid's own folder (or one of model files) is replaced, and a load checks the record first."""
from __future__ import annotations

import json

import pytest
import torch

import cuboid
from cuboid.zoo import checkpoint
from cuboid.zoo import lora as zlora
from cuboid.zoo.checkpoint import CheckpointError
from cuboid.zoo.checkpoint import folder as folder_mod
from cuboid.zoo.checkpoint.format import ADAPTERS_COMMIT

from ..front import fixtures as F

LORA = "r=4,alpha=8,targets=attn+mlp"


def _adapted(seed: int):
    """llama-debug with adapters whose B is not zero (so two seeds differ)."""
    model = cuboid.load("llama-debug", lora=LORA, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, base in cuboid.parallel.lora.adapted(model):
            base.lora_B.weight.copy_(torch.randn(base.lora_B.weight.shape, generator=g))
    return model


def _adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def _leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return F.bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_adapter_folder_records_every_file_with_the_tokenizer_inside(tmp_path, tokenizer):
    path = zlora.save_adapters(_adapted(0), tmp_path / "final", tokenizer=tokenizer)
    names = {p.name for p in path.iterdir()}
    record = json.loads((path / ADAPTERS_COMMIT).read_text())
    assert set(record["files"]) == names - {ADAPTERS_COMMIT}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(record["files"])
    report = checkpoint.verify(path)
    assert report["files"] == len(names) and report["tensors"] > 0
    raw = bytearray((path / "tokenizer.json").read_bytes())  # the tokenizer is checked too
    raw[10] ^= 0x01
    (path / "tokenizer.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        checkpoint.verify(path)
    with pytest.raises(CheckpointError, match="tokenizer.json"):  # a load reads the record first
        cuboid.load("llama-debug", lora=str(path))


@pytest.mark.parametrize("stage", ["file:adapter_model.safetensors", "file:adapter_config.json",
                                   f"file:{ADAPTERS_COMMIT}", "written"])
def test_a_failure_mid_write_leaves_the_previous_folder(tmp_path, tokenizer, monkeypatch, stage):
    first = _adapted(0)
    path = zlora.save_adapters(first, tmp_path / "final", tokenizer=tokenizer)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def hook(at):
        if at == stage:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder_mod, "hook", hook)
    with pytest.raises(OSError, match="No space left"):
        zlora.save_adapters(_adapted(1), path, tokenizer=tokenizer)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert not _leftovers(path)
    checkpoint.verify(path)
    again = cuboid.load("llama-debug", lora=str(path))
    want, got = _adapters(first), _adapters(again)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    second = _adapted(1)  # the next save replaces it whole (cuboid's own folder)
    checkpoint.save(second, path, tokenizer=tokenizer)
    got = _adapters(cuboid.load("llama-debug", lora=str(path)))
    assert all(torch.equal(_adapters(second)[k], got[k]) for k in got)
    assert not _leftovers(path) and not folder_mod.old_of(path).exists()


def test_a_folder_with_the_user_s_files_is_not_replaced(tmp_path):
    path = tmp_path / "final"
    (path / "src").mkdir(parents=True)
    (path / "notes.tex").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing to replace.*notes.tex"):
        zlora.save_adapters(_adapted(0), path)
    assert (path / "notes.tex").read_text() == "mine" and (path / "src").is_dir()
    assert not _leftovers(path)
