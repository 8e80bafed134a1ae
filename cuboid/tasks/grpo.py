"""GRPO and its family (DAPO, Dr. GRPO, BNPO, CISPO, GSPO): online RL with verifiable rewards (TRL's ``GRPOTrainer``).

A step samples ``num_generations`` (G) completions per prompt with the
policy (:mod:`.rollout`; a task may not import the loop), scores them with the reward functions
and turns the rewards into advantages against each prompt's group
(:func:`advantages`). The loss is then a task loss on fixed rollouts: one
row per completion, its prompt and completion tokens right-padded, the
completion's tokens the targets. A test or a user builds the same batch by
hand and calls ``cuboid.train_step(model, opt, batch, task=GRPO(...))``:

- ``input_ids`` (B, T): the prompt's tokens, then the completion's, then padding;
- ``attention_mask`` (B, T): 1 on the prompt and completion tokens;
- ``labels`` (B, T): the completion's tokens where they are trained, -100 elsewhere
  (``labels[:, 1:] != -100`` is TRL's ``completion_mask``, shifted as the head shifts);
- ``advantages`` (B,): one advantage per completion (a target, not a model input);
- ``old_logps`` (B, T) optional: ``log p_old(input_ids[:, t])`` at each completion position t
  (position 0 unused); without it the old policy is the current one (``num_iterations`` 1: ratio 1);
- ``ref_logps`` (B, T) with ``beta > 0``: the reference policy's log-probs, aligned the same way.

The per-token loss and its aggregation follow TRL 1.16's ``_compute_loss``
per ``loss_type``; the step (:func:`cuboid.train.step.train_step`) divides the
summed loss by the step's count over micro-batches and dp ranks, so each
aggregate is TRL's: ``dapo`` and ``cispo`` the sum over every completion
token of the step over their number; ``dr_grpo`` that sum over
rows x ``max_completion_length``; ``grpo`` the mean over rows of each row's
token mean; ``bnpo`` the mean over micro-batches (and ranks) of each one's
token mean (as TRL's, it depends on the micro-batching).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .base import Task, TaskError, register

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
LEVELS = ("token", "sequence")


def _option(default, text: str, **meta):
    """A task option; ``flag=True``: also a flag of its own on ``cuboid finetune`` (``--loss-type``;
    :func:`cuboid.train.config.task_flags`), ``choices``: the values it takes (for the help)."""
    return field(default=default, metadata={"help": text, **meta})


@dataclass(frozen=True)
class GRPOOptions:
    """The options of task ``grpo`` (TRL's ``GRPOConfig`` names and defaults; ``--task grpo,beta=0.04`` or
    flags of their own)."""

    reward: Optional[str] = _option(None, "a reward function, MODULE:FUNCTION (a module on the path or a .py "
                                          "file); several: give the flag again (or join them with ;)",
                                    flag=True, append=True)
    reward_weights: Optional[str] = _option(None, "the reward functions' weights, comma-separated (default 1 each)",
                                            flag=True)
    reward_timeout_s: Optional[float] = _option(None, "seconds a reward function may run a step before the run "
                                                      "fails (default: --timeout-s, 300)", flag=True)
    num_generations: int = _option(8, "completions sampled per prompt (G); --batch-size counts completions",
                                   flag=True)
    max_completion_length: int = _option(512, "tokens a completion may have", flag=True)
    temperature: float = _option(1.0, "sampling temperature", flag=True)
    top_p: float = _option(1.0, "nucleus sampling: the smallest set of tokens of this probability mass", flag=True)
    top_k: int = _option(0, "sample among the k most likely tokens (0: all)", flag=True)
    loss_type: str = _option("dapo", "dapo | grpo | dr_grpo | bnpo | cispo: TRL's aggregations of the loss",
                             flag=True, choices=LOSS_TYPES)
    beta: float = _option(0.0, "KL coefficient to the reference policy (the starting model, a frozen copy; with "
                               "--lora the base, adapters off)", flag=True)
    epsilon: float = _option(0.2, "clipping of the importance ratio: 1 - epsilon below", flag=True)
    epsilon_high: Optional[float] = _option(None, "1 + epsilon_high above (default: epsilon; cispo's cap)",
                                            flag=True)
    scale_rewards: str = _option("group", "group | batch | none: the std the advantages are divided by", flag=True,
                                 choices=SCALE_REWARDS)
    num_iterations: int = _option(1, "optimizer steps per generation (mu), the old log-probs kept", flag=True)
    importance_sampling_level: str = _option("token", "token | sequence (GSPO): the importance ratio's level",
                                             flag=True, choices=LEVELS)
    mask_truncated_completions: bool = _option(False, "completions cut at max_completion_length train nothing",
                                               flag=True)
    log_completions: bool = _option(False, "write completions.jsonl in the output folder", flag=True)
    prompt_column: str = _option("prompt", "the column of the prompts (a string or a message list)")
    chat_template: Optional[str] = _option(None, "a Jinja chat template file for message-list prompts")


def _masked_seq(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-row token means of ``x`` (B, C) over ``mask`` (a row without tokens: 0)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def policy_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 o: GRPOOptions, ref_logps: Optional[torch.Tensor] = None) -> tuple:
    """TRL's per-token loss: ``(per_token_loss, coef_1, per_token_kl or None)``.

    ``logps``, ``old_logps``, ``ref_logps``, ``mask``: (B, C) over completion positions (``mask`` float, 1 on
    trained tokens); ``advantages`` (B,). ``coef_1`` is the importance ratio, (B, C) at token level and (B, 1)
    at sequence level (GSPO: the exponentiated mean log-ratio of the row)."""
    adv = advantages.to(logps.dtype).unsqueeze(1)
    log_ratio = logps - old_logps
    if o.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)
    high = o.epsilon_high if o.epsilon_high is not None else o.epsilon
    if o.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=high).detach() * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon, 1 + high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    kl = None
    if o.beta != 0.0:  # the k3 estimator of KL(policy || reference), per token
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + o.beta * kl
    return per_token.expand_as(mask) if per_token.shape != mask.shape else per_token, coef_1, kl


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, o: GRPOOptions) -> torch.Tensor:
    """One micro-batch's summed loss for the step to divide by :func:`count_of` summed over the step."""
    if o.loss_type == "grpo":
        return _masked_seq(per_token, mask).sum()
    if o.loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token * mask).sum()  # dapo, cispo, dr_grpo


def count_of(mask: torch.Tensor, o: GRPOOptions) -> int:
    """One micro-batch's share of the step's denominator (:func:`aggregate`'s): tokens (dapo, cispo), rows
    (grpo), rows x max_completion_length (dr_grpo), one (bnpo: a mean of micro-batch means)."""
    if o.loss_type in ("dapo", "cispo"):
        return int(mask.sum())
    if o.loss_type == "grpo":
        return int(mask.shape[0])
    if o.loss_type == "dr_grpo":
        return int(mask.shape[0]) * o.max_completion_length
    return 1


def metric_sums(per_token_kl, coef_1: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, o: GRPOOptions) -> dict:
    """Numerators and denominators of TRL's token means (``kl``, ``entropy``, the clip ratios) over one
    micro-batch; :meth:`GRPO.step_metrics` divides them once the step summed them over micro-batches and ranks.
    At sequence level (GSPO) the clip ratios are means over rows, as TRL's."""
    adv = advantages.to(coef_1.dtype).unsqueeze(1)
    sums = {"_tokens": mask.sum(), "_rows": torch.tensor(float(mask.shape[0])),
            "_entropy": (entropy * mask).sum()}
    if per_token_kl is not None:
        sums["_kl"] = (per_token_kl * mask).sum()
    high = o.epsilon_high if o.epsilon_high is not None else o.epsilon
    if o.loss_type == "cispo":
        clipped = {"cispo_clip_ratio": (coef_1 > high) & (adv > 0)}
    else:
        low_c, high_c = (coef_1 < 1 - o.epsilon) & (adv < 0), (coef_1 > 1 + high) & (adv > 0)
        clipped = {"clip_ratio/low_mean": low_c, "clip_ratio/high_mean": high_c,
                   "clip_ratio/region_mean": low_c | high_c}
    for name, flags in clipped.items():
        flags = flags.float()
        sums["_" + name] = flags.sum() if flags.shape[1] == 1 else (flags * mask).sum()
    return {k: v.detach().double() for k, v in sums.items()}


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
               scale_rewards: str = "group") -> tuple:
    """TRL's advantages (``sum_then_normalize``): ``(rewards, advantages, std_is_zero)``, each (B,).

    ``rewards_per_func`` (B, F) float64 with NaN where a function returned None; ``weights`` (F,). Rewards are
    the weighted sums (NaN where every function returned None); ``group``: ``(r - mean(group)) / (std(group) +
    1e-4)`` with the unbiased std; ``batch``: the std over the whole batch; ``none``: not divided. An unscorable
    completion's advantage is 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise TaskError(f"scale_rewards {scale_rewards!r}: one of {', '.join(SCALE_REWARDS)}")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func.dtype).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = float("nan")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return rewards, torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def nanstd(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (NaN with fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(n > 1, n / (n - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def reward_metrics(rewards_per_func: torch.Tensor, names: Sequence[str], rewards: torch.Tensor,
                   std_zero: torch.Tensor) -> dict:
    """TRL's reward metrics of one generation: ``reward``, ``reward_std``, ``rewards/<fn>/mean`` and ``/std``,
    ``frac_reward_zero_std``."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = _finite(torch.nanmean(rewards_per_func[:, i]))
        out[f"rewards/{name}/std"] = _finite(nanstd(rewards_per_func[:, i]))
    out["reward"] = _finite(torch.nanmean(rewards))
    out["reward_std"] = _finite(nanstd(rewards))
    out["frac_reward_zero_std"] = float(std_zero.float().mean())
    return out


def _finite(t: torch.Tensor) -> Optional[float]:
    v = float(t)
    return v if math.isfinite(v) else None


@register
class GRPO(Task):
    """Online RL with verifiable rewards (TRL's GRPOTrainer): G sampled completions a prompt, advantages
    against the group, the clipped policy loss (dapo by default). Every prompt trains unless an eval split is
    asked for (``--eval-fraction``, or the data's own): its score is the mean reward of greedy completions
    (``eval_reward``)."""

    name = "grpo"
    heads = ("lm",)
    unit = "tokens"
    metric = "reward"
    targets = ("advantages", "old_logps", "ref_logps")
    forward_kwargs = {"logprobs": True}
    own_loss = True
    Options = GRPOOptions
    eval_fraction = 0.0  # TRL trains on every prompt; an eval split is the data's own or --eval-fraction's

    def __init__(self, options: Any = None, *, reward_funcs: Sequence = (), **fields) -> None:
        super().__init__(options, **fields)
        o = self.options
        for what, value, allowed in (("loss_type", o.loss_type, LOSS_TYPES),
                                     ("scale_rewards", o.scale_rewards, SCALE_REWARDS),
                                     ("importance_sampling_level", o.importance_sampling_level, LEVELS)):
            if value not in allowed:
                raise TaskError(f"task grpo: {what} {value!r} is not one of {', '.join(allowed)}")
        if o.num_generations < 2:
            raise TaskError(f"task grpo: num_generations {o.num_generations}: a group needs at least 2 completions")
        if o.num_iterations < 1 or o.max_completion_length < 1:
            raise TaskError("task grpo: num_iterations and max_completion_length must be at least 1")
        if o.beta < 0 or o.epsilon < 0 or (o.epsilon_high is not None and o.epsilon_high < 0):
            raise TaskError("task grpo: beta, epsilon and epsilon_high must not be negative")
        if o.reward_timeout_s is not None and not o.reward_timeout_s > 0:
            raise TaskError(f"task grpo: reward_timeout_s {o.reward_timeout_s} must be positive seconds")
        if o.temperature <= 0 or not 0.0 < o.top_p <= 1.0 or o.top_k < 0:
            raise TaskError(f"task grpo: need temperature > 0, 0 < top_p <= 1 and top_k >= 0; got "
                            f"{o.temperature}, {o.top_p}, {o.top_k}")
        from .grpo_rewards import load_rewards, parse_weights, split_specs

        named = [] if o.reward is None else [o.reward] if isinstance(o.reward, str) else list(o.reward)
        named = [spec for text in named for spec in split_specs(text)]
        if named:  # spelled as one text (describe(), a checkpoint's record): "a.py:f;b:g"
            self.options = o = dataclasses.replace(o, reward=";".join(named))
        self.reward_funcs, self.reward_names = load_rewards(list(reward_funcs) + named)

        self.reward_weights = parse_weights(o.reward_weights, len(self.reward_funcs))
        self.empty_step = False   # the global batch trains no token (every completion masked): count one a part
        from .rollout import Rollouts

        self.rollouts = Rollouts()  # the current generation, kept num_iterations steps, and the tokens sampled
        self.records: list = []   # the prompts' records (every split rows() made), by index
        self.prompt_ids: list = []
        self.chat_template = o.chat_template
        self.model = None         # the policy to sample with (with_model)
        self.reference = None     # beta > 0 without LoRA: the frozen starting model (with_model's reference=)
        self.logged = False       # completions.jsonl written by this run yet

    @property
    def rollout(self) -> Optional[dict]:
        """The current generation (:class:`.rollout.Rollouts`' ``current``), kept ``num_iterations`` steps."""
        return self.rollouts.current

    @rollout.setter
    def rollout(self, value: Optional[dict]) -> None:
        self.rollouts.current = value

    @property
    def num_tokens(self) -> int:
        """Prompt and completion tokens sampled so far (TRL's ``num_tokens``)."""
        return self.rollouts.num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.rollouts.num_tokens = value

    def state_dict(self) -> dict:
        """What a checkpoint keeps for an exact resume: the rollouts (the current generation only where a later
        step reuses it, ``num_iterations`` > 1) and the tokens sampled."""
        return {"rollouts": self.rollouts.state_dict(keep_current=self.options.num_iterations > 1)}

    def load_state_dict(self, state: dict) -> None:
        self.rollouts.load_state_dict(state.get("rollouts", {}))
        r = self.rollout
        self.empty_step = r is not None and not bool((r["batch"]["labels"][:, 1:] != -100).any())

    # ------------------------------------------------------------ the step on fixed rollouts

    @staticmethod
    def completion_mask(batch: dict) -> torch.Tensor:
        """(B, T - 1) float: 1 where ``labels[:, 1:]`` is trained (the completion tokens the head predicts)."""
        return (batch["labels"][:, 1:] != -100).float()

    def count(self, batch: dict, model=None) -> int:
        if "labels" not in batch:  # prompt rows (an eval split): nothing to score without sampling
            raise TaskError("task grpo trains on sampled rollouts; a split of prompts has no loss to evaluate "
                            "(score a model's completions with cuboid generate and the reward function)")
        n = count_of(self.completion_mask(batch), self.options)
        return max(n, 1) if self.empty_step else n

    def loss(self, out, batch: dict) -> tuple:
        o = self.options
        logps = out.token_logps                                # (B, T - 1), fp32 from the head (or finer)
        logps = logps.to(torch.promote_types(logps.dtype, torch.float32))
        mask = self.completion_mask(batch).to(logps.device)
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old[:, 1:].to(logps)
        ref = batch.get("ref_logps")
        if o.beta != 0.0 and ref is None:
            raise TaskError("task grpo with beta > 0 needs the batch's ref_logps (the reference policy's)")
        ref = ref[:, 1:].to(logps) if ref is not None else None
        per_token, coef_1, kl = policy_terms(logps, old, batch["advantages"].to(logps.device), mask, o, ref)
        summed = aggregate(per_token, mask, o)
        entropy = out.token_entropy.to(logps) if out.token_entropy is not None else torch.zeros_like(logps)
        return summed, metric_sums(kl, coef_1, entropy, batch["advantages"].to(logps.device), mask, o)

    def step_metrics(self, metrics: dict) -> dict:
        """TRL's names from the step's reduced sums (:func:`metric_sums`; each divided by the same count, so
        their ratios are the token means)."""
        tokens, rows = metrics.get("_tokens", 0.0), metrics.get("_rows", 0.0)
        out = {}
        for key, value in metrics.items():
            if key in ("_tokens", "_rows") or not key.startswith("_"):
                continue
            name = key[1:]
            seq = self.options.importance_sampling_level == "sequence" and name.startswith(("clip", "cispo"))
            den = rows if seq else tokens
            out[name] = value / den if den else 0.0
        return out

    # ------------------------------------------------------------ data: prompts

    def rows(self, ds, *, tokenizer=None, chat_template=None, **_) -> dict:
        """A split of prompts as ``{"index"}`` rows: the records (the prompt as given and the other columns, for
        the reward functions) and their token ids stay with the task, looked up by index at each step."""
        from cuboid.data import formats

        from .rollout import tokenize_prompt

        if len(ds) == 0:  # the eval split GRPO holds none out for (eval_fraction 0)
            return {"index": torch.arange(0)}
        formats.check_split(ds)
        formats.need_tokenizer(tokenizer, self.label)
        column = self.options.prompt_column
        if column not in ds.column_names:
            raise TaskError(f"task grpo reads prompts from column {column!r}; the data has "
                            f"{', '.join(ds.column_names)}")
        start = len(self.records)
        for record in ds:
            self.records.append(dict(record))
            self.prompt_ids.append(tokenize_prompt(record[column], tokenizer, chat_template))
        return {"index": torch.arange(start, len(self.records))}

    @property
    def rows_per_example(self) -> int:
        return self.options.num_generations

    def with_model(self, model, splits: list, **run) -> list:
        """Keep the model to sample with (every rank calls this alike; ``reference``: the frozen starting model
        for beta > 0 without LoRA) and check every prompt before a step
        (:meth:`check_prompts`); the eval split (prompts to score greedy completions of, :meth:`evaluate`) is
        kept where it has any."""
        from cuboid.parallel import state_of, unwrap

        sp = state_of(unwrap(model)).plan.sp
        if sp > 1:
            raise TaskError(f"task grpo samples its completions with a key/value cache, which sequence parallelism "
                            f"(sp={sp}) does not have: train GRPO under a plan without sp")
        self.model = model
        self.reference = run.get("reference")
        positions = getattr(unwrap(model).config, "n_positions", None)
        for name, split in zip(("train", "eval"), splits):
            if split is not None:
                self.check_prompts(split["index"].tolist(), name, positions)
        evals = splits[1] if len(splits) > 1 and splits[1] is not None and len(splits[1]["index"]) else None
        return [splits[0], evals]

    def check_prompts(self, index: list, split: str, positions: Optional[int]) -> None:
        """A one-line TaskError naming the first prompt of ``split`` (its row there) that is empty or whose
        tokens and ``max_completion_length`` pass the model's ``positions``, before any step samples it."""
        m = self.options.max_completion_length
        for row, i in enumerate(index):
            n = len(self.prompt_ids[i])
            shown = str(self.records[i][self.options.prompt_column])
            shown = repr(shown[:40] + ("..." if len(shown) > 40 else ""))
            if n == 0:
                raise TaskError(f"task grpo: prompt {row} of the {split} split ({shown}) has no tokens: give every "
                                "row a prompt")
            if positions is not None and n + m > positions:
                raise TaskError(f"task grpo: prompt {row} of the {split} split ({shown}) has {n} tokens, which with "
                                f"max_completion_length {m} pass the model's {positions} positions: shorten it or "
                                "lower --max-completion-length")

    def wants_reference(self, lora: bool) -> bool:
        """A frozen copy of the starting model for the KL term (``beta`` > 0), where no LoRA base is one."""
        return self.options.beta != 0.0 and not lora

    def takes_data(self, step: int) -> bool:
        """Whether step ``step`` reads new prompts: the first of each generation (TRL repeats a generation's
        prompts ``num_iterations`` steps)."""
        return (step - 1) % self.options.num_iterations == 0 or self.rollout is None

    # ------------------------------------------------------------ the step: rollouts

    def before_step(self, batch: Optional[dict], step: int, *, tokenizer=None, seed: int = 0, model=None) -> dict:
        """The step's rollouts (:mod:`.rollout`): sampled, scored and batched on the first step of a generation,
        kept for the next ``num_iterations - 1`` steps (their old log-probs from before the first update)."""
        if batch is None:
            if self.rollout is None:
                raise TaskError("task grpo: a step without prompts needs an earlier generation")
            return self.rollout["batch"]
        if not self.reward_funcs:
            raise TaskError("task grpo needs a reward function: --reward MODULE:FUNCTION (or reward_funcs=[...])")
        model = model if model is not None else self.model
        if model is None or tokenizer is None:
            raise TaskError("task grpo samples its completions: before_step needs the model and the tokenizer")
        from . import rollout as R

        o = self.options
        index = batch["index"].tolist()
        prompts = [self.prompt_ids[i] for i in index]
        stops, pad = self.stops_and_pad(tokenizer)
        completions = R.sample(model, prompts, num_generations=o.num_generations, step=step, seed=seed,
                               max_new_tokens=o.max_completion_length, temperature=o.temperature, top_p=o.top_p,
                               top_k=o.top_k, stops=stops, pad=pad)
        G = o.num_generations
        records = [self.records[index[j // G]] for j in range(len(completions))]
        raw, texts, per_func = self._scored(records, completions, tokenizer, step)
        rewards, adv, std_zero = advantages(per_func, self.reward_weights, G, o.scale_rewards)
        cut = [R.truncated(c, stops) for c in completions]
        masked = cut if o.mask_truncated_completions else [False] * len(cut)
        from cuboid.parallel import state_of, unwrap

        plan = state_of(unwrap(model)).plan
        out = R.batch_of(prompts, completions, G, adv, masked, pad, math.lcm(8, 2 * plan.sp * plan.tp))
        if o.num_iterations > 1:  # the old policy's log-probs, before this generation's first update
            out["old_logps"] = R.logps_of(model, out)
        if o.beta != 0.0:  # the frozen copy's, or (LoRA) the base's with the adapters off
            out["ref_logps"] = R.logps_of(self.reference, out) if self.reference is not None else \
                R.logps_of(model, out, reference=True)
        self.empty_step = not bool((out["labels"][:, 1:] != -100).any())
        self.num_tokens += int(out["attention_mask"].sum())
        metrics = {**reward_metrics(per_func, self.reward_names, rewards, std_zero),
                   **R.length_metrics(completions, stops)}
        self.rollout = {"step": step, "batch": out, "prompts": [raw[j] for j in range(0, len(raw), G)],
                        "texts": texts, "completion_ids": completions, "per_func": per_func, "rewards": rewards,
                        "advantages": adv, "metrics": metrics}
        return out

    def step_log(self, result, step: int, output_dir=None) -> dict:
        """The row's GRPO figures after a step (TRL's names) and, on the rank that writes (``output_dir``
        given) with ``log_completions``, the generation's completions appended to ``completions.jsonl``."""
        row = {**self.step_metrics(result.metrics), **(self.rollout or {}).get("metrics", {}),
               "num_tokens": self.num_tokens}
        if output_dir is not None and self.options.log_completions and self.rollout is not None \
                and self.rollout["step"] == step:
            self.write_completions(output_dir)
        self.watch(row, step, output_dir is not None)
        return row

    FIRST_STEPS = 3  # the steps whose mean entropy a collapse is measured against

    def watch(self, row: dict, step: int, main: bool) -> None:
        """Warn once (on the writing rank) when the run may be collapsing (:func:`.rollout.collapse_note`)."""
        from .rollout import collapse_note

        s, entropy = self.rollouts, row.get("entropy")
        if len(s.first_entropy) < self.FIRST_STEPS:
            if entropy is not None:
                s.first_entropy.append(float(entropy))
            return
        r = self.rollout or {}
        fresh = r.get("step") == step  # a generation's completions are judged once
        note = collapse_note(entropy, s.first_entropy, r.get("completion_ids", []) if fresh else [],
                             r.get("texts", ()))
        if note and not s.warned:
            s.warned = True
            if main:
                import sys

                print(f"warning: step {step}: the policy may be collapsing: {note}; lower --lr, or raise --beta",
                      file=sys.stderr, flush=True)

    def stops_and_pad(self, tokenizer) -> tuple:
        """(the stop token ids, the pad id) completions are cut at and padded with."""
        from cuboid.data.chat import stop_token_ids

        stops = stop_token_ids(tokenizer, self.chat_template)
        return stops, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)

    def evaluate(self, model, data: dict, *, tokenizer=None, step: int = 0) -> dict:
        """The mean reward of greedy completions of the eval split's prompts (one each, every rank alike):
        ``eval_reward``, ``eval_rewards/<fn>/mean`` and ``eval_completions/mean_length`` (TRL's names with its
        ``eval_`` prefix)."""
        from . import rollout as R

        o = self.options
        index = data["index"].tolist()
        stops, pad = self.stops_and_pad(tokenizer)
        model = model if model is not None else self.model
        completions = R.eval_completions(model, [self.prompt_ids[i] for i in index],
                                         max_new_tokens=o.max_completion_length, stops=stops, pad=pad)
        raw, texts, per_func = self._scored([self.records[i] for i in index], completions, tokenizer, step)
        rewards = advantages(per_func, self.reward_weights, 1, "none")[0]
        out = {"eval_reward": _finite(torch.nanmean(rewards))}
        for i, name in enumerate(self.reward_names):
            out[f"eval_rewards/{name}/mean"] = _finite(torch.nanmean(per_func[:, i]))
        out["eval_completions/mean_length"] = R.length_metrics(completions, stops)["completions/mean_length"]
        return out

    def summary(self, history: Sequence[dict]) -> dict:
        """What the run's ``done:`` line adds: ``reward``, the mean over the last (up to) 10 steps' rewards."""
        last = [r["reward"] for r in history[-10:] if r.get("reward") is not None]
        return {"reward": sum(last) / len(last)} if last else {}

    def _scored(self, records: list, completions: list, tokenizer, step: int) -> tuple:
        """(prompts as given, completion texts, (B, F) rewards) of ``completions`` of the prompts of ``records``
        (one record a completion): the texts decoded, given to the reward functions as TRL does (a
        conversational prompt's completion as an assistant turn), with the records' other columns."""
        from .grpo_rewards import score

        o = self.options
        raw = [r[o.prompt_column] for r in records]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        given = [[{"role": "assistant", "content": t}] if not isinstance(p, str) else t for p, t in zip(raw, texts)]
        columns = {k: [r[k] for r in records] for k in records[0] if k != o.prompt_column}
        per_func = score(self.reward_funcs, self.reward_names, raw, given, completions, columns, step=step,
                         timeout_s=o.reward_timeout_s)
        return raw, texts, per_func

    def write_completions(self, output_dir) -> None:
        """One line a completion: step, prompt (as given), completion (text), completion_ids, reward, each
        function's reward (None where it did not apply) and advantage."""
        import json
        from pathlib import Path

        r, G = self.rollout, self.options.num_generations
        path = Path(output_dir) / "completions.jsonl"
        if not self.logged and path.exists():  # this run's first write: keep the earlier steps a resume keeps
            from .rollout import cut_log

            cut_log(path, r["step"])
        self.logged = True
        with open(path, "a") as f:
            for j, text in enumerate(r["texts"]):
                line = {"step": r["step"], "prompt": r["prompts"][j // G], "completion": text,
                        "completion_ids": r["completion_ids"][j], "reward": _finite(r["rewards"][j]),
                        **{name: _finite(r["per_func"][j, i]) for i, name in enumerate(self.reward_names)},
                        "advantage": float(r["advantages"][j])}
                f.write(json.dumps(line) + "\n")
