"""Task ``reward`` against TRL 1.16's RewardTrainer, on a tiny random Qwen2ForSequenceClassification (one output)
with a chat tokenizer, built here (nothing downloaded).

- rows: the pairs' token ids are TRL's (its ``_prepare_dataset``: EOS on plain text, prompt + answer as one
  sequence, conversations through the chat template, whole dialogues), in the pair layout, too-long pairs dropped;
- ``cuboid eval --task reward --json``: ``loss``, ``accuracy`` and ``margin`` equal ``RewardTrainer.evaluate``'s
  (one batch of every pair, fp32) on string pairs with a ``margin`` column and ``center_rewards_coefficient``,
  and on conversational pairs;
- ``cuboid finetune --task reward`` on a GPT-2 preset: the loss falls, and ``final/`` loads with
  ``AutoModelForSequenceClassification`` (GPT2ForSequenceClassification) to the zoo model's scores;
- a hand-built pair batch (interleaved rows) through ``cuboid.train_step(..., task=reward)``: TRL's loss on it.
"""
from __future__ import annotations

import contextlib
import io
import json
import random

import pytest
import torch

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

COEF = 0.01


def string_pairs(n: int, seed: int = 0) -> list[dict]:
    """Plain-text pairs with a ``margin`` each; answers of very different lengths."""
    rng = random.Random(seed)
    return [{"prompt": f"Question: {CF._words(rng, 2, 6)}? Answer:", "chosen": " " + CF._answer(rng),
             "rejected": " " + CF._answer(rng), "margin": round(rng.uniform(0.0, 1.0), 3)} for _ in range(n)]


def conversation_pairs(n: int, seed: int = 0) -> list[dict]:
    """Conversations as two whole dialogues (chosen and rejected carry the prompt's turns, a system turn in every
    third), as TRL's examples without a prompt column."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": "Be " + CF._words(rng, 1, 2) + "."}] if i % 3 == 0 else []
        prompt.append({"role": "user", "content": CF._words(rng, 2, 6) + "?"})
        rows.append({"chosen": prompt + [{"role": "assistant", "content": CF._answer(rng)}],
                     "rejected": prompt + [{"role": "assistant", "content": CF._answer(rng)}]})
    return rows


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification with one output, its score scaled up so that rewards differ; no
    pad id in its config: TRL and cuboid give it the tokenizer's."""
    import transformers as T

    folder = tmp_path_factory.mktemp("reward") / "model"
    tok = CF.chat_tokenizer(folder, "qwen2")
    cfg = T.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, vocab_size=len(tok), max_position_embeddings=256,
                        tie_word_embeddings=True, num_labels=1, pad_token_id=None,  # (both set the tokenizer's)
                        eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = T.Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.mul_(50.0)
    model.save_pretrained(str(folder))
    return folder


def _trl_evaluate(folder, rows: list[dict], tmp_path, coef=None) -> tuple:
    """(TRL's evaluate() figures, its prepared eval dataset) over ``rows`` in one batch, fp32 on CPU."""
    import datasets
    import transformers as T
    from trl import RewardConfig, RewardTrainer

    ds = datasets.Dataset.from_list(rows)
    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_eval_batch_size=len(rows), bf16=False,
                        report_to=[], center_rewards_coefficient=coef, max_length=256, use_cpu=True)
    model = T.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    trainer = RewardTrainer(model=model, args=args, processing_class=T.AutoTokenizer.from_pretrained(folder),
                            train_dataset=ds, eval_dataset=ds)
    return trainer.evaluate(), trainer.eval_dataset


def _cuboid_eval(*argv) -> dict:
    from cuboid.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", *argv, "--json"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["strings", "conversations"])
def test_rows_and_eval_equal_trl(kind, reward_folder, tmp_path):
    import datasets
    import transformers as T

    from cuboid.tasks import get
    from cuboid.zoo import config_of

    rows = string_pairs(10) if kind == "strings" else conversation_pairs(8, seed=3)
    coef = COEF if kind == "strings" else None
    trl, prepared = _trl_evaluate(reward_folder, rows, tmp_path, coef)
    # the rows: TRL's token ids, chosen and rejected side by side, right-padded with the pad id
    task = get("reward")(center_rewards_coefficient=coef)
    tok = T.AutoTokenizer.from_pretrained(reward_folder)
    ours = task.rows(datasets.Dataset.from_list(rows), config=config_of("llama-debug", n_positions=256), tokenizer=tok,
                     seq_len=256)
    assert ours["input_ids"].shape[:2] == (len(rows), 2)
    for i, example in enumerate(prepared):
        for j, key in enumerate(("chosen_ids", "rejected_ids")):
            n = int(ours["attention_mask"][i, j].sum())
            assert ours["input_ids"][i, j, :n].tolist() == list(example[key]), (kind, i, key)
            assert (ours["input_ids"][i, j, n:] == tok.pad_token_id).all()
    if kind == "strings":
        assert ours["margin"][:, 0].tolist() == pytest.approx([r["margin"] for r in rows])
    # the figures: cuboid eval over the whole file in batches of 4 pairs against TRL's one batch
    path = CF.write_jsonl(rows, tmp_path / "pairs.jsonl")
    spec = "reward" + (f",center_rewards_coefficient={coef}" if coef is not None else "")
    got = _cuboid_eval("--task", spec, "--model", str(reward_folder), "--data", str(path), "--batch-size", "4",
                       "--max-length", "256")
    assert 0.0 < trl["eval_accuracy"] < 1.0 and abs(trl["eval_margin"]) > 1e-3  # the figures say something
    for key in ("loss", "accuracy", "margin"):
        assert got[key] == pytest.approx(trl[f"eval_{key}"], rel=2e-5, abs=2e-6), (key, got, trl)


def test_too_long_pairs_are_dropped_as_trl_does(reward_folder):
    import datasets
    import transformers as T

    from cuboid.tasks import get
    from cuboid.zoo import config_of

    tok = T.AutoTokenizer.from_pretrained(reward_folder)
    rows = string_pairs(10)
    task = get("reward")()
    full = task.rows(datasets.Dataset.from_list(rows), config=config_of("llama-debug", n_positions=256), tokenizer=tok)
    longest = full["attention_mask"].sum(-1).amax(-1)  # (P,)
    limit = int(longest.float().median())
    cut = task.rows(datasets.Dataset.from_list(rows), config=config_of("llama-debug", n_positions=256), tokenizer=tok,
                    seq_len=limit)
    kept = longest <= limit
    assert 0 < int(kept.sum()) < len(rows)
    assert cut["input_ids"].shape[:2] == (int(kept.sum()), 2) and cut["input_ids"].shape[-1] <= limit
    assert torch.equal(cut["input_ids"], full["input_ids"][kept][..., :cut["input_ids"].shape[-1]])
    assert torch.equal(cut["margin"], full["margin"][kept])


def _shape_spies(built: list) -> tuple:
    """Stand-ins for ``torch.full`` and ``torch.zeros`` that append each tensor's shape to ``built``."""
    full, zeros = torch.full, torch.zeros

    def spy_full(size, *a, **k):
        built.append(tuple(size))
        return full(size, *a, **k)

    def spy_zeros(*size, **k):
        built.append(tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size)
        return zeros(*size, **k)

    return spy_full, spy_zeros


def test_a_long_record_is_tokenized_and_padded_only_as_far_as_the_length_kept(reward_folder, monkeypatch):
    """Issue 65, item 5.2: 201 pairs, one with a 0.5 MB answer, at --max-length 64: no tensor is built wider
    than the length kept (the split's longest record made every row that wide, 3.4 GB at the issue's sizes),
    and no text is tokenized much past it; the long pair is dropped, the rest are the unbounded rows."""
    import datasets
    import transformers as T

    from cuboid.data import chat
    from cuboid.tasks import get
    from cuboid.zoo import config_of

    tok = T.AutoTokenizer.from_pretrained(reward_folder)
    rows = string_pairs(201)
    rows[100] = {**rows[100], "chosen": " " + "word " * 100_000}  # 0.5 MB
    limit, config = 64, config_of("llama-debug", n_positions=256)
    built, encoded = [], []
    call = chat.TextEncoder.__call__
    spy_full, spy_zeros = _shape_spies(built)

    def spy_call(self, texts):
        encoded.append(max(map(len, [texts] if isinstance(texts, str) else texts), default=0))
        return call(self, texts)

    monkeypatch.setattr(torch, "full", spy_full)
    monkeypatch.setattr(torch, "zeros", spy_zeros)
    monkeypatch.setattr(chat.TextEncoder, "__call__", spy_call)
    cut = get("reward")().rows(datasets.Dataset.from_list(rows), config=config, tokenizer=tok, seq_len=limit)
    widest = max(s[-1] for s in built if len(s) == 3)
    assert widest <= limit, f"a (P, 2, {widest}) tensor was built for --max-length {limit}"
    assert max(encoded) < 20_000, f"a text of {max(encoded)} characters was tokenized for --max-length {limit}"
    monkeypatch.undo()
    rows.pop(100)
    whole = get("reward")().rows(datasets.Dataset.from_list(rows), config=config, tokenizer=tok)
    kept = whole["attention_mask"].sum(-1).amax(-1) <= limit
    assert cut["input_ids"].shape[:2] == (int(kept.sum()), 2) and 0 < int(kept.sum()) < 200
    assert torch.equal(cut["input_ids"], whole["input_ids"][kept][..., :cut["input_ids"].shape[-1]])
    assert torch.equal(cut["margin"], whole["margin"][kept])


def test_train_step_on_hand_built_pairs_is_trls_loss():
    """The batch a test builds by hand: rows interleaved (2i chosen, 2i + 1 rejected of pair i), a margin per row
    (the chosen row's is read), padding with the model's pad id; the step's loss and metrics are TRL's formulas."""
    import torch.nn.functional as F

    import cuboid
    from cuboid.tasks import get

    model = cuboid.load("llama-debug", head="cls", num_labels=1, pad_token_id=0, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (6, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[1::2, 7:], mask[1::2, 7:] = 0, 0
    batch = {"input_ids": ids, "attention_mask": mask, "margin": torch.rand(6, generator=g)}
    with torch.no_grad():
        r = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    rc, rr, m = r[0::2], r[1::2], batch["margin"][0::2]
    want = (-F.logsigmoid(rc - rr - m).mean() + COEF * ((rc + rr) ** 2).mean()).item()
    assert get("reward")(center_rewards_coefficient=COEF).count(batch) == 3
    step = cuboid.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                             task=f"reward,center_rewards_coefficient={COEF}")  # (a name, an object or a class)
    assert step.targets == 3
    assert step.loss == pytest.approx(want, rel=1e-5)
    assert step.metrics["accuracy"] == pytest.approx((rc > rr).float().mean().item())
    assert step.metrics["margin"] == pytest.approx((rc - rr).mean().item(), rel=1e-5, abs=1e-6)


def test_finetune_reward_lowers_the_loss_and_final_loads(reward_folder, tmp_path):
    import transformers as T

    import cuboid

    # a preference a few steps teach: the chosen answer ends with "sun", the rejected one with "moon"
    pairs = [dict(p, chosen=p["chosen"] + " sun", rejected=p["rejected"] + " moon") for p in string_pairs(32, seed=5)]
    data = CF.write_jsonl(pairs, tmp_path / "pairs.jsonl")
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", "gpt-debug", "--tokenizer", str(reward_folder), "--data", str(data),
                     "--task", "reward", "--max-length", "128", "--steps", "8", "--batch-size", "4", "--lr", "1e-2",
                     "--log-every", "1", "--eval-every", "8", "--no-progress", "--no-plot", "--output-dir", str(run),
                     timeout=600)
    assert rc == 0, err
    rows = metrics(run)
    losses = [m["loss"] for m in rows if "loss" in m]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert any("eval_accuracy" in m for m in rows), rows[-1]
    final = run / "final"
    hf = T.AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert type(hf).__name__ == "GPT2ForSequenceClassification" and hf.config.num_labels == 1
    tok = T.AutoTokenizer.from_pretrained(reward_folder)
    assert hf.config.pad_token_id == tok.pad_token_id
    ids = torch.tensor([[5, 9, 14, 3, tok.pad_token_id, tok.pad_token_id], [7, 2, 8, 11, 4, 6]])
    ours = cuboid.load(str(final)).eval()
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def _widest_reward_rows(folder: str, data: str, out: str, limit: int) -> int:
    """On each rank of a dp=2 fine-tune (``cuboid.finetune`` under the launched world): the widest (P, 2, L)
    tensor the reward task's tokenization built (spied only while ``Reward.rows`` runs)."""
    import cuboid
    from cuboid.tasks import reward

    built, full, zeros, rows = [], torch.full, torch.zeros, reward.Reward.rows
    spy_full, spy_zeros = _shape_spies(built)

    def spied(self, *a, **k):
        torch.full, torch.zeros = spy_full, spy_zeros
        try:
            return rows(self, *a, **k)
        finally:
            torch.full, torch.zeros = full, zeros

    reward.Reward.rows = spied
    try:
        cuboid.finetune(folder, data, task="reward", plan="dp=2", steps=1, batch_size=4, seq_len=limit,
                        output_dir=out, progress=False, plot=False, eval_fraction=0.0)
    finally:
        reward.Reward.rows = rows
    return max(s[-1] for s in built if len(s) == 3)


def test_a_long_record_is_bounded_by_the_length_kept_under_dp2(reward_folder, tmp_path):
    """Issue 65, item 5.2 under dp=2: every rank tokenizes its pairs only as far as --max-length (one pair of 40
    pairs has a 100 kB answer; before, each rank built (P, 2, ~20,000) tensors)."""
    from ..parallel.launch import run_world

    rows = string_pairs(40)
    rows[7] = {**rows[7], "chosen": " " + "word " * 20_000}
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    widest = run_world(_widest_reward_rows, 2, str(reward_folder), str(data), str(tmp_path / "run"), 64,
                       timeout=300)
    assert max(widest) <= 64, f"a (P, 2, {max(widest)}) tensor was built for --max-length 64 on a dp=2 rank"
