"""A GRPO run resumed inside a generation (``num_iterations`` 2, its ``checkpoint-3`` between the generation's
two steps) is the uninterrupted run: the same final weights, bit for bit (``torch.equal``), in one process and
under ``dp=2``; the resumed run logs the same metrics rows (the generation's reward figures, ``num_tokens``).
The rollout the next step reuses (its batch, ``old_logps``, figures) travels in the checkpoint's trainer state
(:class:`cuboid.tasks.rollout.Rollouts`)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.front.fixtures import hf_qwen2_folder
from tests.front.test_grpo_finetune import finetune, grpo
from tests.parallel.launch import run_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return hf_qwen2_folder(tmp_path_factory.mktemp("qwen2"))


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def whole_and_resumed(folder: str, root: str, plan=None, beta: float = 0.0, **options) -> tuple:
    """4 steps of 2 generations saved every step, and steps 4 resumed from ``checkpoint-3`` (mid-generation):
    (both runs' final weights equal bit for bit, the names that differ, both runs' metrics rows)."""
    task = dict(num_iterations=2, beta=beta)
    root = Path(root)
    whole = finetune(Path(folder), root / "whole", steps=4, task=grpo(**task), save_every=1, keep=4, plan=plan,
                     **options)
    part = finetune(Path(folder), root / "part", steps=4, task=grpo(**task), plan=plan,
                    resume=str(root / "whole" / "checkpoint-3"), **options)
    a, b = weights(root / "whole"), weights(root / "part")
    differ = sorted(k for k in a if not torch.equal(a[k], b[k]))
    return bool(a) and a.keys() == b.keys(), differ, whole, part


def check(same_keys, differ, whole, part):
    assert same_keys
    assert not differ, f"weights differ after a mid-generation resume: {differ[:4]}"
    assert [r["step"] for r in part] == [4]
    for key in ("reward", "reward_std", "num_tokens", "completions/mean_length"):
        assert part[0][key] == whole[3][key], key


def test_resume_inside_a_generation_is_exact(qwen2, tmp_path):
    check(*whole_and_resumed(str(qwen2), str(tmp_path)))


def test_resume_inside_a_generation_is_exact_lora_beta(qwen2, tmp_path):
    """LoRA adapters (their checkpoint keeps the rollout too), with beta > 0: ref_logps reused as well."""
    check(*whole_and_resumed(str(qwen2), str(tmp_path), beta=0.04, lora="r=4,alpha=8,targets=attn+mlp"))


def test_resume_inside_a_generation_is_exact_beta_full(qwen2, tmp_path):
    """beta > 0 without LoRA: the resumed run's frozen reference is the starting model again."""
    check(*whole_and_resumed(str(qwen2), str(tmp_path), beta=0.04))


def test_resume_inside_a_generation_is_exact_dp2(qwen2, tmp_path):
    check(*run_world(whole_and_resumed, 2, str(qwen2), str(tmp_path), "dp", timeout=600)[0])


REWARD = """
def reward_ae(prompts, completions, **columns):
    return [sum(ch in "ae" for ch in c) / max(len(c), 1) for c in completions]
"""


def test_elastic_restart_inside_a_generation_is_exact_dp2(qwen2, tmp_path):
    """``cuboid finetune --plan dp=2 --max-restarts 1``, rank 1 killed in step 4 (fault_job.py): the restart
    resumes ``checkpoint-3``, between generation 3's two iterations, and ends as the uninterrupted run."""
    import json
    import os
    import re
    import sys

    from tests.front.test_faults import ROOT, launch, tensors
    from tests.front.test_grpo_finetune import PROMPTS

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    (tmp_path / "rewards.py").write_text(REWARD)
    args = ["finetune", "--model", str(qwen2), "--task", "grpo", "--data", str(tmp_path / "prompts.jsonl"),
            "--reward", f"{tmp_path / 'rewards.py'}:reward_ae", "--num-generations", "4", "--num-iterations", "2",
            "--max-completion-length", "8", "--batch-size", "8", "--steps", "4", "--save-every", "1", "--plan",
            "dp=2", "--lr", "1e-2", "--log-every", "1", "--no-progress", "--no-plot"]
    launch([sys.executable, "-m", "cuboid", *args, "--output-dir", str(tmp_path / "whole")], what="the reference")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    err, = launch([sys.executable, "-m", "tests.front.fault_job", *args, "--output-dir", str(tmp_path / "run"),
                   "--max-restarts", "1", "--timeout-s", "60"], env={"CUBOID_FAULT": "1:4:step", "PYTHONPATH": path},
                  what="the dp=2 run killed in step 4")
    assert re.findall(r"resumed from \S+ at step (\d+) \(restart 1\)", err) == ["3"], err[-2000:]
    a, b = tensors(tmp_path / "run" / "checkpoint-4"), tensors(tmp_path / "whole" / "checkpoint-4")
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ from the uninterrupted run's, first {differ[0]}"
