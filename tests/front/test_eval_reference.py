"""`cuboid eval --task dpo` on a fine-tune's folder without ``--ref-model``: the reference is the model the run
started from, as the run recorded it (its output folder's ``cuboid-run.json`` for ``final/``, a checkpoint's trainer
state), said in one line; on a folder that records none, one line says the reference is the policy itself (every
reward 0). Read as TRL does: ``rewards/*`` are beta x log(policy / reference)."""
from __future__ import annotations

import json
import shutil

import pytest

import cuboid
from cuboid.cli import main

from . import chat_fixtures as CF
from . import dpo_fixtures as DF


def _eval(capsys, *argv) -> tuple:
    capsys.readouterr()
    assert main(["eval", "--task", "dpo", *argv, "--max-length", "64", "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[-1]), [line for line in err.splitlines() if "reference" in line]


def test_dpo_eval_takes_the_runs_starting_model_as_the_reference(tmp_path, capsys):
    policy, _ = DF.policy_and_reference(tmp_path)
    data = CF.write_jsonl(DF.string_pairs(8), tmp_path / "pairs.jsonl")
    run = tmp_path / "run"
    cuboid.finetune(str(policy), str(data), task="dpo", steps=2, batch_size=4, seq_len=64, lr=1e-2, eval_every=2,
                    output_dir=str(run), progress=False, plot=False)
    want, _ = _eval(capsys, "--model", str(run / "final"), "--ref-model", str(policy), "--data", str(data))
    assert abs(want["rewards/margins"]) > 1e-4 and want["rewards/chosen"] != 0.0, want

    got, said = _eval(capsys, "--model", str(run / "final"), "--data", str(data))
    assert got == want
    assert len(said) == 1 and str(policy.resolve()) in said[0] and "cuboid-run.json" in said[0], said
    # a checkpoint copied out of its run folder: its own trainer state names the start
    shutil.copytree(run / "checkpoint-2", tmp_path / "elsewhere" / "checkpoint-2")
    got, said = _eval(capsys, "--model", str(tmp_path / "elsewhere" / "checkpoint-2"), "--data", str(data))
    assert got == want
    assert len(said) == 1 and "trainer_state.json" in said[0], said

    # a folder no run wrote: the policy is its own reference, and the line says so
    got, said = _eval(capsys, "--model", str(policy), "--data", str(data))
    assert got["rewards/chosen"] == 0.0 and got["rewards/margins"] == 0.0
    assert len(said) == 1 and "the reference is the policy itself" in said[0], said
