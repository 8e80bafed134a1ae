"""`cuboid finetune --task sft --packing` from the command line, as a user runs it, on a small local chat Qwen2
folder under one process, dp=2 and tp1d with LoRA: the loss falls, and `cuboid generate --chat` answers from the
final folder (a LoRA run's adapters merged by `cuboid convert --merge-lora` first)."""
from __future__ import annotations

import pytest

from . import chat_fixtures as CF
from .test_finetune import cli, cli_here, metrics

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
def test_sft_packed_run_then_chat(name, qwen, chat_file, tmp_path, capsys):
    lora = "--lora" in PLANS[name]
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(qwen), "--data", str(chat_file), "--task", "sft", "--packing",
                     "--max-length", "256", "--steps", "12", "--batch-size", "4", "--lr", "2e-2" if lora else "1e-2",
                     "--log-every", "1", "--eval-every", "12", "--no-progress", "--no-plot", "--output-dir", str(run),
                     *PLANS[name], timeout=900)
    assert rc == 0, err
    assert "task sft" in err and "(packed: 57 documents" in err, err
    losses = [m["loss"] for m in metrics(run)]
    # LoRA's 15k parameters learn this tiny random model slowly (peft's adapters alike): less is asked of them
    assert len(losses) == 12 and losses[-1] < (losses[0] - 0.2 if lora else 0.8 * losses[0]), losses
    final = run / "final"
    if lora:
        assert (final / "adapter_config.json").is_file()
        assert cli_here("convert", str(final), str(tmp_path / "merged"), "--merge-lora", "--quiet") == 0
        final = tmp_path / "merged"
    # convert and generate in this process (their fresh-process runs: test_generate_cli, test_generate_chat)
    capsys.readouterr()
    rc = cli_here("generate", "--model", str(final), "--chat", "--prompt", "red cat?", "--max-new-tokens", "6")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() and "<|im_start|>" not in out and "red cat?" not in out, out
    if not lora:  # the whole model learned the answer's first word
        assert out.startswith("sun"), out


def test_sft_flags_and_config_keys(tmp_path, capsys):
    """The SFT flags reach FinetuneConfig by their names, from the command line and from a --config file
    (max_length is seq_len's other spelling there too), and --help shows the data formats."""
    from cuboid.cli import build_parser
    from cuboid.cli.finetune import resolve
    from cuboid.train.config import FinetuneConfig

    parser = build_parser()
    args = parser.parse_args(["finetune", "--model", "m", "--task", "sft", "--max-length", "512", "--train-on-prompt",
                              "--template", "alpaca", "--data-format", "alpaca", "--streaming", "--shuffle-buffer",
                              "64", "--chat-template", "t.jinja"])
    values = resolve(args)
    assert {k: values[k] for k in ("seq_len", "train_on_prompt", "template", "data_format", "streaming",
                                   "shuffle_buffer", "chat_template")} == dict(
        seq_len=512, train_on_prompt=True, template="alpaca", data_format="alpaca", streaming=True,
        shuffle_buffer=64, chat_template="t.jinja")
    FinetuneConfig(**values)  # every key is a field
    (tmp_path / "run.toml").write_text('model = "m"\ntask = "sft"\nmax-length = 300\ntrain_on_prompt = true\n'
                                       'data_format = "messages"\n')
    values = resolve(parser.parse_args(["finetune", "--config", str(tmp_path / "run.toml"), "--seq-len", "200"]))
    assert values["seq_len"] == 200 and values["train_on_prompt"] is True and values["data_format"] == "messages"
    assert "max_length" not in values
    (tmp_path / "both.toml").write_text("seq_len = 1\nmax_length = 2\n")
    with pytest.raises(ValueError, match="give seq_len or max_length, not both"):
        resolve(parser.parse_args(["finetune", "--config", str(tmp_path / "both.toml")]))
    with pytest.raises(SystemExit):
        parser.parse_args(["finetune", "--help"])
    shown = capsys.readouterr().out
    for line in ("messages           messages: [{role, content}, ...]", "prompt_completion  prompt, completion",
                 "alpaca             instruction, input, output", '{"messages": [{"role": "user"'):
        assert line in shown, line
