"""One line, not a traceback (issue 49): every numeric flag of finetune, prepare, eval and generate given 0,
-1 and a huge value, and damaged data files (a malformed row, an empty file, bytes that are not UTF-8, a row
without the expected column), each exit code 2 and one line naming the flag, or the file and its line."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from cuboid.cli import build_parser, main, message

from .test_prepare_cmd import qwen  # noqa: F401 (fixture)

MISSING = "/nonexistent/cuboid-test"
REQUIRED = {"finetune": ["--model", f"{MISSING}/model", "--data", f"{MISSING}/d.jsonl", "--output-dir", "out",
                         "--no-progress"],
            "prepare": ["--model", f"{MISSING}/model", "--data", f"{MISSING}/d.jsonl", "--output", f"{MISSING}/p"],
            "eval": ["--model", f"{MISSING}/model", "--data", f"{MISSING}/d.jsonl"],
            "generate": ["--model", f"{MISSING}/model", "--prompt", "hi"]}
# flags whose range holds 0 (the run goes on to the next error, the missing model or data)
ZERO_IN_RANGE = {"--weight-decay", "--warmup", "--max-grad-norm", "--save-every", "--seed", "--max-restarts",
                 "--show", "--top-k", "--num-fewshot", "--moe-bias-update-rate", "--eval-fraction"}


def numeric_flags(command: str) -> list:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(a.option_strings[0], a.type) for a in sub.choices[command]._actions
            if a.type in (int, float) and a.option_strings]


PROGRESS = re.compile(r"\d+%\||(it|examples)/s\]|\[\d\d:\d\d")  # a progress bar's refresh


def one_line(capsys) -> str:
    """stderr's one line (progress bars aside)."""
    err = capsys.readouterr().err
    lines = [line for line in re.split(r"[\r\n]", err) if line.strip() and not PROGRESS.search(line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", list(REQUIRED))
def test_numeric_flags_are_checked_at_the_door(command, capsys, tmp_path, monkeypatch):
    from cuboid.train.config import task_flags

    monkeypatch.chdir(tmp_path)
    options = {"--" + k.replace("_", "-") for k in task_flags()}  # a task's own options: the task checks them
    flags = numeric_flags(command)
    assert len(flags) >= 5
    for flag, typ in flags:
        for value in ("0", "-1", "1" + "0" * 30 if typ is int else "1e999"):
            rc = main([command, *REQUIRED[command], flag, value])
            line = one_line(capsys)
            assert rc == 2, (flag, value, line)
            if (value == "0" and flag in ZERO_IN_RANGE) or (flag in options and value != "1e999"):
                continue
            assert line.startswith(f"cuboid {command}: error: {flag} "), (flag, value, line)


def damaged(folder) -> dict:
    """name -> (a jsonl file, the line its error names or None)"""
    good = [json.dumps({"text": f"hello world {i}", "messages": [{"role": "user", "content": f"hi {i}"},
                                                                 {"role": "assistant", "content": "yo"}]})
            for i in range(12)]
    files = {"malformed": ("\n".join(good[:2] + ['{"text": "oops'] + good[2:]) + "\n").encode(),
             "empty": b"",
             "not-utf8": ("\n".join(good[:3]) + "\n").encode() + b'{"text": "\xff\xfe"}\n',
             "no-column": ("\n".join(json.dumps({"other": "x"}) for _ in range(12)) + "\n").encode()}
    out = {}
    for name, data in files.items():
        (folder / f"{name}.jsonl").write_bytes(data)
        out[name] = folder / f"{name}.jsonl"
    return out


WANT = {"malformed": "{path}, line 3: not valid JSON", "empty": "{path}: the file is empty",
        "not-utf8": "{path}, line 4: not UTF-8 text (byte 0xff at column 11)"}
NO_COLUMN = {"finetune": "--text-column", "prepare": "--data-format", "eval": "has no column 'text'"}


def test_damaged_data_files_are_one_line_naming_file_and_line(qwen, tmp_path, capsys):  # noqa: F811
    files = damaged(tmp_path)
    for command in ("finetune", "prepare", "eval"):
        for name, path in files.items():
            argv = {"finetune": ["--task", "clm", "--steps", "1", "--batch-size", "2", "--output-dir",
                                 str(tmp_path / "run"), "--no-progress", "--no-plot", "--overwrite-output-dir"],
                    "prepare": ["--output", str(tmp_path / f"p-{name}")], "eval": ["--no-progress"]}[command]
            rc = main([command, "--model", str(qwen), "--data", str(path), *argv])
            line = one_line(capsys)
            assert rc == 2, (command, name, line)
            want = WANT[name].format(path=path) if name in WANT else NO_COLUMN[command]
            assert want in line, (command, name, line)
    prompts = tmp_path / "prompts.txt"
    for data, want in ((b"", "the file is empty"), (b"hello\n\xff there\n", "line 2: not UTF-8 text (byte 0xff")):
        prompts.write_bytes(data)
        assert main(["generate", "--model", str(qwen), "--prompts", str(prompts)]) == 2
        assert f"--prompts {prompts}" in (line := one_line(capsys)) and want in line, line
    prompts.write_text('hello\n{"messages": [{"role": "user"}]}\n')  # --chat: JSON that is not a conversation
    assert main(["generate", "--model", str(qwen), "--prompts", str(prompts), "--chat"]) == 2
    assert f"{prompts}:2: a --prompts line holds JSON" in (line := one_line(capsys)), line


def test_messages_are_whole_and_one_line():
    """What ``cuboid CMD: error:`` prints: never ``e.args[0]`` (an errno, an encoding's name)."""
    assert message(FileNotFoundError(2, "No such file or directory", "/x/y")) == "No such file or directory: /x/y"
    assert message(NotADirectoryError(20, "Not a directory", "out")) == "Not a directory: out"
    assert message(OSError(28, "No space left on device")) == "No space left on device"
    try:
        b"ab\xffc".decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e
    assert message(bad) == "not UTF-8 text: byte 0xff at offset 2 (invalid start byte)"
    assert message(KeyError("no such task 'x'")) == "no such task 'x'"
    assert message(ValueError("first\n  second")) == "first second"


def test_a_failing_chat_template_or_a_turn_without_content_is_one_line(qwen, tmp_path, capsys):  # noqa: F811
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(turn) for _ in range(8)) + "\n"
                    + json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    base = ["prepare", "--model", str(qwen), "--data", str(data), "--eval-fraction", "0.5"]
    assert main([*base, "--output", str(tmp_path / "a")]) == 2
    assert "turn 1 (user) has no 'content'" in one_line(capsys)
    template = tmp_path / "raises.jinja"
    template.write_text("{{ raise_exception('no system turns here') }}")
    data.write_text("\n".join(json.dumps(turn) for _ in range(8)) + "\n")
    assert main([*base, "--output", str(tmp_path / "b"), "--chat-template", str(template)]) == 2
    assert "the chat template failed on the conversation that starts 'hi': TemplateError: no system turns here" \
        in one_line(capsys)


def test_a_tokenizer_without_vocabulary_and_a_template_path_with_braces(tmp_path):
    """A tokenizer_config.json alone loaded as a tokenizer of its special tokens (the next error blamed the
    data); a --chat-template path with a ``{`` in it was read as template text."""
    from cuboid.data.chat import template_of
    from cuboid.data.formats import DataError, load_tokenizer

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<e>"}')
    with pytest.raises(DataError, match=r"tokenizer .*tok: 0 token\(s\) beside its special ones: its vocabulary"):
        load_tokenizer(tmp_path / "tok")
    path = tmp_path / "{odd} name.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert template_of(None, str(path)) == path.read_text()
    assert template_of(None, "{{ messages }}") == "{{ messages }}"  # text, not a path
    with pytest.raises(DataError, match="no such file"):
        template_of(None, str(tmp_path / "missing.jinja"))


def test_rows_without_an_answer_are_counted_apart_from_truncation(tmp_path):
    """"dropped after truncation" also counted the rows that had nothing to learn before it."""
    import datasets

    from cuboid.data.sft import SFTOptions, tokenize_dataset

    from . import chat_fixtures as CF

    tok = CF.chat_tokenizer(tmp_path / "tok", "qwen2")
    rows = CF.messages_rows(6, seed=1)
    rows += [{"messages": [{"role": "user", "content": "only a question"}]}] * 2  # no assistant turn
    rows += [{"messages": [{"role": "user", "content": "alpha " * 60}, {"role": "assistant", "content": "b"}]}]
    out, stats = tokenize_dataset(datasets.Dataset.from_list(rows), tok, SFTOptions(max_length=48))
    answered = [r for r in rows if len(r["messages"]) > 1]
    _, alone = tokenize_dataset(datasets.Dataset.from_list(answered), tok, SFTOptions(max_length=48))
    assert (stats.no_answer, alone.no_answer, stats.examples) == (2, 0, 9)
    assert stats.dropped == alone.dropped >= 1 and stats.kept == len(out) == 7 - alone.dropped


def test_plans_past_the_enumeration_bound_say_so_at_once(capsys):
    """``cuboid plans --gpus 4096`` did not finish in 120 s: the world is bounded at the door."""
    import time

    t0 = time.perf_counter()
    assert main(["plans", "--model", "gpt2", "--gpus", "4096"]) == 2
    assert one_line(capsys).startswith("cuboid plans: error: --gpus 4096: must be in [1, 1024]")
    assert time.perf_counter() - t0 < 10


def _reward_folder(folder):
    """A tiny random one-output Qwen2ForSequenceClassification with the chat tokenizer."""
    import transformers as T

    from . import chat_fixtures as CF

    tok = CF.chat_tokenizer(folder, "qwen2")
    cfg = T.Qwen2Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=48, vocab_size=len(tok), max_position_embeddings=256, num_labels=1,
                        tie_word_embeddings=True, pad_token_id=None, eos_token_id=tok.eos_token_id)
    T.Qwen2ForSequenceClassification(cfg).save_pretrained(str(folder))
    return folder


def test_bad_preference_records_are_one_line_naming_file_and_line(qwen, tmp_path, capsys):  # noqa: F811
    """Issue 65, item 5.5: DPO's and reward's records checked as SFT's, each failure one line with the file and
    the record's 1-based line: a row without chosen, a turn whose content is a number, a turn without one, a
    template the sandbox refuses, a null margin; and SFT's content of 5 as well."""
    from . import chat_fixtures as CF
    from . import dpo_fixtures as DF

    good = DF.conversation_pairs(8)

    def damaged(name, line, change):
        rows = json.loads(json.dumps(good))
        rows[line - 1] = change(rows[line - 1])
        return CF.write_jsonl(rows, tmp_path / f"{name}.jsonl")

    def content(value):
        def change(r):
            r["chosen"][0]["content"] = value
            if value is None:
                del r["chosen"][0]["content"]
            return r
        return change

    cases = [(damaged("no-chosen", 4, lambda r: {"rejected": r["rejected"]}), 4, "the record has no chosen"),
             (damaged("content-5", 6, content(5)), 6, "chosen's turn 1 (assistant) has a content of type int (5)"),
             (damaged("no-content", 7, content(None)), 7, "chosen's turn 1 (assistant) has no 'content'")]
    bad = tmp_path / "sandbox.jinja"
    bad.write_text("{{ messages.__class__.__mro__ }}")
    rm = _reward_folder(tmp_path / "rm")
    run = ["--steps", "1", "--batch-size", "2", "--no-progress", "--no-plot", "--overwrite-output-dir"]
    for task, model in (("dpo", qwen), ("reward", rm)):
        for path, line, want in cases:
            rc = main(["finetune", "--task", task, "--model", str(model), "--data", str(path), "--output-dir",
                       str(tmp_path / "out"), *run])
            said = one_line(capsys)
            assert rc == 2 and f"data {path}, line {line}: {want}" in said, (task, path.name, said)
        rc = main(["finetune", "--task", f"{task},chat_template={bad}", "--model", str(model), "--data",
                   str(CF.write_jsonl(good, tmp_path / "good.jsonl")), "--output-dir", str(tmp_path / "out"), *run])
        said = one_line(capsys)
        assert rc == 2 and "the chat template failed on the conversation that starts" in said \
            and "SecurityError: access to attribute '__class__'" in said and ", line " in said, said
    rows = DF.string_pairs(6)
    for r in rows:
        r["margin"] = 0.5
    rows[2]["margin"] = None
    path = CF.write_jsonl(rows, tmp_path / "margin.jsonl")
    assert main(["finetune", "--task", "reward", "--model", str(rm), "--data", str(path), "--output-dir",
                 str(tmp_path / "out"), *run]) == 2
    assert f"data {path}, line 3: margin None is not a number" in one_line(capsys)
    sft = CF.messages_rows(6)
    sft[4]["messages"][1]["content"] = 5
    path = CF.write_jsonl(sft, tmp_path / "sft.jsonl")
    assert main(["finetune", "--task", "sft", "--model", str(qwen), "--data", str(path), "--output-dir",
                 str(tmp_path / "out"), *run]) == 2
    assert "turn 2 (user) has a content of type int (5)" in one_line(capsys)
