"""``cuboid eval --harness``: lm-evaluation-harness's local tasks (YAMLs over local jsonl files, offline) with
cuboid's model as the harness's LM give the figures of the harness's own ``hf`` model on the same folder, on
one device and under tp=2 (one spawned world)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from cuboid.cli import main

from . import fixtures as F

lm_eval = pytest.importorskip("lm_eval", reason="the harness extra is not installed: pip install -e '.[harness]'")

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
ENV.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

TASKS = {  # one task per request type: loglikelihood, loglikelihood_rolling, generate_until
    "tiny_choice": """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_rolling": """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "tiny_generate": """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _tasks(tmp_path):
    rng = random.Random(0)
    rows = []
    for text, label in F.sentences(16, seed=3):
        words = text.split()
        choices = [" " + " ".join(rng.sample(words, 2)) for _ in range(3)]
        rows.append({"question": text, "choices": choices, "answer": label})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = []
    for name, text in TASKS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text.format(data=json.dumps(str(data))))
        files.append(str(path))
    return files


def _figures(results: dict) -> dict:
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}
            for task, metrics in results.items()}


def test_harness_matches_lm_eval_hf_one_device_and_tp2(tmp_path, capsys, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = F.hf_gpt2_folder(tmp_path / "gpt")
    files = _tasks(tmp_path)
    assert main(["eval", "--model", str(folder), "--harness", ",".join(files), "--json"]) == 0
    ours = _figures(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    theirs = simple_evaluate(model="hf", model_args={"pretrained": str(folder), "device": "cpu", "dtype": "float32"},
                             tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path),
                                                                         include_defaults=False),
                             log_samples=False, bootstrap_iters=0)
    theirs = _figures(theirs["results"])
    assert set(ours) == set(TASKS) and ours.keys() == theirs.keys()
    for task in TASKS:
        assert ours[task].keys() == theirs[task].keys(), (task, ours[task], theirs[task])
        for k, v in theirs[task].items():
            assert abs(ours[task][k] - v) <= 1e-4 * max(1.0, abs(v)), (task, k, ours[task][k], v)
    assert 0 < ours["tiny_choice"]["acc,none"] < 1  # a figure that can differ

    # tp=2: the same figures from a two-process world
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "cuboid", "eval", "--model", str(folder), "--plan", "tp=2", "--harness", files[0],
                        "--json"], capture_output=True, text=True, timeout=300, env=ENV, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    tp = _figures(json.loads(p.stdout.strip().splitlines()[-1]))
    for k, v in ours["tiny_choice"].items():
        assert abs(tp["tiny_choice"][k] - v) <= 1e-4, (k, tp["tiny_choice"][k], v)


def test_generate_until_fits_a_model_of_few_positions(tmp_path):
    """Issue 65, item 5.6: a 64-position model under the harness's default max_gen_toks (256) generates within
    its positions (its context keeps at least half of them); a small max_gen_toks keeps the last
    ``positions - max_gen_toks`` context tokens, as the harness's ``hf`` model does."""
    import transformers as T

    import cuboid
    from cuboid.cli.harness import make_lm

    folder = F.hf_gpt2_folder(tmp_path / "gpt")
    model, tok = cuboid.load(str(folder)), T.AutoTokenizer.from_pretrained(folder)
    lm = make_lm(model, tok)
    asked = []
    generate = lm.model.generate

    def spy(prompt, *a, max_new_tokens, **k):
        asked.append((prompt.shape[1], max_new_tokens))
        return generate(prompt, *a, max_new_tokens=max_new_tokens, **k)

    lm.model.generate = spy

    class Request:
        def __init__(self, *args):
            self.args = args

    long = "the cat " * 100
    out = lm.generate_until([Request("the cat sat on", {"until": ["\n"]}), Request(long, {"until": ["\n"]}),
                             Request(long, {"until": ["\n"], "max_gen_toks": 8})])
    assert len(out) == 3 and all(isinstance(t, str) for t in out)
    short = len(tok.encode("the cat sat on"))
    assert asked == [(short, 64 - short), (32, 32), (56, 8)], asked
