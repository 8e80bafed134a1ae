"""What a new user meets first (issue 51): ``cuboid --help`` says what the library is now, every help is plain
text, ``--output`` and ``--output-dir`` are one flag in prepare and finetune, an unknown flag is named with
its subcommand (and the flag it may have meant), bad LoRA / plan / task values are one line, a small data
file trains with its batch reduced to it (one line) and at least one warmup step, and the ``datasets``
library's progress bars show only with ``--verbose``."""
from __future__ import annotations

import argparse
import re

import pytest

from cuboid.cli import build_parser, main
from cuboid.train.sizes import fit_batch

from . import chat_fixtures as CF

MISSING = "/nonexistent/cuboid-test"
BAR = re.compile(r"examples/s|Generating train split|Map( \(num_proc=\d+\))?:")  # a datasets progress bar


def subcommands() -> dict:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_help_describes_the_library_in_plain_text(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "GPT, BERT and ViT" not in out
    for word in ("Qwen3", "Gemma 3", "mixtures of experts", "sft", "dpo", "grpo", "LoRA", "ZeRO", "pipeline"):
        assert word in out, word
    for name, parser in subcommands().items():
        text = parser.format_help()
        assert not re.search(r":[a-z]+:`|``", text), (name, re.search(r".{30}(:[a-z]+:`|``).{30}", text))


def test_output_spellings_and_an_unknown_flag(capsys):
    parser = build_parser()
    assert parser.parse_args(["prepare", "--data", "d", "--output-dir", "x"]).output == "x"
    assert parser.parse_args(["prepare", "--data", "d", "--output", "x"]).output == "x"
    assert parser.parse_args(["finetune", "--output", "x"]).output_dir == "x"
    assert parser.parse_args(["finetune", "--output-dir", "x"]).output_dir == "x"
    for argv, want in [
        (["finetune", "--learning-rate", "1e-4"], "cuboid finetune: error: unrecognized arguments: --learning-rate "
                                                  "1e-4; --learning-rate: did you mean --lr? (cuboid finetune --help "
                                                  "lists the flags)"),
        (["finetune", "--lerning-rate", "1e-4"], "cuboid finetune: error: unrecognized arguments: --lerning-rate "
                                                 "1e-4; --lerning-rate: did you mean --lr? (cuboid finetune --help "
                                                 "lists the flags)"),
        (["generate", "--model", "m", "--promt", "hi"], "cuboid generate: error: unrecognized arguments: --promt hi; "
                                                        "--promt: did you mean --prompt? (cuboid generate --help lists "
                                                        "the flags)")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == want + "\n", err


@pytest.mark.parametrize("flags, says", [
    (["--lora", "r=abc"], "LoRA option 'r=abc': r takes a whole number"),
    (["--lora", "r=8,alpha=big"], "LoRA option 'alpha=big': alpha takes a number"),
    (["--plan", "dp=abc"], "plan field dp must be a whole number >= 1, got 'abc'"),
    (["--task", "sft,train_on_prompt=maybe"], "option train_on_prompt takes true or false, not 'maybe'")])
def test_bad_option_values_are_one_line(flags, says, capsys):
    rc = main(["finetune", "--model", f"{MISSING}/model", "--data", f"{MISSING}/d.jsonl", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("cuboid finetune: error: ") and says in err, err


def test_batch_fits_the_plan():
    assert fit_batch(32, 40) == (32, None)
    assert fit_batch(32, 18) == (18, "cuboid finetune: --batch-size 32 is larger than the 18 training examples: "
                                     "batches of 18")
    batch, line = fit_batch(32, 15, dp=2)
    assert batch == 14 and line.endswith("batches of 14 (a multiple of 2, as the plan splits it)")
    assert fit_batch(64, 15, per=4, dp=2)[0] == 60  # GRPO: 4 completions a prompt, rows split over 2 ranks
    with pytest.raises(ValueError, match="needs a multiple of 8 rows"):
        fit_batch(32, 3, dp=8)


def test_small_data_trains_quietly_with_a_warmup_step(tmp_path, capsys):
    model = CF.hf_chat_qwen2_folder(tmp_path / "model")
    data = CF.write_jsonl(CF.messages_rows(20, seed=5), tmp_path / "chat.jsonl")
    rc = main(["finetune", "--model", str(model), "--data", str(data), "--task", "sft", "--max-length", "256",
               "--no-progress", "--no-plot", "--output-dir", str(tmp_path / "run")])  # the default batch: 32
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [line for line in err.splitlines() if "larger than" in line] == [
        "cuboid finetune: --batch-size 32 is larger than the 18 training examples: batches of 18"], err
    assert "1 steps of 18" in err and "1 warmup steps" in err, err
    assert not BAR.search(err), err  # datasets' bars are off by default
    fresh = CF.write_jsonl(CF.messages_rows(20, seed=6), tmp_path / "more.jsonl")  # (not in datasets' cache)
    rc = main(["prepare", "--model", str(model), "--data", str(fresh), "--output-dir", str(tmp_path / "p"),
               "--verbose"])
    err = capsys.readouterr().err
    assert rc == 0 and BAR.search(err), err
