"""GRPO's rollouts: sample G completions a prompt with cuboid's key/value cache under the training plan, score them,
and make the step's batch of fixed rollouts (:mod:`cuboid.tasks.grpo` says its layout).

Row ``j`` of a step's rollouts is completion ``j % G`` of prompt ``j // G``.
Each dp rank samples its contiguous share of the rows (the rows
:func:`cuboid.train.step.rank_share` gives it to train on), every prompt
left-padded to the longest prompt of the whole step, and each row draws from a
generator seeded by ``(seed, step, j)``: one device and ``dp=2`` sample the
same tokens, and a resumed run samples what the uninterrupted one did. The
ranks' completions are then gathered (every rank holds the global batch, as
the step expects). Tensor and pipeline ranks sample alike
(:func:`cuboid.zoo.generation.generate`); sequence parallelism is refused there.

Reward functions run on every rank over every completion (so a function that
raises stops every rank alike, with no collective left waiting): they must be
deterministic.
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch

from cuboid.parallel import comm, state_of, unwrap, zero

from .base import TaskError


def row_seed(seed: int, step: int, row: int) -> int:
    """The seed of completion ``row`` of generation step ``step`` (independent of the plan and the rows beside)."""
    digest = hashlib.sha256(f"grpo:{seed}:{step}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tokenize_prompt(prompt, tokenizer, chat_template: Optional[str] = None) -> list:
    """A prompt's token ids: a string as it is, a message list rendered with the chat template and its
    generation prompt (TRL's conversational prompts)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        from cuboid.data.chat import prompt_ids

        return prompt_ids(list(prompt), tokenizer, chat_template=chat_template)
    raise TaskError(f"a prompt is a string or a list of messages, got {type(prompt).__name__}")


def _dp(model):
    mesh = state_of(unwrap(model)).mesh
    return mesh, mesh.size("dp"), mesh.coords["dp"] if mesh.size("dp") > 1 else 0


def sample(model, prompts: Sequence[list], *, num_generations: int, step: int, seed: int, max_new_tokens: int,
           temperature: float, top_p: float, top_k: int, stops: Sequence[int], pad: int, greedy: bool = False) -> list:
    """The global batch's completions (``len(prompts) * G`` lists of token ids, each cut after its first stop
    token), this dp rank sampling its share of the rows (``greedy``: the most likely tokens) and every rank
    returning all of them."""
    core = unwrap(model)
    mesh, dp, rank = _dp(model)
    rows = len(prompts) * num_generations
    if rows % dp:
        raise TaskError(f"{rows} completions a step do not split into {dp} data-parallel shares")
    share = rows // dp
    mine = range(rank * share, (rank + 1) * share)
    longest = max(len(p) for p in prompts)
    ids = torch.full((share, longest), pad, dtype=torch.long)
    mask = torch.zeros(share, longest, dtype=torch.long)
    for i, j in enumerate(mine):
        p = prompts[j // num_generations]
        ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, longest - len(p):] = 1
    out = core.generate(ids, mask, max_new_tokens=max_new_tokens, do_sample=not greedy, temperature=temperature,
                        top_p=top_p, top_k=top_k, eos_token_id=list(stops) or None, pad_token_id=pad,
                        seed=[row_seed(seed, step, j) for j in mine])
    zero.reshard(core)  # ZeRO-3: free what a forward without backward left gathered
    new = out[:, longest:].cpu()
    padded = torch.full((share, max_new_tokens), -1, dtype=torch.long)
    padded[:, :new.shape[1]] = new
    if dp > 1:  # every rank's share, in rank order: the global rows
        device = next(core.parameters()).device
        padded = torch.cat([t.cpu() for t in comm.all_gather_list(padded.to(device), mesh.group("dp"))])
    completions = []
    for row in padded.tolist():
        row = [t for t in row if t >= 0]
        cut = next((k for k, t in enumerate(row) if t in stops), None)
        completions.append(row[:cut + 1] if cut is not None else row)
    return completions


def truncated(completion: list, stops: Sequence[int]) -> bool:
    """Whether a completion ended without a stop token (cut at max_completion_length)."""
    return not completion or completion[-1] not in stops


def batch_of(prompts: Sequence[list], completions: Sequence[list], num_generations: int, advantages: torch.Tensor,
             masked: Sequence[bool], pad: int, multiple: int = 8) -> dict:
    """The step's rollouts as a training batch (:mod:`cuboid.tasks.grpo`'s layout): row j is prompt j // G,
    then completion j, right-padded to a multiple of ``multiple``; a ``masked`` row's completion trains nothing."""
    rows = len(completions)
    width = max(len(prompts[j // num_generations]) + len(c) for j, c in enumerate(completions))
    width = -(-max(width, 2) // multiple) * multiple
    ids = torch.full((rows, width), pad, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    for j, c in enumerate(completions):
        p = prompts[j // num_generations]
        n = len(p) + len(c)
        ids[j, :n] = torch.tensor(list(p) + list(c), dtype=torch.long)
        mask[j, :n] = 1
        if not masked[j]:
            labels[j, len(p):n] = ids[j, len(p):n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "advantages": advantages.to(torch.float32)}


@torch.no_grad()
def logps_of(model, batch: dict, *, reference: bool = False) -> torch.Tensor:
    """(B, T) log-probs of each input token under the model (``reference``: its base, adapters off), aligned
    with ``input_ids`` (position 0 unused): this dp rank's share computed, all ranks' gathered."""
    from cuboid.parallel.lora import adapters_off, carries_adapters

    core = unwrap(model)
    mesh, dp, rank = _dp(model)
    rows = batch["input_ids"].shape[0]
    share = rows // dp
    inputs = {k: batch[k][rank * share:(rank + 1) * share] for k in ("input_ids", "attention_mask", "labels")}
    device = next(core.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    was_training = core.training
    core.eval()
    try:
        if reference:
            if not carries_adapters(core):
                raise TaskError("task grpo with beta > 0 needs a reference policy: LoRA adapters (the base, adapters "
                                "off) or a frozen copy of the starting model (task.with_model(..., reference=copy); "
                                "cuboid finetune makes one)")
            with adapters_off(core):
                logps = core(**inputs, logprobs=True).token_logps
        else:
            logps = core(**inputs, logprobs=True).token_logps
    finally:
        core.train(was_training)
        zero.reshard(core)
    out = torch.zeros(share, rows and batch["input_ids"].shape[1], dtype=torch.float32, device=device)
    out[:, 1:] = logps.float()
    if dp > 1:
        out = torch.cat(comm.all_gather_list(out, mesh.group("dp")))
    return out.cpu()


def length_metrics(completions: Sequence[list], stops: Sequence[int]) -> dict:
    """TRL's ``completions/*``: mean, min and max length (tokens, the stop token included), clipped ratio."""
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    cut = [truncated(c, stops) for c in completions]
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": sum(cut) / max(len(cut), 1)}


def finite_or_none(x: float) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def encode(t: torch.Tensor) -> dict:
    """A tensor as JSON values, bit for bit: dtype, shape and its bytes in base64 (read back by :func:`decode`;
    no pickle)."""
    import base64

    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode()}


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool,
           "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32}


def decode(d: dict) -> torch.Tensor:
    """The tensor :func:`encode` wrote; a one-line TaskError when the record is not one."""
    import base64

    try:
        dtype, shape = _DTYPES[d["dtype"]], [int(n) for n in d["shape"]]
        raw = bytearray(base64.b64decode(d["data"], validate=True))
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(shape).clone()
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise TaskError(f"a saved rollout tensor is unreadable ({type(e).__name__}: {e})") from None


class Rollouts:
    """The rollouts a GRPO run holds between steps, as a batch source's state: the current generation (``current``:
    its step, batch with ``old_logps``/``ref_logps``, prompts, texts, completion ids, rewards, advantages and
    logged figures), reused for ``num_iterations`` steps, and the tokens sampled so far (TRL's ``num_tokens``).

    :meth:`state_dict` is JSON values (tensors through :func:`encode`, bit for bit) that the loop keeps in a
    checkpoint's trainer state; :meth:`load_state_dict` restores them, so a run resumed between a generation's
    iterations trains on the same rollouts as the uninterrupted run instead of sampling new ones."""

    TENSORS = ("per_func", "rewards", "advantages")

    def __init__(self) -> None:
        self.current: Optional[dict] = None
        self.num_tokens = 0
        self.first_entropy: list = []  # the run's first steps' entropy, what a collapse is measured against
        self.warned = False            # the collapse warning given

    def state_dict(self, keep_current: bool = True) -> dict:
        """``{"num_tokens", "current"}``; ``current`` None when there is none or ``keep_current`` is False."""
        r = self.current
        current = None
        if r is not None and keep_current:
            current = {k: v for k, v in r.items() if k not in self.TENSORS and k != "batch"}
            current.update({k: encode(r[k]) for k in self.TENSORS})
            current["batch"] = {k: encode(v) for k, v in r["batch"].items()}
        return {"num_tokens": self.num_tokens, "current": current, "first_entropy": list(self.first_entropy),
                "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.num_tokens = int(state.get("num_tokens", 0))
        self.first_entropy = [float(e) for e in state.get("first_entropy", [])]
        self.warned = bool(state.get("warned", False))
        saved = state.get("current")
        if saved is None:
            self.current = None
            return
        current = {k: v for k, v in saved.items() if k not in self.TENSORS and k != "batch"}
        current.update({k: decode(saved[k]) for k in self.TENSORS})
        current["batch"] = {k: decode(v) for k, v in saved["batch"].items()}
        self.current = current


def cut_log(path, step: int) -> None:
    """Keep the lines of the completions log ``path`` (``completions.jsonl``, appended step by step) before
    ``step`` (a resume keeps the steps it resumes after), read a line at a time and cut in place (the log is
    never held in memory). A last line a kill left cut off (no newline, not JSON) is dropped with a warning
    naming the file; an unreadable line before it is a one-line error naming the file and line."""
    import json
    import sys

    with open(path, "r+b") as f:
        offset, number, cut = 0, 0, None
        for raw in iter(f.readline, b""):
            number += 1
            if not raw.strip():
                offset += len(raw)
                continue
            try:
                line = json.loads(raw)
                ok = isinstance(line, dict) and isinstance(line.get("step"), int)
            except ValueError:
                ok = False
            if not ok:
                if raw.endswith(b"\n") and f.read(1):
                    raise TaskError(f"{path}:{number}: not a completions log line (a JSON object with its step); "
                                    "fix or remove the file to resume")
                print(f"warning: {path}: dropped its cut-off last line {number} (a write interrupted)",
                      file=sys.stderr, flush=True)
                cut = offset
                break
            if line["step"] >= step:
                cut = offset
                break
            offset += len(raw)
            if not raw.endswith(b"\n"):  # a whole last line the kill left without its newline
                f.seek(0, 2)
                f.write(b"\n")
                offset += 1
        if cut is not None:
            f.truncate(cut)


COLLAPSE_RATIO, COLLAPSE_RISE, REPEAT_SHARE = 2.0, 0.3, 0.5


def collapse_note(entropy: Optional[float], first: Sequence[float], completions: Sequence[list], texts=()) -> \
        Optional[str]:
    """What says a run may be collapsing, in a sentence, or None: the entropy at least
    :data:`COLLAPSE_RATIO` times (and :data:`COLLAPSE_RISE` nats above) the mean of the run's first steps'
    (``first``), or degenerate completions: at least :data:`REPEAT_SHARE` of their tokens (32 or more) the token
    before them again."""
    if entropy is not None and first:
        base = sum(first) / len(first)
        if entropy >= COLLAPSE_RATIO * base and entropy - base >= COLLAPSE_RISE:
            return (f"the entropy rose to {entropy:.3g} from {base:.3g} over the first {len(first)} step(s) "
                    f"({entropy / max(base, 1e-12):.1f}x)")
    pairs = sum(max(len(c) - 1, 0) for c in completions)
    if pairs >= 32:
        repeats = sum(a == b for c in completions for a, b in zip(c, c[1:]))
        if repeats >= REPEAT_SHARE * pairs:
            sample = next((t for t in texts if t), "")
            return (f"degenerate completions: {repeats / pairs:.0%} of their tokens repeat the one before"
                    + (f" (e.g. {sample[:40]!r})" if sample else ""))
    return None


def eval_completions(model, prompts: Sequence[list], *, max_new_tokens: int, stops: Sequence[int], pad: int,
                     chunk: int = 64) -> list:
    """Greedy completions of ``prompts`` (one each), ``chunk`` prompts a dp rank at a time: the prompts padded
    to a multiple of the dp size with the last one (its fillers dropped), each rank sampling its share."""
    _, dp, _ = _dp(model)
    core, out = unwrap(model), []
    was_training = core.training
    core.eval()
    try:
        for start in range(0, len(prompts), chunk * dp):
            part = list(prompts[start:start + chunk * dp])
            filled = part + [part[-1]] * (-len(part) % dp)
            got = sample(model, filled, num_generations=1, step=0, seed=0, max_new_tokens=max_new_tokens,
                         temperature=1.0, top_p=1.0, top_k=0, stops=stops, pad=pad, greedy=True)
            out.extend(got[:len(part)])
    finally:
        core.train(was_training)
    return out
