"""GRPO's loss family on fixed rollouts against TRL 1.16's ``GRPOTrainer._compute_loss`` (its own code, called on
a trainer object that holds only what that method reads), and its advantages against TRL's formula.

A fixed batch: 6 completions of 3 prompts of different lengths, right-padded in cuboid's layout (prompt, then
completion, then padding), the same per-token log-probs in TRL's layout (completion positions only, left
aligned). For every loss type, importance level, beta and old-log-prob setting checked, cuboid's step loss
(the task's summed loss over its count, as ``train_step`` divides it, over two micro-batches) equals TRL's
loss summed over the same two micro-batches (TRL divides each by its accumulation), the gradients with
respect to the log-probs agree, and the logged metrics (kl, entropy, clip ratios) are TRL's means.
"""
from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from cuboid.tasks.grpo import GRPO, advantages, nanstd

B, C, MAXLEN = 6, 5, 7
PROMPTS = [3, 2, 4, 3, 2, 4]          # prompt tokens per row
LENGTHS = [5, 3, 1, 4, 0, 2]          # completion tokens per row (row 4: masked, as a truncated completion)
T = max(p + C for p in PROMPTS) + 1   # cuboid's row width (a pad column at the end)


def fixed(seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3          # TRL layout (B, C)
    old = logps + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.2
    entropy = torch.rand(B, C, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in LENGTHS], dtype=torch.float64)
    return logps, old, ref, entropy, adv, mask


def to_cuboid(x):
    """TRL's (B, C) completion values -> cuboid's (B, T) layout: completion token k of row i at position
    PROMPTS[i] + k (its log-prob is predicted from the position before)."""
    out = torch.zeros(B, T, dtype=x.dtype)
    for i, p in enumerate(PROMPTS):
        out[i, p:p + C] = x[i]
    return out


def cuboid_batch(adv, mask, old=None, ref=None):
    labels = torch.full((B, T), -100)
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        labels[i, p:p + n] = 7
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "labels": labels, "advantages": adv}
    if old is not None:
        batch["old_logps"] = to_cuboid(old)
    if ref is not None:
        batch["ref_logps"] = to_cuboid(ref)
    return batch


def trl_loss(logps, entropy, inputs, *, loss_type, beta, epsilon, epsilon_high, level, accumulation):
    """TRL's ``_compute_loss`` on one micro-batch: (loss, metrics), the per-token log-probs given."""
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.loss_type, t.beta, t.epsilon_low, t.epsilon_high = loss_type, beta, epsilon, epsilon_high
    t.importance_sampling_level, t.max_completion_length = level, MAXLEN
    t.top_entropy_quantile, t.off_policy_mask_threshold, t.use_vllm = 1.0, None, False
    t._entropy_bonus_enabled, t.aux_loss_enabled = False, False
    t.current_gradient_accumulation_steps = accumulation
    t.args = types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=accumulation)
    t.accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x)
    t.model = types.SimpleNamespace(training=True)
    t._metrics = {"train": defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropy, None)
    return t._compute_loss(None, inputs), {k: v[0] for k, v in t._metrics["train"].items()}


def trl_step(logps, entropy, adv, mask, old, ref, parts=2, **o):
    """TRL's loss summed over ``parts`` micro-batches of the step (what one optimizer step backpropagates)."""
    total, metrics = 0.0, defaultdict(list)
    rows = B // parts
    items = mask.sum()
    for k in range(parts):
        s = slice(k * rows, (k + 1) * rows)
        inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
                  "completion_ids": torch.zeros(rows, C, dtype=torch.long), "completion_mask": mask[s],
                  "advantages": adv[s], "num_items_in_batch": items}
        if old is not None:
            inputs["old_per_token_logps"] = old[s]
        if ref is not None:
            inputs["ref_per_token_logps"] = ref[s]
        loss, m = trl_loss(logps[s], entropy[s], inputs, accumulation=parts, **o)
        total = total + loss
        for key, v in m.items():
            metrics[key].append(v)
    return total, metrics


def cuboid_step(logps, entropy, adv, mask, old, ref, parts=2, **o):
    """The task's step loss over ``parts`` micro-batches: sum of summed losses over the sum of counts (what
    ``train_step`` divides by), and its metrics as the step reports them."""
    task = GRPO(loss_type=o["loss_type"], beta=o["beta"], epsilon=o["epsilon"], epsilon_high=o["epsilon_high"],
                importance_sampling_level=o["level"], max_completion_length=MAXLEN)
    batch = cuboid_batch(adv, mask, old, ref)
    full = to_cuboid(logps)[:, 1:]  # token_logps (B, T - 1): position t predicts input t + 1
    ent = to_cuboid(entropy)[:, 1:]
    rows = B // parts
    summed, count, sums = 0.0, 0, defaultdict(float)
    for k in range(parts):
        s = slice(k * rows, (k + 1) * rows)
        micro = {key: v[s] for key, v in batch.items()}
        out = types.SimpleNamespace(token_logps=full[s], token_entropy=ent[s])
        loss, metrics = task.loss(out, micro)
        summed = summed + loss
        count += task.count(micro)
        for key, v in metrics.items():
            sums[key] += float(v)
    return summed / count, task.step_metrics({k: v / count for k, v in sums.items()})


CASES = [
    dict(loss_type="dapo", beta=0.0, level="token", old=True),
    dict(loss_type="dapo", beta=0.04, level="token", old=True),
    dict(loss_type="grpo", beta=0.0, level="token", old=True),
    dict(loss_type="dr_grpo", beta=0.0, level="token", old=True),
    dict(loss_type="bnpo", beta=0.04, level="token", old=True),
    dict(loss_type="cispo", beta=0.0, level="token", old=True),
    dict(loss_type="dapo", beta=0.0, level="sequence", old=True),   # GSPO with num_iterations 2's old log-probs
    dict(loss_type="grpo", beta=0.0, level="sequence", old=True),
    dict(loss_type="dapo", beta=0.0, level="token", old=False),     # num_iterations 1: ratio 1
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['loss_type']}-{c['level']}-b{c['beta']}-old{c['old']}")
def test_loss_and_gradient_equal_trl(case):
    logps, old, ref, entropy, adv, mask = fixed()
    o = dict(loss_type=case["loss_type"], beta=case["beta"], epsilon=0.2,
             epsilon_high=5.0 if case["loss_type"] == "cispo" else 0.28, level=case["level"])
    old = old if case["old"] else None
    ref = ref if case["beta"] else None
    mine_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    mine, mine_metrics = cuboid_step(mine_in, entropy, adv, mask, old, ref, **o)
    want, trl_metrics = trl_step(trl_in, entropy, adv, mask, old, ref, **o)
    torch.testing.assert_close(mine.double(), want.double(), rtol=1e-9, atol=1e-12)
    mine.backward()
    want.backward()
    torch.testing.assert_close(mine_in.grad, trl_in.grad, rtol=1e-9, atol=1e-12)
    assert mine_in.grad.abs().sum() > 0
    # TRL logs each micro-batch's global mean; cuboid the step's (equal here: both micro-batches' tokens summed
    # over the step): compare with TRL's token-weighted mean of its two values
    tokens = [mask[:3].sum().item(), mask[3:].sum().item()]
    rows = [3.0, 3.0]
    names = ["entropy"] + (["kl"] if case["beta"] else []) + (
        ["cispo_clip_ratio"] if case["loss_type"] == "cispo" else
        ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"])
    for name in names:
        weights = rows if case["level"] == "sequence" and "clip" in name else tokens
        expected = sum(v * w for v, w in zip(trl_metrics[name], weights)) / sum(weights)
        assert mine_metrics[name] == pytest.approx(expected, rel=1e-6, abs=1e-9), name  # (TRL counts in fp32)
    if case["old"] and case["loss_type"] != "cispo":  # the fixed batch clips somewhere
        assert mine_metrics["clip_ratio/region_mean"] > 0


def test_advantages_equal_trl_formula():
    g = torch.Generator().manual_seed(3)
    per_func = torch.randint(0, 3, (8, 2), generator=g).double()
    per_func[1, 0] = float("nan")                      # a function that did not apply
    per_func[5] = float("nan")                         # unscorable: every function None
    per_func[4:6, :] = torch.tensor([[2.0, 1.0], [float("nan"), float("nan")]])
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    rewards, adv, zero = advantages(per_func, weights, 4, "group")
    want_r = (per_func * weights).nansum(1)
    want_r[5] = float("nan")
    torch.testing.assert_close(rewards, want_r, equal_nan=True)
    for grp in range(2):
        r = want_r[grp * 4:(grp + 1) * 4]
        ok = ~torch.isnan(r)
        mean, std = r[ok].mean(), r[ok].std(unbiased=True)
        want = torch.where(ok, (r - mean) / (std + 1e-4), torch.zeros_like(r))
        torch.testing.assert_close(adv[grp * 4:(grp + 1) * 4], want)
    assert not zero.any()
    flat = torch.ones(8, 1, dtype=torch.float64)
    _, adv_flat, zero_flat = advantages(flat, torch.ones(1, dtype=torch.float64), 4, "group")
    assert zero_flat.all() and torch.all(adv_flat == 0)
    _, adv_none, _ = advantages(per_func, weights, 4, "none")  # dr_grpo's: not divided by the std
    torch.testing.assert_close(adv_none[:4], want_r[:4] - want_r[:4].mean())
    _, adv_batch, _ = advantages(per_func, weights, 4, "batch")
    torch.testing.assert_close(adv_batch[:4], (want_r[:4] - want_r[:4].mean()) / (nanstd(want_r) + 1e-4))


def test_bad_options_and_reward_errors():
    from cuboid.tasks import TaskError
    from cuboid.tasks.grpo_rewards import score

    with pytest.raises(TaskError, match="loss_type 'ppo'"):
        GRPO(loss_type="ppo")
    with pytest.raises(TaskError, match="MODULE:FUNCTION"):
        GRPO(reward_funcs=["nocolon"])
    with pytest.raises(TaskError, match="2 weights for 1"):
        GRPO(reward_funcs=[lambda **k: []], reward_weights="1,2")

    def short(prompts, completions, **kw):
        return [1.0]

    def boom(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(TaskError, match="short returned 1 rewards for 2 completions"):
        score([short], ["short"], ["p", "p"], ["a", "b"], [[1], [2]])
    with pytest.raises(TaskError, match="boom raised KeyError"):
        score([boom], ["boom"], ["p", "p"], ["a", "b"], [[1], [2]])


def test_rollout_batch_layout_and_masked_truncation():
    """rollout.batch_of: row j is prompt j // G then completion j, right-padded; a masked (truncated) completion
    has no label; a step whose every completion is masked still counts one unit a micro-batch (its loss 0)."""
    from cuboid.tasks.rollout import batch_of, truncated

    stops = [0]
    prompts = [[5, 6, 7], [8]]
    completions = [[1, 2, 0], [3, 4, 9, 9], [0], [2, 2]]
    cut = [truncated(c, stops) for c in completions]
    assert cut == [False, True, False, True]
    b = batch_of(prompts, completions, 2, torch.tensor([1.0, -1.0, 0.5, -0.5]), cut, pad=0, multiple=8)
    assert b["input_ids"].shape == (4, 8)
    assert b["input_ids"][1, :7].tolist() == [5, 6, 7, 3, 4, 9, 9] and b["attention_mask"][1].sum() == 7
    assert b["labels"][0].tolist() == [-100] * 3 + [1, 2, 0] + [-100] * 2
    assert (b["labels"][1] == -100).all() and (b["labels"][3] == -100).all()
    assert b["labels"][2, 1].item() == 0 and b["input_ids"][2, 0].item() == 8
    task = GRPO(mask_truncated_completions=True)
    assert task.count(b) == 4  # the trained tokens: 1, 2, 0 and 0
    task.empty_step = True
    empty = dict(b, labels=torch.full_like(b["labels"], -100))
    assert task.count(empty) == 1


def test_per_row_seeds_make_a_row_independent_of_its_batch():
    """generate(seed=[...]): a row's completion depends on its own seed, not on the rows beside it (so dp ranks
    sampling their shares draw what one device draws), and a rollout's seed is fixed by (seed, step, row)."""
    import cuboid
    from cuboid.tasks.rollout import row_seed

    model = cuboid.load("llama-debug", seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    seeds = [row_seed(0, 1, j) for j in range(3)]
    whole = model.generate(ids, mask, max_new_tokens=6, do_sample=True, seed=seeds)
    alone = model.generate(ids[1:], mask[1:], max_new_tokens=6, do_sample=True, seed=seeds[1:])
    assert torch.equal(whole[1:], alone)
    other = model.generate(ids, mask, max_new_tokens=6, do_sample=True, seed=[row_seed(0, 2, j) for j in range(3)])
    assert not torch.equal(other[:, 5:], whole[:, 5:])
    assert row_seed(0, 1, 2) == seeds[2] != row_seed(1, 1, 2)
