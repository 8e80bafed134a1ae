"""Decoders' classification heads (each row's last token that is not padding) under pp and sp, on 2 ranks.

One 2-rank world runs every case through the public API (``cuboid.load(..., plan=)``, ``cuboid.train_step``):
the Llama family's and GPT-2's classifier with a reward task's own loss (``reward``: one output, pairs as
interleaved rows, a ``margin`` per row or none, no labels in the batch) under ``pp2``, ``sp2``, ``sp2-a2a`` and
``tp2-seq``, and with the model's own cross-entropy (three classes, labels (B,)) under ``pp2`` and ``sp2``.
Rows are right-padded with the pad id to different lengths, so each row's last token lies in another
place (under sp: on either rank's chunks). Each case takes 2 SGD steps and must give one device's losses and
metrics and, after the steps, one device's logits (fp32, 1e-4 relative).
"""
import torch

from .launch import run_world

CASES = [  # (preset, plan, task): "reward" (its own loss; "reward-plain": without margins) or None (cross-entropy)
    ("llama-debug", "pp2", "reward"), ("llama-debug", "sp2", "reward"), ("llama-debug", "sp2-a2a", "reward"),
    ("llama-debug", "tp2-seq", "reward"),
    ("gpt-debug", "pp2", "reward-plain"), ("gpt-debug", "sp2", "reward"),
    ("llama-debug", "pp2", None), ("llama-debug", "sp2", None),
]
PAD = 0


def batch_of(task) -> dict:
    """8 rows of 13 tokens, right-padded to 5..13 tokens; reward: a margin per row, else labels (B,) of 3 classes."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (8, 13), generator=g)
    mask = torch.ones_like(ids)
    for row, keep in enumerate((13, 9, 5, 11, 7, 13, 12, 6)):
        ids[row, keep:], mask[row, keep:] = PAD, 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if task == "reward":
        batch["margin"] = torch.rand(8, generator=g)
    elif task is None:
        batch["labels"] = torch.randint(0, 3, (8,), generator=g)
    return batch


def _run(preset: str, plan, task_name) -> tuple:
    import cuboid
    from cuboid import tasks

    task = tasks.get("reward")() if task_name else None
    model = cuboid.load(preset, plan=plan, head="cls", num_labels=1 if task else 3, pad_token_id=PAD, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = [cuboid.train_step(model, opt, batch_of(task_name), task=task) for _ in range(2)]
    inputs = {k: v for k, v in batch_of(task_name).items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(**inputs).logits
    return [(s.loss, s.metrics) for s in steps], logits


def _world() -> list:
    refs = {(preset, task): _run(preset, None, task) for preset, _, task in CASES}  # one device's, once each
    return [(refs[preset, task], _run(preset, plan, task)) for preset, plan, task in CASES]


def test_classification_heads_under_pp_and_sp_equal_one_device():
    results = run_world(_world, 2, timeout=420)
    for rank, cases in enumerate(results):
        for (preset, plan, task), ((ref_steps, ref_logits), (steps, logits)) in zip(CASES, cases):
            where = f"{preset} {plan} {task or 'cross-entropy'} rank {rank}"
            for (ref_loss, ref_metrics), (loss, metrics) in zip(ref_steps, steps):
                assert abs(loss - ref_loss) <= 1e-4 * max(abs(ref_loss), 1e-3), (where, loss, ref_loss)
                assert set(metrics) == set(ref_metrics), where
                for k in ref_metrics:
                    assert abs(metrics[k] - ref_metrics[k]) <= 1e-4 * max(abs(ref_metrics[k]), 1.0), (where, k)
            assert ref_steps[1][0] != ref_steps[0][0], where  # the first step moved the weights
            err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
            assert logits.shape == ref_logits.shape and err < 1e-4, (where, err)
