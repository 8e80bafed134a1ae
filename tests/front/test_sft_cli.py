"""`cuboid finetune --task sft --packing` from the command line, as a user runs it, on a small local chat Qwen2
folder under one process, dp=2 and tp1d with LoRA: the loss falls, and `cuboid generate --chat` answers from the
final folder (a LoRA run's adapters merged by `cuboid convert --merge-lora` first)."""
from __future__ import annotations

import pytest

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

ANSWER = "sun moon sun"  # every conversation's answer: a few steps teach it
PLANS = {"single": ("--plan", "single"), "dp2": ("--plan", "dp=2"),
         "tp1d-lora": ("--plan", "tp1d", "--lora", "r=8,alpha=16")}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return CF.hf_chat_qwen2_folder(tmp_path_factory.mktemp("qwen") / "model")


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    rows = [{"messages": [dict(m, content=ANSWER) if m["role"] == "assistant" else m for m in c]}
            for c in CF.conversations(64, seed=7)]
    return CF.write_jsonl(rows, tmp_path_factory.mktemp("data") / "chat.jsonl")


@pytest.mark.parametrize("name", list(PLANS))
def test_sft_packed_run_then_chat(name, qwen, chat_file, tmp_path):
    lora = "--lora" in PLANS[name]
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(qwen), "--data", str(chat_file), "--task", "sft", "--packing",
                     "--max-length", "256", "--steps", "8", "--batch-size", "4", "--lr", "2e-2" if lora else "1e-2",
                     "--log-every", "1", "--eval-every", "8", "--no-progress", "--no-plot", "--output-dir", str(run),
                     *PLANS[name], timeout=900)
    assert rc == 0, err
    assert "task sft" in err and "(packed: 57 documents" in err, err
    losses = [m["loss"] for m in metrics(run)]
    # LoRA's 15k parameters learn this tiny random model slowly (peft's adapters alike): less is asked of them
    assert len(losses) == 8 and losses[-1] < (losses[0] - 0.2 if lora else 0.8 * losses[0]), losses
    final = run / "final"
    if lora:
        assert (final / "adapter_config.json").is_file()
        rc, _, err = cli("convert", str(final), str(tmp_path / "merged"), "--merge-lora", "--quiet")
        assert rc == 0, err
        final = tmp_path / "merged"
    rc, out, err = cli("generate", "--model", str(final), "--chat", "--prompt", "red cat?", "--max-new-tokens", "6")
    assert rc == 0, err
    assert out.strip() and "<|im_start|>" not in out and "red cat?" not in out, out
    if not lora:  # the whole model learned the answer's first word
        assert out.startswith("sun"), out
