"""What a user does with a ``checkpoint-<step>/`` between steps: ``cuboid generate`` and ``cuboid eval`` on it, as on
``final/``. Every checkpoint holds the run's tokenizer (HF's Trainer saves it in each), and a LoRA checkpoint's
``adapter_config.json`` names its base (peft's ``base_model_name_or_path``), so it loads with no other flag."""
from __future__ import annotations

import json

import pytest
import torch

import cuboid

from . import fixtures as F
from .test_finetune import cli_here


def _run(tmp_path, lora=None):
    import datasets

    base = F.hf_qwen2_folder(tmp_path / "qwen")
    rows = F.sentences(24)
    data = datasets.Dataset.from_dict({"text": [t for t, _ in rows]})
    out = tmp_path / "run"
    cuboid.finetune(str(base), data, task="causal", steps=2, batch_size=4, seq_len=16, lr=1e-2, lora=lora,
                    save_every=1, eval_every=2, output_dir=str(out), progress=False, plot=False)
    (tmp_path / "held.txt").write_text("\n".join(t for t, _ in F.sentences(8, seed=3)))
    return base, out


def _generate_and_eval(folder, held, capsys) -> str:
    capsys.readouterr()
    rc = cli_here("generate", "--model", str(folder), "--prompt", "the film was", "--max-new-tokens", "3")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("the film was"), out
    rc = cli_here("eval", "--model", str(folder), "--data", str(held), "--json", "--no-progress")
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])["loss"]


def test_a_full_checkpoint_generates_and_evaluates(tmp_path, capsys):
    base, out = _run(tmp_path)
    ckpt = out / "checkpoint-1"
    assert (ckpt / "tokenizer.json").read_bytes() == (out / "final" / "tokenizer.json").read_bytes()
    loss = _generate_and_eval(ckpt, tmp_path / "held.txt", capsys)
    assert loss == pytest.approx(_generate_and_eval(out / "checkpoint-2", tmp_path / "held.txt", capsys), rel=0.5)


def test_a_lora_checkpoint_names_its_base_generates_and_evaluates(tmp_path, capsys):
    base, out = _run(tmp_path, lora="r=4,alpha=8")
    ckpt = out / "checkpoint-2"
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base.resolve())
    assert cfg == json.loads((out / "final" / "adapter_config.json").read_text())
    assert (ckpt / "tokenizer.json").read_bytes() == (out / "final" / "tokenizer.json").read_bytes()
    # the step-2 checkpoint holds the adapters final/ holds: the same model, loaded from either
    ids = torch.tensor([[3, 8, 12, 5, 9]])
    with torch.no_grad():
        a = cuboid.load(str(ckpt)).eval()(input_ids=ids).logits
        b = cuboid.load(str(out / "final")).eval()(input_ids=ids).logits
    assert torch.equal(a, b)
    held = tmp_path / "held.txt"
    assert _generate_and_eval(ckpt, held, capsys) == pytest.approx(_generate_and_eval(out / "final", held, capsys))
    # a resume from it still reads it as a training checkpoint (the tokenizer's files are recorded, not in the way)
    cuboid.finetune(str(base), str(held), task="causal", steps=3, batch_size=4, seq_len=16, lr=1e-2,
                    lora="r=4,alpha=8", save_every=1, eval_every=3, output_dir=str(out), resume=str(ckpt),
                    progress=False, plot=False)
    assert (out / "checkpoint-3" / "tokenizer.json").is_file()
