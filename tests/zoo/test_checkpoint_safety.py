"""Issue 39's checkpoint-side cases: folder replacement, stale indexes, a config that lies about its
depth, symbolic links, and one-line errors where tracebacks were.

Each test reproduces the case as the issue found it and asserts the sentence or the safe behaviour.
"""
import json
import os
import time
from pathlib import Path

import pytest
import torch

import cuboid
from cuboid.cli.convert import main as convert_main
from cuboid.zoo import checkpoint, to_hf
from cuboid.zoo.checkpoint import CheckpointError

from ..front import fixtures as F


def _model(seed: int):
    return cuboid.load("gpt-debug", seed=seed)


def _same(model, other) -> bool:
    b = dict(other.named_parameters())
    return all(torch.equal(p, b[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------- case 3: replacing a folder


def _users_folder(path: Path) -> Path:
    """What the issue found wiped: a config.json beside a .tex file and a src/ folder."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "paper.tex").write_text("\\section{mine}")
    (path / "src").mkdir()
    (path / "src" / "train.py").write_text("print('mine')")
    return path


def _intact(path: Path) -> None:
    assert (path / "paper.tex").read_text() == "\\section{mine}"
    assert (path / "src" / "train.py").read_text() == "print('mine')"
    assert (path / "config.json").read_text() == "{}"


def test_save_refuses_a_folder_with_the_users_files(tmp_path):
    d = _users_folder(tmp_path / "work")
    with pytest.raises(CheckpointError, match=r"refusing to replace .*work: it is not a checkpoint folder "
                                              r"\(paper\.tex is not a model file"):
        checkpoint.save(_model(0), d)
    _intact(d)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # no temporary folder left beside it
    (d / "paper.tex").unlink()
    with pytest.raises(CheckpointError, match=r"\(src/ is not a model file"):
        checkpoint.save(_model(0), d)
    assert (d / "src" / "train.py").is_file()


def test_convert_overwrite_refuses_a_folder_with_the_users_files(tmp_path, capsys):
    src = checkpoint.save(_model(0), tmp_path / "src")
    d = _users_folder(tmp_path / "dst")
    assert convert_main(["convert", str(src), str(d), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "paper.tex is not a model file" in err, err
    _intact(d)


def test_the_trainers_final_folder_refuses_the_users_files(tmp_path):
    """final/ goes through checkpoint.save: a final/ the user filled is refused, not wiped."""
    d = _users_folder(tmp_path / "out" / "final")
    with pytest.raises(CheckpointError, match=r"paper\.tex is not a model file"):
        checkpoint.save(_model(0), d, tokenizer=None)
    _intact(d)


def test_folders_of_model_files_and_cuboids_own_are_replaced(tmp_path):
    """A transformers-style folder (config, weights, tokenizer, generation config) and a cuboid checkpoint
    with training state are replaced; a file the old commit recorded counts as cuboid's own."""
    hf = tmp_path / "hf"
    to_hf(_model(0), hf)
    F.bpe_tokenizer(hf)
    (hf / "generation_config.json").write_text("{}")
    b = _model(1)
    checkpoint.save(b, hf)
    assert _same(cuboid.load(str(hf)), b) and not (hf / "tokenizer.json").exists()
    ck = checkpoint.save(b, tmp_path / "ck", max_shard_size="60KB", optimizer=torch.optim.SGD(b.parameters(), 0.1),
                         state={"step": 1})
    checkpoint.save(_model(2), ck)
    assert _same(cuboid.load(str(ck)), _model(2))


# ---------------------------------------------------------------------- case 4: a stale index


def test_a_stale_index_cannot_win(tmp_path):
    """The issue's sequence: save(a, sharded), then to_hf(b) into the same folder: b's weights load, and
    verify agrees; transformers loads b too."""
    a, b, d = _model(0), _model(1), tmp_path / "d"
    checkpoint.save(a, d, max_shard_size="200KB", optimizer=torch.optim.SGD(a.parameters(), 0.1), state={"step": 3})
    assert (d / "model.safetensors.index.json").is_file()
    (d / "notes.md").write_text("mine")
    to_hf(b, d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "notes.md"]
    assert _same(cuboid.load(str(d)), b)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert checkpoint.verify(d)["tensors"] == len(f.keys())  # verify reads b's file, and only it
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(str(d))
    assert torch.equal(hf.transformer.wte.weight, b.tok_emb.weight)


def test_a_folder_with_an_index_beside_a_single_file_is_refused(tmp_path):
    d = checkpoint.save(_model(0), tmp_path / "d", max_shard_size="200KB")
    single = checkpoint.save(_model(1), tmp_path / "s")
    os.replace(single / "model.safetensors", d / "model.safetensors")
    sentence = r"holds both model\.safetensors and model\.safetensors\.index\.json.*remove the stale one"
    for read in (lambda: cuboid.load(str(d)), lambda: checkpoint.verify(d),
                 lambda: checkpoint.load(_model(2), d)):
        with pytest.raises(CheckpointError, match=sentence):
            read()


# ---------------------------------------------------------------- case 5: a config that lies about depth


def test_a_config_deeper_than_its_weights_is_refused_before_building(tmp_path):
    d = checkpoint.save(_model(0), tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, n_layer=20000)))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"config\.json: n_layer is 20000, but the weights hold 2 blocks "
                                              r"\(blocks 0\.\.1\)"):
        cuboid.load(str(d))
    assert time.perf_counter() - t0 < 1.0


# ------------------------------------------------------------------------------ case 6: links


def test_convert_skips_a_companion_linked_out_of_the_folder(tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    src = checkpoint.save(_model(0), tmp_path / "src")
    (src / "notes.txt").symlink_to(secret)
    (src / "README.md").write_text("card")
    (src / "card.md").symlink_to(src / "README.md")  # a link that stays inside: copied
    assert convert_main(["convert", str(src), str(tmp_path / "out"), "--quiet"]) == 0
    out = tmp_path / "out"
    assert not (out / "notes.txt").exists() and (out / "card.md").read_text() == "card"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cuboid convert: warning: skipped notes.txt: a link to ")
    assert "password" not in "".join(p.read_text(errors="ignore") for p in out.iterdir())
    checkpoint.verify(out)
    (src / "config.json").rename(tmp_path / "config.json")
    (src / "config.json").symlink_to(tmp_path / "config.json")
    assert convert_main(["convert", str(src), str(tmp_path / "out2"), "--quiet", "--dtype", "bf16"]) == 2
    assert "config.json is a link to" in capsys.readouterr().err


def test_convert_reads_a_hugging_face_cache_snapshot(tmp_path):
    """The HF cache links every file of snapshots/<rev>/ to ../../blobs/<hash>: shards and companions."""
    src = checkpoint.save(_model(0), tmp_path / "plain", max_shard_size="200KB")
    F.bpe_tokenizer(src)
    repo = tmp_path / "models--x--gpt"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(src.iterdir())):
        os.replace(p, blobs / f"blob{i}")
        (snap / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    out = checkpoint.convert(snap, tmp_path / "out", progress=False)
    assert (out / "tokenizer.json").is_file() and _same(cuboid.load(str(out)), _model(0))


def test_a_symlinked_save_path_keeps_working(tmp_path):
    real = tmp_path / "real"
    checkpoint.save(_model(0), real)
    link = tmp_path / "link"
    link.symlink_to(real)
    for seed in (1, 2):
        checkpoint.save(_model(seed), link)
        assert link.is_symlink() and link.resolve() == real.resolve()
        assert _same(cuboid.load(str(link)), _model(seed))
    to_hf(_model(3), link)
    assert link.is_symlink() and _same(cuboid.load(str(real)), _model(3))


# ------------------------------------------------------------------ case 7: sentences, not tracebacks


def test_a_deeply_nested_index_is_one_line(tmp_path):
    d = checkpoint.save(_model(0), tmp_path / "d", max_shard_size="200KB")
    (d / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    for read in (lambda: cuboid.load(str(d)), lambda: checkpoint.verify(d)):
        with pytest.raises(CheckpointError, match=r"index\.json: not valid JSON \(nested too deeply to read\)"):
            read()
    (d / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON \(nested too deeply"):
        cuboid.load(str(d))


def test_a_string_layer_count_is_one_line(tmp_path, capsys):
    d = checkpoint.save(_model(0), tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, n_layer="2")))
    with pytest.raises(CheckpointError, match=r"config\.json: n_layer is '2', not a whole number"):
        cuboid.load(str(d))
    (d / "config.json").write_text(json.dumps(dict(cfg, n_head="4")))
    with pytest.raises(CheckpointError, match=r"config\.json: n_head is '4', not a number"):
        cuboid.load(str(d))


def test_the_tokenizer_is_inside_the_commit(tmp_path):
    """save(..., tokenizer=) writes it before the commit file and records it: verify sees a changed byte."""
    tok = F.bpe_tokenizer(tmp_path / "tok")
    d = checkpoint.save(_model(0), tmp_path / "final", tokenizer=tok)
    meta = json.loads(__import__("safetensors").safe_open(str(d / "model.safetensors"), "pt").metadata()["cuboid"])
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
    checkpoint.verify(d)
    raw = bytearray((d / "tokenizer.json").read_bytes())
    raw[10] ^= 1
    (d / "tokenizer.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: SHA-256 mismatch"):
        checkpoint.verify(d)
    sharded = checkpoint.save(_model(0), tmp_path / "sharded", tokenizer=tok, max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert "tokenizer.json" in index["metadata"]["files"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(sharded))("hello world")["input_ids"] == tok("hello world")["input_ids"]
