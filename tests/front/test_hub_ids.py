"""Hub ids from the local Hugging Face cache (``HF_HUB_OFFLINE=1``) in every command that takes a model, and a
LoRA run's folder as a model for ``generate`` and ``eval`` (its base from ``adapter_config.json`` or ``--base``)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import cuboid
from cuboid.cli import main

from . import fixtures as F

REPO = "tiny-org/tiny-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(tmp_path):
    """A tiny GPT-2 with its tokenizer placed in a fresh hub cache as the hub lays it out: the snapshot at the
    commit that ``refs/main`` names."""
    folder = F.hf_gpt2_folder(tmp_path / "gpt")
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return folder, cache


@pytest.fixture
def hub(tmp_path, monkeypatch):
    folder, cache = _cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(t for t, _ in F.sentences(48)) + "\n")
    return folder, cache, text


def test_hub_ids_load_from_the_cache_offline_in_every_command(hub, tmp_path, capsys):
    folder, cache, text = hub
    snapshot = cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    # cuboid.load: the cached weights, the same model as the folder's
    ids = torch.tensor([[1, 5, 9, 2]])
    a, b = cuboid.load(REPO).eval(), cuboid.load(str(folder)).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)

    # finetune (LoRA, so its final/ is an adapter folder naming the base), generate, eval, convert --base
    run = tmp_path / "run"
    assert main(["finetune", "--model", REPO, "--data", str(text), "--task", "causal", "--steps", "2",
                 "--batch-size", "4", "--seq-len", "24", "--lora", "r=4,alpha=8", "--output-dir", str(run),
                 "--no-progress", "--no-plot"]) == 0
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(snapshot.resolve())
    capsys.readouterr()
    assert main(["generate", "--model", REPO, "--prompt", "alpha beta", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("alpha beta")
    assert main(["eval", "--model", REPO, "--data", str(text), "--json", "--no-progress"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert main(["eval", "--model", str(folder), "--data", str(text), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out) == direct
    merged = tmp_path / "merged"
    assert main(["convert", str(run / "final"), str(merged), "--merge-lora", "--base", REPO, "--quiet"]) == 0
    assert (merged / "config.json").is_file() and f"wrote {merged}" in capsys.readouterr().out

    # the LoRA run's folder as --model: its base from adapter_config.json (or --base, here a hub id)
    assert main(["eval", "--model", str(run / "final"), "--data", str(text), "--json", "--no-progress"]) == 0
    adapted = json.loads(capsys.readouterr().out)
    assert main(["eval", "--model", str(merged), "--data", str(text), "--json", "--no-progress"]) == 0
    assert abs(json.loads(capsys.readouterr().out)["loss"] - adapted["loss"]) < 1e-4  # == the merged model
    assert adapted["loss"] != direct["loss"]  # the adapters are on
    assert main(["generate", "--model", str(run / "final"), "--base", REPO, "--prompt", "alpha", "--max-new-tokens",
                 "2"]) == 0
    assert capsys.readouterr().out.startswith("alpha")
    bare = tmp_path / "bare"  # adapters from elsewhere: no cuboid commit record, no base named
    shutil.copytree(run / "final", bare)
    for record in ("lora-adapters.json", "lora-checkpoint.json"):
        (bare / record).unlink(missing_ok=True)
    (bare / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": None}))
    assert main(["generate", "--model", str(bare), "--prompt", "alpha"]) == 2
    assert "names no base model: give --base" in capsys.readouterr().err
    assert main(["eval", "--model", str(bare), "--base", REPO, "--data", str(text), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out) == adapted

    # an id found nowhere: one line saying where cuboid looked
    assert main(["generate", "--model", "tiny-org/absent", "--prompt", "alpha"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"not in the Hugging Face cache {cache}" in err[0] and "HF_HUB_OFFLINE=1" in err[0], err
