"""The README's commands: every ``cuboid finetune`` line in its bash blocks parses with the flags that exist
and names tasks that exist; its DPO, reward-model and QLoRA examples train on tiny local folders as written
(one process: the README's ``--plan dp=2`` left out, a few steps added); its two set-up commands are CI's,
and it says how to get torch's CPU build where the default index gives the CUDA one (issue 65, item 4)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from cuboid.cli import build_parser, main
from cuboid.kernels import use_backend

README = Path(__file__).resolve().parents[2] / "README.md"
TINY = ["--steps", "2", "--batch-size", "8", "--no-progress", "--no-plot"]


def bash_commands(prefix: str) -> list:
    """The README's bash-block lines that start with ``prefix``, continuations joined, comments cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.startswith(prefix):
                out.append(shlex.split(cmd, comments=True))
    return out


def test_every_finetune_line_parses(tmp_path, monkeypatch):
    from cuboid import tasks
    from cuboid.cli.finetune import resolve
    from cuboid.train.config import FinetuneConfig, with_flags, TASK_FLAGS

    commands = [c for c in bash_commands("cuboid finetune") if "..." not in c and "--help" not in c]
    monkeypatch.chdir(tmp_path)  # the GRPO lines' reward functions, which the task imports as it resolves
    (tmp_path / "rewards.py").write_text("def correct(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n"
                                         "format = correct\n")
    names = set()
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        values = resolve(args)
        values.pop("device_default", None)
        cfg = FinetuneConfig(**{k: v for k, v in values.items() if k not in ("nproc_per_node", "max_restarts")})
        task = with_flags(cfg.task, {**{k: getattr(cfg, k) for k in TASK_FLAGS}, **cfg.task_options})
        if task is not None:
            names.add(task.name)
        if cfg.quantize is not None:
            names.add("qlora")
            assert cfg.lora is not None, argv
    assert {"sft", "dpo", "reward", "grpo", "qlora"} <= names, names
    assert all(n in tasks.names() or n == "qlora" for n in names)


def test_setup_commands_and_the_cpu_build():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    for cmd in ('pip install torch==2.13.0 && pip install -e ".[plot]" && cuboid finetune',
                'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile'):
        assert text.count(cmd) == 1, cmd
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[test]"' in ci
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text


def _tiny_folders(root: Path) -> dict:
    import transformers as T

    from .chat_fixtures import hf_chat_qwen2_folder, messages_rows
    from .dpo_fixtures import conversation_pairs

    qwen = hf_chat_qwen2_folder(root / "qwen")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversation_pairs(24, seed=1)))
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in messages_rows(24, seed=1)))
    return {"path/to/qwen2.5-folder": str(qwen)}


@pytest.mark.slow
def test_the_preference_and_qlora_examples_train(tmp_path, monkeypatch, capsys):
    paths = _tiny_folders(tmp_path)
    monkeypatch.chdir(tmp_path)
    maker = next(c for c in bash_commands("python -c") if "AutoModelForSequenceClassification" in " ".join(c))
    code = maker[2].replace("path/to/qwen2.5-folder", paths["path/to/qwen2.5-folder"])
    exec(compile(code, "README.md", "exec"), {})  # the README's own snippet (a fresh interpreter costs more here)
    ran = set()
    for argv in bash_commands("cuboid finetune"):
        if not ({"dpo", "reward"} & set(argv) or "--quantize" in argv):
            continue
        argv = [paths.get(a, a) for a in argv[1:]]
        at = argv.index("--plan")
        argv = argv[:at] + argv[at + 2:]  # one process here
        out = tmp_path / f"run{len(ran)}"
        with use_backend("torch"):
            rc = main([*argv, *TINY, "--output-dir", str(out)])
        assert rc == 0, (argv, capsys.readouterr().err)
        assert (out / "final").is_dir()
        ran.add(argv[argv.index("--task") + 1] + ("+nf4" if "--quantize" in argv else ""))
    assert ran == {"dpo", "reward", "sft+nf4"}, ran
