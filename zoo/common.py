"""Blocks shared by the zoo models, written like single-device code.

The transformer block comes in two flavours: pre-LN (GPT-2, ViT) and post-LN
(BERT). Both use the fused residual norm of :class:`cuboid.parallel.layers.LayerNorm`
and the attention kernel. Submodule names (``attn.qkv``, ``attn.proj``,
``mlp.fc``, ``mlp.proj``, ``ln1``, ``ln2``) are public: sharding specs and
checkpoints address them.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from cuboid.parallel import layers as L
from cuboid.parallel.head import Deferred, lazy
from cuboid.parallel.mask import Mask


def _field(name: str) -> property:
    """An :class:`Output` field: stored raw in the instance's ``_raw`` dict, a Deferred value made on first read."""

    def get(self):
        value = self._raw[name]
        if isinstance(value, Deferred):
            value = value.resolve()
            self._raw[name] = value
        return value

    def put(self, value) -> None:
        self._raw[name] = value

    return property(get, put, doc=f"the ``{name}`` field (made on first read where deferred)")


class Output:
    """What every zoo model returns, with single-device shapes and values under every plan.

    ``logits``: task logits, or the last hidden states for a base model;
    ``loss``: mean cross-entropy when ``labels`` were given (-100 ignored);
    ``pooler_output``: BERT/ViT pooled vector where the model has a pooler;
    ``token_logps``, ``token_entropy``: a causal LM's (B, T - 1) log-probability
    of each next token and entropy of each next-token distribution, when the
    forward was asked for them (``logprobs=True``; see :func:`lm_output`).

    Fields may be stored as :class:`~cuboid.parallel.head.Deferred` and are
    made on first read: under tensor parallelism the whole logits are gathered
    from vocab (or batch) shards only when someone reads ``out.logits``, so a
    training step that only uses ``out.loss`` never gathers them. Reading such
    a field is a collective: every rank of the model reads it. ``raw(name)``
    reads a field as stored (a Deferred stays one); ``FIELDS`` names them.

    Not a dataclass on purpose: hook machinery that walks dataclass fields
    (FSDP2's pre-backward hooks on a ZeRO-3 root) would read, and so gather,
    the deferred fields on every forward. The fields are properties over a
    dict, with the default attribute lookup, so that ``torch.compile`` traces
    the model's construction of its Output (Dynamo refuses classes that
    override ``__getattribute__``).
    """

    FIELDS = ("logits", "loss", "last_hidden_state", "pooler_output", "token_logps", "token_entropy")

    logits = _field("logits")
    loss = _field("loss")
    last_hidden_state = _field("last_hidden_state")
    pooler_output = _field("pooler_output")
    token_logps = _field("token_logps")
    token_entropy = _field("token_entropy")

    def __init__(self, logits: torch.Tensor, loss: Optional[torch.Tensor] = None,
                 last_hidden_state: Optional[torch.Tensor] = None, pooler_output: Optional[torch.Tensor] = None,
                 token_logps: Optional[torch.Tensor] = None, token_entropy: Optional[torch.Tensor] = None):
        self._raw = {"logits": logits, "loss": loss, "last_hidden_state": last_hidden_state,
                     "pooler_output": pooler_output, "token_logps": token_logps, "token_entropy": token_entropy}

    def __repr__(self) -> str:
        def show(name):
            v = self._raw[name]
            return "deferred" if isinstance(v, Deferred) else (tuple(v.shape) if torch.is_tensor(v) else v)

        return f"{type(self).__name__}({', '.join(f'{n}={show(n)}' for n in self.FIELDS)})"

    def raw(self, name: str):
        """Field ``name`` as stored: a :class:`~cuboid.parallel.head.Deferred` is returned unmade."""
        if name not in self._raw:
            raise KeyError(f"Output has no field {name!r}; its fields are {self.FIELDS}")
        return self._raw[name]

    def is_deferred(self, name: str) -> bool:
        """Whether field ``name`` has not been made yet (reading it would gather)."""
        return isinstance(self.raw(name), Deferred)

    def defer(self, name: str, fn) -> None:
        """Replace field ``name`` by a deferred ``fn(value)`` (None stays None)."""
        value = self.raw(name)
        if value is None:
            return
        self._raw[name] = value.then(fn) if isinstance(value, Deferred) else Deferred(fn, value)


class Decoder(nn.Module):
    """Base of the zoo's causal LMs (GPT-2, the Llama family): :meth:`generate`."""

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **options):
        """Left-padded prompts followed by generated tokens, with a key/value cache: see
        :func:`cuboid.zoo.generation.generate` (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``eos_token_id``, ``pad_token_id``, ``seed``, ``streamer``)."""
        from .generation import generate

        return generate(self, input_ids, attention_mask, **options)


class MLP(nn.Module):
    """fc -> GELU -> proj, (B, T, C) -> (B, T, C)."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none", dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = L.Linear(dim, hidden)
        self.proj = L.Linear(hidden, dim)
        self.approximate = approximate
        self.dropout = L.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(L.gelu(self.fc(x), self.approximate)))


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection.

    ``qkv`` holds [W_q; W_k; W_v] stacked on the output dim, heads contiguous
    inside each. The number of heads is read off the (possibly sharded)
    projection, so a column-split ``qkv`` runs its local heads unchanged.
    """

    def __init__(self, dim: int, n_heads: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {n_heads} heads")
        self.head_dim = dim // n_heads
        self.causal = causal
        self.qkv = L.Linear(dim, 3 * dim)
        self.core = L.Attention()
        self.proj = L.Linear(dim, dim)
        self.dropout = L.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: Optional[Mask] = None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 * H * D); T read off the projection (it gathers a sequence-sharded x)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        y = self.core(q, k, v, causal=self.causal, mask=mask)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)
        return self.dropout(self.proj(y))


class Block(nn.Module):
    """One transformer block.

    Pre-LN (``pre_ln=True``) carries the residual stream beside the block
    output so that each norm fuses the residual add:
    ``forward(x, residual) -> (x', residual')`` where the true hidden state is
    ``x' + residual'``. Post-LN (BERT) returns the normalised hidden state and
    ``None``.
    """

    def __init__(self, dim: int, n_heads: int, mlp_hidden: int, *, eps: float, pre_ln: bool,
                 causal: bool, approximate: str = "none", dropout: float = 0.0) -> None:
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1 = L.LayerNorm(dim, eps)
        self.attn = SelfAttention(dim, n_heads, causal, dropout)
        self.ln2 = L.LayerNorm(dim, eps)
        self.mlp = MLP(dim, mlp_hidden, approximate, dropout)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                mask: Optional[Mask] = None):
        if self.pre_ln:
            return pre_norm(self, x, residual, mask)
        x, _ = self.ln1(self.attn(x, mask), x)
        x, _ = self.ln2(self.mlp(x), x)
        return x, None


FUSE_ROWS = 256  # below this many rows (a decoding step) stacking the weights costs more than it saves


def lm_output(table: nn.Module, h: torch.Tensor, labels: Optional[torch.Tensor], logprobs: bool = False) -> Output:
    """A causal LM's Output from its final hidden states ``h`` (B, T, C) and its head's ``table`` (a
    :class:`~cuboid.parallel.head.TiedHead`): with ``labels`` (B, T) (token t predicts label t + 1) the loss of
    the fused linear cross-entropy, vocab-parallel under tp, and the (B, T, V) logits made only when read;
    with ``logprobs`` also ``token_logps`` and ``token_entropy`` (B, T - 1), from the same pass (``labels``
    given: the forward puts ``input_ids`` in when the batch has none)."""
    if not logprobs:
        loss, logits = table.lm_outputs(h, labels, shift=True)
        return Output(logits=logits, loss=loss, last_hidden_state=h)
    loss, logits, logps, entropy = table.lm_logprobs(h, labels)
    return Output(logits=logits, loss=loss, last_hidden_state=h, token_logps=logps, token_entropy=entropy)


def last_tokens(input_ids: torch.Tensor, pad_token_id: Optional[int]) -> torch.Tensor:
    """(B,) index of each row's last token that is not padding, which a decoder's classification head reads
    (transformers' ``*ForSequenceClassification``: the rightmost id that is not ``pad_token_id``, whatever the
    side of the padding; the last position when there is no pad id)."""
    T = input_ids.shape[1]
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], T - 1, device=input_ids.device)
    kept = (input_ids != pad_token_id).long()
    return (torch.arange(T, device=input_ids.device) * kept).argmax(-1)


def classifier_output(classifier: nn.Module, h: torch.Tensor, last: Optional[torch.Tensor],
                      labels: Optional[torch.Tensor], family: str) -> Output:
    """A decoder's sequence-classification Output: ``classifier`` (HF's ``score``) on the final hidden states
    ``h`` (B, T, C) at each row's ``last`` token (:func:`last_tokens`); with ``labels`` (B,) the mean
    cross-entropy. ``last`` None: the plan did not hand the head the rows' last tokens (a one-sentence error)."""
    if last is None:
        raise ValueError(f"a {family} classification head reads each row's last token (from input_ids), which "
                         "this forward did not pass to the head")
    pooled = h[torch.arange(h.shape[0], device=h.device), last]  # (B, C)
    local = classifier(pooled)  # (B, num_labels)
    loss = classifier.loss_from_logits(local, labels) if labels is not None else None
    return Output(logits=lazy(classifier.gather_logits, local), loss=loss, last_hidden_state=h)


def linears(x: torch.Tensor, layers: tuple) -> list:
    """``[layer(x) for layer in layers]``, as one matmul over the stacked weights where every layer is a
    plain (unsharded) :class:`~cuboid.parallel.layers.Linear` with or without a bias alike: one larger matmul
    each way instead of several (less matmul time on CPU: bench/RESULTS.md), for inputs of at least FUSE_ROWS
    rows: a decoding step's few rows would pay more for stacking the weights than the
    matmuls cost. Sharded layers, and layers with forward hooks (LoRA adapters), run their own forward.
    The outputs are strided views of one tensor whose gradients backward concatenates, which costs more than
    the stacked matmul saves for Llama's wide gate/up pair (its MLP calls the two layers: see its comment)."""
    rows = x.numel() // max(x.shape[-1], 1)
    plain = all(type(m) is L.Linear and not m._forward_hooks for m in layers) and len({m.bias is None for m in layers}) == 1
    if len(layers) > 1 and plain and rows >= FUSE_ROWS:
        weight = torch.cat([m.weight for m in layers])
        bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
        return list(torch.nn.functional.linear(x, weight, bias).split([m.out_features for m in layers], -1))
    return [m(x) for m in layers]


def pre_norm(block: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor],
             mask: Optional[Mask]) -> tuple:
    """A pre-norm block's ``(x', residual')`` from its ``ln1``, ``attn``, ``ln2`` and ``mlp`` (GPT-2, ViT, Llama):
    each norm fuses the residual add, and the true hidden state is ``x' + residual'``. ``mask``: the
    :class:`~cuboid.parallel.mask.Mask` the model built, handed to the attention core unchanged."""
    if residual is None:
        h, residual = block.ln1(x), x
    else:
        h, residual = block.ln1(x, residual)
    x = block.attn(h, mask)
    h, residual = block.ln2(x, residual)
    return block.mlp(h), residual


def attention_mask_of(input_ids: torch.Tensor, attention_mask=None,
                      position_ids: Optional[torch.Tensor] = None) -> Optional[Mask]:
    """The :class:`~cuboid.parallel.mask.Mask` a model's blocks pass to their attention cores, from HF's
    ``attention_mask`` (1 = token) and ``position_ids`` (restarting at 0 at each document of a packed row),
    on the whole rows of ``input_ids``: None when no key is masked and no position is given."""
    return Mask.of(attention_mask, position_ids, input_ids.shape[0])


# ---------------------------------------------------------------- initialisation


def param_seed(seed: int, name: str) -> int:
    """A seed per (model seed, parameter name): init is the same under any plan or order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sharded_parameters(model: nn.Module) -> Iterator[tuple[str, L.ShardedModule, str, torch.Tensor]]:
    """(full name, owning layer, local name, tensor) for every parameter, each once (ties skipped)."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for local, p in mod._parameters.items():  # named_parameters(recurse=False), each tensor once below
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if not isinstance(mod, L.ShardedModule):
                raise TypeError(f"{mod_name}.{local} belongs to {type(mod).__name__}, not a cuboid layer")
            yield (f"{mod_name}.{local}" if mod_name else local), mod, local, p


def init_parameters(model: nn.Module, rule: Callable[[str, torch.Size], tuple[str, float]], seed: int) -> None:
    """Initialise every parameter from ``rule(name, full_shape) -> (kind, value)``.

    kind is ``normal`` (std=value), ``trunc_normal`` (std=value, cut at 2 std),
    ``zeros`` or ``ones``. Each full tensor is drawn on CPU from its own
    generator (:func:`param_seed`) and handed to the layer's ``load_full``, so
    a sharded rank keeps just its slice and holds one full tensor at a time.
    Meta parameters are materialised first (``to_empty``) where needed.
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("materialise the model first (model.to_empty(device=...)), then initialise")
    for name, mod, local, _ in sharded_parameters(model):
        shape = mod.full_shape(local)
        kind, value = rule(name, shape)
        if kind in ("zeros", "ones"):
            full = torch.zeros(shape) if kind == "zeros" else torch.ones(shape)
        else:
            g = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(shape)
            if kind == "normal":
                full.normal_(0.0, value, generator=g)
            elif kind == "trunc_normal":
                nn.init.trunc_normal_(full, std=value, a=-2 * value, b=2 * value, generator=g)
            else:
                raise ValueError(f"unknown init kind {kind!r} for {name}")
        mod.load_full(local, full)


def standard_rule(kind: str, std: float, zero: tuple = ()) -> Callable[[str, torch.Size], tuple]:
    """BERT/ViT-style init: biases (and ``zero`` names) 0, norm weights 1, other weights ``kind`` with ``std``."""
    def rule(name: str, shape: torch.Size):
        if name.endswith("bias") or name in zero:
            return "zeros", 0.0
        if name.split(".")[-2].startswith("ln") or "_ln" in name.split(".")[-2]:
            return "ones", 0.0
        return kind, std
    return rule


def count_parameters(model: nn.Module) -> int:
    """Parameters of the full (unsharded) model, tied weights counted once."""
    return sum(int(torch.Size(mod.full_shape(local)).numel()) for _, mod, local, _ in sharded_parameters(model))


def count_targets(labels: Optional[torch.Tensor], shift: bool = False) -> int:
    """How many label positions a mean loss averages over (-100 ignored; shifted for causal LM)."""
    if labels is None:
        return 0
    if shift:
        labels = labels[:, 1:]
    return int((labels != -100).sum())
