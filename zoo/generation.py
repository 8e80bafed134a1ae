"""Text generation with a key/value cache for the zoo's decoders (GPT-2, the Llama family with Qwen3 and Gemma 3).

:func:`generate` swaps every attention core of the model (the
:class:`~cuboid.parallel.layers.Attention` layers, role ``attention``, as
sequence parallelism swaps them) for a :class:`CachedAttention` holding that
layer's keys and values, runs the prompt once (prefill), then one token per
step against the cache, and puts the cores back. The model code is unchanged:
a core writes the new keys and values (after RoPE, at each token's position)
into buffers allocated once at prefill for the prompt and every new token,
and attends over everything cached; the end-aligned causal mask of the kernel
lets a step's queries see every earlier token. A sliding-window layer's core
keeps only its window (the global layers keep everything), as transformers'
cache does.

Prompts of different lengths are left-padded (as transformers does); each
row's positions count only its kept tokens (``attention_mask.cumsum - 1``),
and a row that produced one of its stop ids (``eos_token_id``: one id or a list) repeats the pad token
after it. Under a plan the
cores hold what the blocks give them (1D: this rank's heads; 2D/3D: this
rank's rows), every rank of a tensor group samples with the same generator, so
the tokens agree, and each data-parallel rank generates for its own prompts.
Under pipeline parallelism every step is one micro-batch through the stages
(each stage's cores cache its own layers); the last stage samples and the
pipeline broadcasts the (B,) tokens.

The head runs on the last position only (a step needs no more): (B, V)
logits, not (B, T, V), are made at prefill.
Sequence parallelism is refused in one sentence.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Optional, Sequence, Union

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.mask import Mask
from cuboid.parallel.sequence_split import TensorSequenceSplit
from cuboid.parallel.state import state_of


class CachedAttention(nn.Module):
    """An attention core with this layer's key/value cache: (B, Hkv, capacity, D) buffers, the first
    ``length`` positions filled. ``capacity`` (the prompt and every new token but the last) is allocated once,
    at prefill: a step writes its keys and values in place instead of copying the whole cache.

    A sliding-window core (``window`` W, the swapped core's) keeps only the last W - 1 keys and values, all a
    next token can see beside its own (transformers' sliding-window cache): its memory stays W tokens however
    long the text grows, while ``length`` still counts every token (the positions). ``sinks``: gpt-oss's (H,)
    sink logits, which join every row's softmax as in training."""

    role = "attention"

    def __init__(self, capacity: int = 0, window: Optional[int] = None) -> None:
        super().__init__()
        self.capacity, self.length, self.window = capacity, 0, window
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def forward(self, q, k, v, *, causal: bool, mask: Optional[Mask] = None, rope=None, sinks=None):
        T = q.shape[2]
        # (B, S) over every cached token and the new ones; a prompt is one document (its left padding is masked)
        key_padding_mask = mask.keep if mask is not None else None
        S = self.length + T  # tokens cached after this call
        if rope is not None:  # the new tokens' positions: each row's kept tokens before them (its rows only)
            if key_padding_mask is None:
                q, k = rope(q, k, torch.arange(S - T, S, device=q.device), ("span", S - T, S))  # shared by layers
            else:
                q, k = rope(q, k, (key_padding_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:])
        if self.window is not None:
            return self._sliding(q, k, v, causal, key_padding_mask, S, sinks)
        if self.k is None or S > self.k.shape[2]:  # prefill (or a call past the capacity: grow)
            size = max(S, self.capacity)
            grown = [t.new_empty(*t.shape[:2], size, t.shape[3]) for t in (k, v)]
            if self.k is not None:
                for new, old in zip(grown, (self.k, self.v)):
                    new[:, :, :self.length] = old[:, :, :self.length]
            self.k, self.v = grown
        self.k[:, :, self.length:S] = k
        self.v[:, :, self.length:S] = v
        self.length = S
        return L.attention(q, self.k[:, :, :S], self.v[:, :, :S], causal=causal, key_padding_mask=key_padding_mask,
                           sinks=sinks)

    def _sliding(self, q, k, v, causal: bool, key_padding_mask: Optional[torch.Tensor], S: int,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attend over the kept keys and the new ones under the window (end-aligned: the new tokens are the last
        of the keys), then keep the last ``window - 1``."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)  # (B, Hkv, kept + T, D)
        keep = key_padding_mask[:, -k.shape[2]:] if key_padding_mask is not None else None
        out = L.attention(q, k, v, causal=causal, key_padding_mask=keep, window=self.window, sinks=sinks)
        first = k.shape[2] - min(k.shape[2], self.window - 1)
        self.k, self.v = k[:, :, first:], v[:, :, first:]
        self.length = S
        return out


def _swap_cores(model: nn.Module, capacity: int) -> list:
    swapped = []
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if getattr(child, "role", None) == "attention" and not isinstance(child, CachedAttention):
                if hasattr(child, "cached"):  # a core with a cache of its own (MLA's latent: zoo/deepseek/mla.py)
                    setattr(mod, name, child.cached(capacity))
                    swapped.append((mod, name, child))
                    continue
                if getattr(child, "latent", False):  # already swapped for its cache
                    continue
                if type(child) is not L.Attention:
                    raise NotImplementedError(f"generation under sequence parallelism is not built "
                                              f"({type(child).__name__} cores)")
                setattr(mod, name, CachedAttention(capacity, getattr(child, "window", None)))
                swapped.append((mod, name, child))
    return swapped


def _sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
            generator) -> torch.Tensor:
    """(B,) next tokens from (B, V) fp32 logits: argmax, or a draw after temperature, top-k and top-p
    (``generator``: one, or a list of one per row)."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / max(temperature, 1e-6)
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if isinstance(generator, list):  # one (CPU) generator a row: a row's draws do not depend on the others
        rows = probs.cpu()
        return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(rows, generator)]).to(
            probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _last_position(head):
    """``head`` (the model's final norm and LM head) on each row's last position only: (B, 1, V) logits."""

    def last(x, residual, *args, **kwargs):
        return head(x[:, -1:], residual[:, -1:] if residual is not None else None, *args, **kwargs)

    return last


def _over_dp(value: float, model: nn.Module, op: str) -> float:
    """``value`` reduced (``op``: min or max) over the data-parallel ranks, which hold different prompts: what
    decides a collective step (stop, refuse) must be the same on each, or a ZeRO-3 forward's gather waits."""
    mesh = state_of(model).mesh
    if mesh.size("dp") == 1:
        return value
    from cuboid.parallel import comm

    return comm.all_reduce_(torch.tensor([float(value)], dtype=torch.float64), mesh.group("dp"), op=op).item()


def _generators(seed, rows: int):
    """The draws' generator: None (unseeded), one for ``seed``, or one per row for a list of seeds."""
    if seed is None or isinstance(seed, int):
        return torch.Generator().manual_seed(seed) if seed is not None else None
    if len(seed) != rows:
        raise ValueError(f"{len(seed)} seeds for {rows} rows: give one seed, or one a row")
    return [torch.Generator().manual_seed(int(s)) for s in seed]


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_token_id: Union[int, Sequence[int], None] = None,
             pad_token_id: Optional[int] = None, seed: Union[int, Sequence[int], None] = None,
             streamer=None) -> torch.Tensor:
    """``input_ids`` (B, T) left-padded prompts (``attention_mask`` 0 on the padding) followed by up to
    ``max_new_tokens`` generated tokens each: (B, T + n). Greedy unless ``do_sample``; ``seed`` fixes the
    draws (the same tokens under every plan); a list of seeds, one per row, gives each row a generator of its own
    (GRPO's rollouts: a completion's tokens do not depend on which rows share its batch). ``eos_token_id`` may be
    a list (transformers' convention: a chat model's end-of-turn token beside its eos); a row stops at the first of them and then repeats the pad.
    ``streamer(tokens)`` is called with each step's (B,) tokens."""
    config = model.config
    if getattr(config, "head", None) != "lm":
        raise ValueError(f"generation needs a causal LM head, got head {getattr(config, 'head', None)!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length >= 1), got {tuple(input_ids.shape)}")
    if max_new_tokens < 0 or temperature <= 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"need max_new_tokens >= 0, temperature > 0, 0 < top_p <= 1 and top_k >= 0; got "
                         f"{max_new_tokens}, {temperature}, {top_p}, {top_k}")
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device=device, dtype=ids.dtype)
    longest = int(_over_dp(ids.shape[1], model, "max"))  # every dp rank refuses, or none
    if longest + max_new_tokens > config.n_positions:
        where = "" if longest == ids.shape[1] else " (the longest prompt of the data-parallel ranks)"
        raise ValueError(f"{longest} prompt tokens{where} + {max_new_tokens} new exceed the model's "
                         f"{config.n_positions} positions")
    generator = _generators(seed, ids.shape[0])
    stops = [] if eos_token_id is None else [int(eos_token_id)] if isinstance(eos_token_id, int) else \
        [int(t) for t in eos_token_id]
    pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
    stop_ids = torch.tensor(stops, dtype=ids.dtype, device=device)
    swapped = _swap_cores(model, ids.shape[1] + max_new_tokens - 1)  # the last new token is never fed back
    state = state_of(model)
    pipeline = state.pipeline
    microbatches = pipeline.microbatches if pipeline is not None else None
    if pipeline is not None:  # one micro-batch a step: a stage's caches hold every row, in one order
        pipeline.microbatches = 1
    split = state.sequence_split
    # tp_sequence: decoding runs as plain 1D tp (one token a step, whole sequences in the cache)
    whole = split.unsplit() if isinstance(split, TensorSequenceSplit) else contextlib.nullcontext()
    if split is None or isinstance(split, TensorSequenceSplit):  # the blocks' outputs are whole sequences here
        model.head = _last_position(model.head)
    learned_positions = "position_ids" in inspect.signature(model.embed).parameters  # GPT-2 (Llama: RoPE, in the core)
    was_training = model.training
    model.eval()
    try:
        with whole:
            done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
            new = ids
            for step in range(max_new_tokens):
                inputs = {"input_ids": new, "attention_mask": mask}
                if learned_positions:  # (B, T_new): each row's kept tokens before each new one
                    inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)[:, -new.shape[1]:]
                def sample(logits):  # (B, 1, V) -> (B,): every rank of a tensor group draws alike
                    return _sample(logits[:, -1].float(), do_sample, temperature, top_k, top_p, generator)

                if pipeline is not None:  # the last stage samples; the pipeline sends the tokens, not the logits
                    token = pipeline.forward_only(inputs, last=sample).logits.to(ids.dtype)
                else:  # reading the logits is a collective under tp: every rank reads them
                    token = sample(model(**inputs).logits).to(ids.dtype)
                if stops:
                    token = torch.where(done, torch.full_like(token, pad), token)
                    done |= torch.isin(token, stop_ids)
                ids = torch.cat([ids, token[:, None]], 1)
                mask = torch.cat([mask, torch.ones_like(token[:, None])], 1)
                new = token[:, None]
                if streamer is not None:
                    streamer(token)
                if stops and _over_dp(bool(done.all()), model, "min"):  # all dp ranks stop together
                    break
    finally:
        for mod, name, core in swapped:
            setattr(mod, name, core)
        if pipeline is not None:
            pipeline.microbatches = microbatches
        model.__dict__.pop("head", None)
        model.train(was_training)
    return ids
