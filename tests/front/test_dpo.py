"""``--task dpo`` end to end: ``cuboid eval --task dpo`` against TRL 1.16's ``DPOTrainer.evaluate``, and
``cuboid finetune --task dpo`` on one device, under dp=2 and pp=2, and with LoRA.

The policy is a tiny random chat Qwen2 and the reference the same model drawn with another seed
(tests/front/dpo_fixtures.py). TRL runs in fp32 (``bf16=False``: its default on CPU is bf16 autocast, which
its reference forward uses), with the reference model live (no precompute), all pairs in one eval batch
(its metrics are per-batch means), ``max_length=64`` (some answers are cut; one string pair's prompt alone
fills it, and both drop that pair). One TRL trainer per data kind is re-aimed at each loss type (its
``beta``, ``loss_types``, ``loss_weights``, ``label_smoothing`` attributes).

Whole dialogues (no prompt column) are checked to make the prompted pairs' tensors. The multi-process checks
run in ONE 2-rank world (:func:`world_checks`): eval under tp=2 and pp=2 equals one device (and so TRL), and
fine-tunes under dp=2 and pp=2 end with one device's weights (1e-4).
"""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.front.chat_fixtures import write_jsonl
from tests.front.dpo_fixtures import conversation_pairs, policy_and_reference, string_pairs
from tests.parallel.launch import run_world

N = 10          # pairs per file
MAX_LENGTH = 64
TOL = 2e-5
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")
LOSSES = [  # (loss_type, loss_weights, label_smoothing, beta)
    ("sigmoid", None, 0.0, 0.1), ("ipo", None, 0.0, 0.5), ("hinge", None, 0.0, 0.3), ("robust", None, 0.1, 0.1),
    ("apo_zero", None, 0.0, 0.2), ("bco_pair", None, 0.0, 0.1), ("sigmoid+bco_pair+sft", "0.8+0.2+1.0", 0.0, 0.1)]
FINETUNE = dict(steps=4, batch_size=4, lr=5e-3, seq_len=MAX_LENGTH, eval_fraction=0.2, eval_every=100,
                warmup=0, progress=False, plot=False, seed=0, log_every=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    policy, ref = policy_and_reference(root)
    strings = string_pairs(N)
    strings.append({"prompt": "Question: " + " ".join(["alpha"] * 70) + "?", "chosen": " a", "rejected": " b"})
    data = {"string": write_jsonl(strings, root / "string.jsonl"),
            "conversation": write_jsonl(conversation_pairs(N), root / "conversation.jsonl"),
            "whole": write_jsonl(conversation_pairs(N, seed=3, whole=True), root / "whole.jsonl")}
    return root, policy, ref, data


def trl_metrics(policy, ref, path, losses) -> list:
    """TRL's eval metrics (no eval_ prefix) for each (loss_type, weights, smoothing, beta) of ``losses``."""
    import datasets
    import transformers as T
    from trl import DPOConfig, DPOTrainer

    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    tok = T.AutoTokenizer.from_pretrained(policy)
    args = DPOConfig(output_dir=str(Path(path).parent / "trl"), per_device_eval_batch_size=len(ds),
                     max_length=MAX_LENGTH, report_to="none", use_cpu=True, bf16=False, dataloader_num_workers=0)
    trainer = DPOTrainer(model=T.AutoModelForCausalLM.from_pretrained(policy),
                         ref_model=T.AutoModelForCausalLM.from_pretrained(ref), args=args, train_dataset=ds,
                         eval_dataset=ds, processing_class=tok)
    out = []
    for kind, weights, smoothing, beta in losses:
        kinds = kind.split("+")
        trainer.beta, trainer.loss_types, trainer.label_smoothing = beta, kinds, smoothing
        trainer.loss_weights = [float(w) for w in weights.split("+")] if weights else [1.0] * len(kinds)
        m = trainer.evaluate()
        out.append({k: m["eval_" + k] for k in KEYS})
    return out


def cuboid_metrics(policy, ref, path, losses, plan=None) -> list:
    """cuboid's metrics for each of ``losses``: the reference's log-probs computed once, then evaluate()."""
    import datasets

    import cuboid
    from cuboid.data.formats import eval_batches, load_tokenizer
    from cuboid.tasks import get
    from cuboid.train.step import evaluate

    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    model, tok = cuboid.load(str(policy), plan), load_tokenizer(str(policy))
    first = get("dpo")(ref_model=str(ref))
    data = first.rows(ds, config=model.config, tokenizer=tok, seq_len=MAX_LENGTH)
    data = first.with_model(model, [data], device=torch.device("cpu"))[0]
    out = []
    for kind, weights, smoothing, beta in losses:
        task = get("dpo")(loss_type=kind, loss_weights=weights, label_smoothing=smoothing, beta=beta)
        m = evaluate(model, eval_batches(data, len(ds), width_multiple=8), task=task)
        out.append({k: m["eval_" + k] for k in KEYS})
    return out


def close(got: dict, want: dict, what: str) -> None:
    for k in KEYS:
        assert got[k] == pytest.approx(want[k], rel=TOL, abs=TOL), f"{what}: {k} {got[k]} != {want[k]}"


@pytest.mark.parametrize("kind", ["string", "conversation"])
def test_eval_equals_trl(folders, kind, capsys):
    from cuboid.cli import main

    _, policy, ref, data = folders
    losses = LOSSES
    want = trl_metrics(policy, ref, data[kind], losses)
    got = cuboid_metrics(policy, ref, data[kind], losses)
    for (loss, *_), g, w in zip(losses, got, want):
        close(g, w, f"{kind} {loss}")
    # the command itself, once: one JSON line, the keys without eval_
    capsys.readouterr()
    rc = main(["eval", "--task", "dpo", "--model", str(policy), "--ref-model", str(ref), "--data", str(data[kind]),
               "--max-length", str(MAX_LENGTH), "--batch-size", "4", "--beta", str(losses[-1][3]), "--loss-type",
               losses[-1][0], *(["--loss-weights", losses[-1][1]] if losses[-1][1] else []), "--json"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and set(json.loads(line)) == set(KEYS)
    if "sft" not in losses[-1][0]:  # (sft is a token mean per batch: batches of 4 differ from TRL's one batch)
        close(json.loads(line), want[-1], f"{kind} cli")


def test_whole_dialogues_take_their_shared_turns_as_the_prompt(folders):
    """Two whole dialogues (no prompt column) make the same tensors as the same pairs with the prompt apart
    (whose tensors the eval test checks against TRL's)."""
    import datasets

    from cuboid.data.formats import load_tokenizer
    from cuboid.data.pairs import pair_rows

    _, policy, _, data = folders
    tok = load_tokenizer(str(policy))
    whole = datasets.load_dataset("json", data_files=str(data["whole"]), split="train")
    apart = datasets.Dataset.from_list(conversation_pairs(N, seed=3))
    assert "prompt" not in whole.column_names
    a, b = pair_rows(whole, tok, MAX_LENGTH), pair_rows(apart, tok, MAX_LENGTH)
    assert all(torch.equal(a[k], b[k]) for k in a) and int((a["labels"] != -100).sum()) > 0


def test_prepare_shows_pairs_and_its_rows_read_back_as_the_pairs(folders, capsys):
    import datasets

    from cuboid.cli import main
    from cuboid.data.formats import load_tokenizer
    from cuboid.data.pairs import pair_rows
    from cuboid.tasks import get

    root, policy, _, data = folders
    capsys.readouterr()
    assert main(["prepare", "--task", "dpo", "--model", str(policy), "--data", str(data["string"]), "--output",
                 str(root / "prepared"), "--max-length", str(MAX_LENGTH), "--show", "4", "--eval-fraction", "0.2"]) == 0
    shown = capsys.readouterr().out
    assert "train row 3" in shown and shown.count("[[") >= 4
    rows = datasets.load_from_disk(str(root / "prepared" / "train"))
    tok = load_tokenizer(str(policy))
    back = get("dpo")().rows(rows, config=SimpleNamespace(n_positions=MAX_LENGTH), tokenizer=tok)
    assert back["input_ids"].shape[:2] == (len(rows) // 2, 2)
    # each pair read back is one that pair_rows makes from the records (the train split's, in its order)
    source = datasets.load_dataset("json", data_files=str(data["string"]), split="train")
    whole = pair_rows(source, tok, MAX_LENGTH)

    def pairs(t):
        return [tuple(tuple(t[k][i, j][t["attention_mask"][i, j].bool()].tolist()) for k in ("input_ids", "labels")
                      for j in (0, 1)) for i in range(t["input_ids"].shape[0])]

    assert set(pairs(back)) <= set(pairs(whole)) and len(set(pairs(back))) == len(rows) // 2


def test_eval_refuses_bad_input_and_perplexity_prints_json(folders, capsys):
    from cuboid.cli import main

    root, policy, ref, data = folders
    assert main(["eval", "--task", "dpo", "--model", str(policy), "--data", str(data["string"]), "--loss-type",
                 "nope"]) == 2
    assert "unknown DPO loss type nope" in capsys.readouterr().err
    assert main(["eval", "--model", str(policy), "--data", str(data["string"]), "--beta", "0.2"]) == 2
    assert "need --task" in capsys.readouterr().err
    text = root / "held_out.txt"  # the perplexity eval's --json: one line of its figures
    text.write_text("alpha beta gamma delta. " * 20)
    assert main(["eval", "--model", str(policy), "--data", str(text), "--max-length", "32", "--json",
                 "--no-progress"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures) == {"loss", "perplexity", "tokens", "windows"}
    assert figures["perplexity"] == pytest.approx(math.exp(figures["loss"]), rel=1e-9)


def finetune(policy, data, out, **options) -> dict:
    import cuboid

    cuboid.finetune(str(policy), str(data), task="dpo", output_dir=str(out), **{**FINETUNE, **options})
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def weights_of(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_lora_writes_adapters_peft_loads(folders):
    import peft
    import transformers as T

    root, policy, _, data = folders
    rows = finetune(policy, data["conversation"], root / "lora", steps=1, lora="r=4,alpha=8,targets=attn+mlp")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the reference is the base: adapters off
    model = peft.PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(policy), str(root / "lora" / "final"))
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and any(float(p.abs().sum()) > 0 for p in b)


def world_checks(policy, ref, data, one_eval, root) -> dict:
    """On each of 2 ranks: eval under tp=2 and pp=2 against one device's figures, then a fine-tune under dp=2
    and under pp=2 (their final/ folders are compared by the caller)."""
    import torch.distributed as dist

    for plan in ("tp1d", "pp2"):
        got = cuboid_metrics(policy, ref, data, LOSSES[:1], plan=plan)
        for (loss, *_), g, w in zip(LOSSES[:1], got, one_eval):
            close(g, w, f"{plan} {loss}")
    for plan in ("dp", "pp2"):
        finetune(policy, data, Path(root) / plan, plan=plan)
    return {"rank": dist.get_rank()}


def test_finetune_lowers_the_dpo_loss_and_plans_equal_one_device(folders):
    root, policy, ref, data = folders
    one_eval = cuboid_metrics(policy, ref, data["string"], LOSSES[:1])
    rows = finetune(policy, data["string"], root / "single")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(rows[0]["rewards/margins"]) < 1e-5
    assert {"rewards/chosen", "rewards/accuracies", "logps/rejected", "eval_rewards/margins"} <= set(rows[-1])
    trained = cuboid_metrics(root / "single" / "final", policy, data["string"], LOSSES[:1])[0]
    assert trained["loss"] < math.log(2) and trained["rewards/margins"] > 0  # against its start, on its pairs
    run_world(world_checks, 2, str(policy), str(ref), str(data["string"]), one_eval, str(root), timeout=400)
    want = weights_of(root / "single" / "final")
    moved = max(float((want[k] - v).abs().max()) for k, v in weights_of(policy).items() if k in want)
    assert moved > 1e-3  # the fine-tune changed the weights
    for plan in ("dp", "pp2"):
        got = weights_of(root / plan / "final")
        assert sorted(got) == sorted(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{plan} {k}: {m}")
