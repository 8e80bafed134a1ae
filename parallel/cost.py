"""The cost of a training step under a plan: bytes held, bytes sent, FLOPs, bubble, and a predicted time.

``cuboid plans --gpus N`` ranks plans with it. Two kinds of figure:

- **Exact** (the tests hold them equal to what a run holds and sends):
  model-state bytes (parameters, gradients, optimizer state) from the
  parameters a rank really holds (the caller passes them: meta tensors of
  this rank's shards and stages) through the ZeRO formulas and bucket
  layout of :mod:`.zero`; bytes sent per group from the same formulas the
  tensor modes' tests check (:func:`.tensor.engine.step_parts`), the
  sequence split's :func:`.sequence_split.bytes_per_step`, DDP's and
  ZeRO's gradient traffic and the pipeline's sends between stages. The
  traffic is a GPT-shaped model's (token lookup, blocks, tied head,
  shifted loss); BERT and ViT heads are counted as GPT's. The optimizer
  is taken to be AdamW (LAMB and clipping add small norm all-reduces).
- **Estimated**: activation bytes (Korthikanti et al., arXiv 2205.05198,
  with flash attention: no ``s x s`` term), FLOPs (Narayanan et al.,
  arXiv 2104.04473: ``24 B s h^2 + 4 B s^2 h`` per layer forward, the
  logits ``2 B s h V``; backward twice forward, recompute once more), and
  the step time: FLOPs at the profile's sustained rate, each collective
  ``alpha + bytes / bandwidth`` on the link its group spans (inside a node
  or across nodes), the optimizer's memory traffic, and the pipeline
  bubble. Nothing overlaps (a conservative model). CPU profiles (``cores``
  set: ``local``) also price the activation elements that are not matmul
  work (``elementwise_ns``, split per plan as the activations are), and slow
  every part by what their calibration measured when all cores are busy and
  when ranks outnumber cores (an idle pipeline stage's core then serves the
  others, so the bubble shrinks).

Hardware profiles are TOML files (``parallel/hardware/*.toml``; ``local``
is measured on this machine by ``cuboid plans --calibrate``).
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from .plan import Plan

HARDWARE_DIR = Path(__file__).with_name("hardware")
ADAMW_STATE_BYTES = 8          # two fp32 moments per element (plus a 4-byte master of half-precision params)
ADAMW_TOUCHED_BYTES = 28       # an fp32 AdamW step reads p, g, m, v and writes p, m, v


# ----------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha_s`` per collective, ``bytes_per_s`` per rank and direction."""

    alpha_s: float
    bytes_per_s: float

    def time(self, nbytes: float, calls: float) -> float:
        return calls * self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Hardware:
    """A hardware profile: sustained FLOP/s per device by dtype, memory, and two links."""

    name: str
    gpus_per_node: int
    memory_bytes: float
    flops: dict                      # dtype name -> sustained FLOP/s per device
    memory_bytes_per_s: float
    intra: Link
    inter: Link
    description: str = ""
    source: str = ""
    cores: int = 0                   # CPU profiles: devices beyond this many share the cores
    elementwise_ns: float = 0.0      # CPU profiles: ns per activation element per step (norms, softmax, adds)
    busy: float = 1.0                # CPU profiles: slowdown of a rank when every core runs one
    oversubscribed: float = 1.0      # CPU profiles: extra slowdown at two ranks per core, beyond time slicing

    def rate(self, dtype: str) -> float:
        """Sustained matmul FLOP/s of one rank (GPU profiles: of training, other work included)."""
        if dtype not in self.flops:
            raise ValueError(f"hardware profile {self.name} has no FLOP/s for dtype {dtype}")
        return float(self.flops[dtype])

    def crowding(self, ranks_here: int) -> float:
        """Slowdown of every part of a rank's step when ``ranks_here`` ranks share the node's cores (CPU
        profiles; 1 on accelerators): ``busy`` once the cores are all in use, times the time slicing of
        more ranks than cores, and ``oversubscribed``'s measured extra at two ranks per core."""
        if not self.cores:
            return 1.0
        share = ranks_here / self.cores
        if share <= 1:
            return 1.0 + (self.busy - 1.0) * max(0.0, (ranks_here - 1) / max(self.cores - 1, 1))
        return self.busy * share * (1.0 + (self.oversubscribed - 1.0) * min(1.0, share - 1.0))

    def link(self, ranks: Sequence[int]) -> Link:
        """The link a group of global ``ranks`` uses: intra-node when all sit on one node."""
        nodes = {r // self.gpus_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "Hardware":
        try:
            return cls(name=d.get("name", name), gpus_per_node=int(d["gpus_per_node"]),
                       memory_bytes=float(d["memory_gb"]) * 1e9,
                       flops={k: float(v) for k, v in d["flops"].items()},
                       memory_bytes_per_s=float(d["memory_bandwidth_gbs"]) * 1e9,
                       intra=Link(float(d["intra"]["alpha_us"]) * 1e-6, float(d["intra"]["bandwidth_gbs"]) * 1e9),
                       inter=Link(float(d["inter"]["alpha_us"]) * 1e-6, float(d["inter"]["bandwidth_gbs"]) * 1e9),
                       description=d.get("description", ""), source=d.get("source", ""),
                       cores=int(d.get("cores", 0)), elementwise_ns=float(d.get("elementwise_ns", 0.0)),
                       busy=float(d.get("busy", 1.0)), oversubscribed=float(d.get("oversubscribed", 1.0)))
        except KeyError as e:
            raise ValueError(f"hardware profile {name or d.get('name', '?')} lacks the field {e.args[0]}") from None

    def to_toml(self) -> str:
        f = ", ".join(f"{k} = {v:.4g}" for k, v in self.flops.items())
        return (f'name = "{self.name}"\ndescription = "{self.description}"\nsource = "{self.source}"\n'
                f"gpus_per_node = {self.gpus_per_node}\ncores = {self.cores}\n"
                f"elementwise_ns = {self.elementwise_ns:.4g}\nbusy = {self.busy:.4g}\n"
                f"oversubscribed = {self.oversubscribed:.4g}\n"
                f"memory_gb = {self.memory_bytes / 1e9:.4g}\nmemory_bandwidth_gbs = {self.memory_bytes_per_s / 1e9:.4g}\n"
                f"flops = {{ {f} }}\n"
                f"intra = {{ alpha_us = {self.intra.alpha_s * 1e6:.4g}, bandwidth_gbs = {self.intra.bytes_per_s / 1e9:.4g} }}\n"
                f"inter = {{ alpha_us = {self.inter.alpha_s * 1e6:.4g}, bandwidth_gbs = {self.inter.bytes_per_s / 1e9:.4g} }}\n")


def user_hardware_dir() -> Path:
    """Where ``cuboid plans --calibrate`` writes ``local.toml`` (``$CUBOID_HOME/hardware``, default
    ``~/.cache/cuboid/hardware``)."""
    home = os.environ.get("CUBOID_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "cuboid")
    return Path(home) / "hardware"


def profile_names() -> list[str]:
    names = {p.stem for p in HARDWARE_DIR.glob("*.toml")} | {p.stem for p in user_hardware_dir().glob("*.toml")}
    return sorted(names)


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (the user's calibrated ones first, then the shipped ones) or a .toml path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") and path.is_file()):
        path = next((d / f"{name_or_path}.toml" for d in (user_hardware_dir(), HARDWARE_DIR)
                     if (d / f"{name_or_path}.toml").is_file()), None)
        if path is None:
            raise ValueError(f"unknown hardware profile {name_or_path!r}: give one of "
                             f"{', '.join(profile_names())} or a .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware profile {path} is not valid TOML: {e}") from None
    return Hardware.from_dict(data, path.stem)


# ----------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class Shape:
    """What the formulas read of a model config."""

    n_layers: int
    dim: int
    n_heads: int
    hidden: int                 # MLP width
    vocab_size: int             # 0: no vocabulary (ViT)
    n_positions: int
    tied_head: bool             # an LM head tied to the token embedding (GPT; BERT's MLM head)
    kv_heads: int = 0           # key/value heads (grouped-query attention); 0: n_heads
    head_dim: int = 0           # 0: dim // n_heads
    mlp_matrices: int = 2       # fc + proj; SwiGLU's gate + up + down: 3

    @classmethod
    def of(cls, config) -> "Shape":
        dim = config.dim
        hidden = getattr(config, "hidden", None) or getattr(config, "mlp_hidden", 0) or 4 * dim
        vocab = getattr(config, "vocab_size", 0) or 0
        positions = getattr(config, "n_positions", None) or (getattr(config, "n_patches", 0) + 1)
        swiglu = hasattr(config, "n_kv_heads")
        return cls(config.n_layers, dim, config.n_heads, int(hidden), int(vocab), int(positions),
                   getattr(config, "head", "") in ("lm", "mlm") and getattr(config, "tie_embeddings", True),
                   getattr(config, "n_kv_heads", 0) or 0, getattr(config, "head_dim", 0) or 0, 3 if swiglu else 2)

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head_dim."""
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values)."""
        return (self.kv_heads or self.n_heads) * (self.head_dim or self.dim // self.n_heads)


def _dtype_bytes(name: str) -> int:
    return 4 if name == "fp32" else 2


# ----------------------------------------------------------------------------- pipeline stages


@dataclass(frozen=True)
class Stage:
    """A rank's pipeline stage(s): how many blocks, and whether it holds the embeddings / the head."""

    blocks: int
    first: bool = True
    last: bool = True
    index: int = 0              # pipeline rank


def stages_of(plan: Plan, block_cuts: Sequence[range], n_layers: int) -> list[Stage]:
    """One :class:`Stage` per pipeline rank from the cut (one range per stage, two per rank for
    ``interleaved`` / ``zbv``); without pp, one stage of all ``n_layers`` blocks."""
    if plan.pp == 1:
        return [Stage(n_layers)]
    from .pipeline import stage_ids

    out = []
    n = len(block_cuts)
    for r in range(plan.pp):
        ids = stage_ids(plan.schedule, r, plan.pp)
        out.append(Stage(sum(len(block_cuts[i]) for i in ids), 0 in ids, n - 1 in ids, r))
    return out


def bubble_fraction(plan: Plan) -> float:
    """Idle time over busy time of a pipeline step: ``(pp - 1) / m`` for GPipe and 1F1B, halved by
    two interleaved stages per rank; ZBV's V with split backward is taken as a third of 1F1B's."""
    if plan.pp == 1:
        return 0.0
    m = plan.microbatches
    base = (plan.pp - 1) / m
    return {"gpipe": base, "1f1b": base, "interleaved": base / 2, "zbv": base / 3}[plan.schedule]


def in_flight(plan: Plan, stage: Stage) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if plan.pp == 1:
        return 1
    m = plan.microbatches
    if plan.schedule == "gpipe":
        return m
    return min(m, plan.pp - stage.index + (1 if plan.schedule in ("interleaved", "zbv") else 0))


# ----------------------------------------------------------------------------- bytes held


def _buckets(ps) -> list:
    """(elements, element bytes) of each ZeRO-1/2 flat bucket of trainable ``ps`` (:func:`.zero.plan_buckets`)."""
    from .zero import plan_buckets

    return [(sum(p.numel() for p in b), b[0].element_size()) for b in plan_buckets(ps)]


def _fsdp_rows(p: torch.Tensor, n: int) -> tuple:
    """(rows, rows per rank, elements per row) of FSDP2's dim-0 cut of ``p`` over ``n`` ranks."""
    rows = p.shape[0] if p.dim() else 1
    return rows, math.ceil(rows / n), p.numel() // max(rows, 1)


def _trainable(params) -> list:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def model_states(params: Sequence[torch.Tensor], plan: Plan, dp_rank: int = 0) -> dict:
    """Bytes of parameters, gradients and AdamW state this rank holds, from its parameters ``params``
    (meta tensors do: the shapes of its shards and stages) under ``plan``'s ZeRO stage over ``dp`` (under
    sp over dp x sp: :func:`.zero.group_of`).

    What :func:`.zero.model_state_bytes` measures after a backward with the optimizer's state made:
    ``params`` (ZeRO-3: this rank's rows), ``grads`` (ZeRO-2: its bucket shards), ``optimizer``
    (moments of its pieces) and ``masters`` (fp32 copies of half-precision pieces). ``dp_rank``: which
    rank of the ZeRO group (ZeRO-3's last ranks may hold fewer rows; rank 0 holds the most).
    """
    ps = _trainable(params)
    n = plan.dp * plan.sp
    pbytes = sum(p.numel() * p.element_size() for p in ps)
    frozen = sum(p.numel() * p.element_size() for p in dict.fromkeys(params) if not p.requires_grad)
    if plan.zero == 0 or n == 1:
        pieces = [(p.numel(), p.element_size()) for p in ps]
        out = {"params": pbytes + frozen, "grads": pbytes}
    elif plan.zero in (1, 2):
        pieces, grads = [], 0
        for numel, size in _buckets(ps):
            pieces.append((math.ceil(numel / n), size))
            grads += (math.ceil(numel / n) if plan.zero == 2 else numel) * size
        out = {"params": pbytes + frozen, "grads": grads}
    else:  # FSDP2 keeps rows [r ceil(R / n), (r + 1) ceil(R / n)) of every parameter on rank r
        pieces = []
        for p in ps:
            rows, chunk, per_row = _fsdp_rows(p, n)
            mine = min(chunk, max(0, rows - dp_rank * chunk))
            pieces.append((mine * per_row, p.element_size()))
        held = sum(k * s for k, s in pieces)
        out = {"params": held + frozen, "grads": held}
    out["optimizer"] = sum(k * ADAMW_STATE_BYTES for k, _ in pieces)
    out["masters"] = sum(k * 4 for k, s in pieces if s < 4)
    out["total"] = sum(out.values())
    return out


def _activation_split(plan: Plan) -> tuple:
    """(elements per token and hidden unit a rank holds of a block's 17 (Korthikanti et al.), the split of
    a block's input): 1D tensor parallelism splits 12 of them over ``tp`` (``tp_sequence`` all 17), the
    grid modes all 17."""
    split_all = plan.tp if (plan.tp_mode != "1d" or plan.tp_sequence) else 1
    return (17 / plan.tp if split_all > 1 else 5 + 12 / plan.tp), split_all


# fp32 elements per token and hidden unit a block keeps under checkpoint=selective (its matmuls' outputs, the
# fused attention's output, its input), measured, not derived: bench/checkpointing.py counts the bytes a forward
# leaves alive inside the blocks (gpt2, 12 blocks, 2 x 512 tokens, 2026-12-04: none 17.9, the 17 above; full
# 1.8; selective 11.8). On two and four gloo ranks (gpt2 shapes, 4 blocks) the same count splits it: 1D tensor
# parallelism cuts the column linears' outputs and the attention (3 + 1 + 4 = 8) and leaves the row linears'
# partial sums and the block input whole (tp=2: 7.5 measured, 7.8 here; tp=4: 5.5, 5.8); tp_sequence leaves only
# the two partial sums whole (6.8, 6.9; 4.4, 4.5); the grid modes cut all of it (2d at tp=4: 2.9, 3.0).
SELECTIVE_KEPT = 11.85
SELECTIVE_SPLIT_1D = 8.0


def _selective_elements(plan: Plan) -> float:
    """Elements per token and hidden unit a rank keeps of a block under checkpoint=selective."""
    if plan.tp == 1:
        return SELECTIVE_KEPT
    if plan.tp_mode != "1d":
        return SELECTIVE_KEPT / plan.tp
    whole = 2.0 if plan.tp_sequence else SELECTIVE_KEPT - SELECTIVE_SPLIT_1D
    return whole + (SELECTIVE_KEPT - whole) / plan.tp


def elementwise_elements(shape: Shape, plan: Plan, stage: Stage, batch: int, seq: int) -> float:
    """Activation elements a rank's blocks make in a step (split as :func:`activation_bytes` splits them;
    a third more when recomputing): what a CPU profile's ``elementwise_ns`` prices, the norms, softmax,
    adds and activations that are not matmuls."""
    tokens = batch / plan.dp * seq / plan.sp
    per, _ = _activation_split(plan)
    return stage.blocks * tokens * shape.dim * per * (4 / 3 if plan.activation_checkpoint else 1.0)


def activation_bytes(shape: Shape, plan: Plan, stage: Stage, micro_rows: int, seq: int,
                     checkpoint=None) -> float:
    """Estimated activations a rank holds at its peak (Korthikanti et al. with flash attention).

    Per block and token: 34 bytes per hidden unit in half precision (17
    elements); 1D tensor parallelism splits 12 of them over ``tp`` (with
    ``tp_sequence`` all 17), 2D/2.5D/3D and sequence parallelism split all of
    them. With checkpointing a block keeps its input (1 element) and one
    block's activations are rebuilt at a time; with selective checkpointing
    it keeps :func:`_selective_elements` (measured) and one block's others
    are rebuilt at a time. The vocab-parallel loss keeps fp32 logits for its
    rows. ``micro_rows``: sequences per micro-batch. ``checkpoint``: the
    plan's own (None), ``True``/``False`` (full or none), or a
    ``Plan.checkpoint`` name.
    """
    mode = plan.checkpoint if checkpoint is None else (
        checkpoint if isinstance(checkpoint, str) else "full" if checkpoint else "none")
    ckpt = mode == "full"
    e = _dtype_bytes(plan.dtype)
    tokens = micro_rows * seq / plan.sp
    h = shape.dim
    per, split_all = _activation_split(plan)
    per_block = tokens * h * e * per
    held_block = tokens * h * e / split_all if ckpt else per_block
    rebuilt = per_block if ckpt else 0.0  # one block's activations, made again in backward
    if mode == "selective":
        held_block = min(per_block, tokens * h * e * _selective_elements(plan))
        rebuilt = per_block - held_block
    flight = in_flight(plan, stage)
    out = flight * stage.blocks * held_block + (rebuilt if stage.blocks else 0.0)
    if stage.last and shape.vocab_size:
        out += tokens * math.ceil(shape.vocab_size / plan.tp) * 4
    if stage.first:
        out += flight * tokens * h * e / split_all
    return out


# ----------------------------------------------------------------------------- bytes sent


def _add(out: dict, key: tuple, nbytes: float, calls: float = 1.0) -> None:
    b, c = out.get(key, (0.0, 0.0))
    out[key] = (b + nbytes, c + calls)


def _all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


# collectives per block and step of each tensor mode (forward + backward), for the alpha term only:
# counted with comm.count on a 2-block GPT (2D on 4 ranks, 2.5D and 3D on 8), embeddings and head included
_TP_CALLS_PER_BLOCK = {"1d": 4, "2d": 65, "2.5d": 100, "3d": 70}


def traffic(config, plan: Plan, params: dict, stage: Stage, batch: int, seq: int, *, spec=None,
            masked: bool = False) -> dict:
    """``{(op, group): (bytes, calls)}`` one rank sends in a ``train_step`` of a ``batch`` x ``seq``
    global batch under ``plan``, in :mod:`.comm`'s convention (what ``comm.count`` measures).

    ``params``: this rank's parameters by name (meta tensors do); ``stage``: its pipeline stage;
    ``spec``: the model's :class:`~.apply.ShardingSpec` (its blocks make ZeRO-3's units, the modules its
    first and last stages share are tied over ``pp``). Bytes are exact for GPT-shaped models with AdamW
    and no clipping; ``calls`` are exact for the gradient and pipeline traffic and estimated for the
    tensor modes (they only price latency).
    """
    from .sequence_split import bytes_per_step as sp_bytes
    from .tensor.engine import mode_of, step_parts

    shape = Shape.of(config)
    out: dict = {}
    rows = batch // plan.dp
    m = plan.microbatches if plan.pp > 1 else 1
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.dtype]
    named = params
    params = list(named.values())
    ps = _trainable(params)
    pdtype = ps[0].dtype if ps else torch.float32
    ckpt = plan.activation_checkpoint

    # tensor parallelism: the stage's parts, once per micro-batch (forward again when recomputing); under
    # sp the embeddings see the whole (padded) sequence and the rest this rank's T / sp tokens, every one
    # of them a loss row (an estimate: measured 0.8% low at sp2 x tp2)
    if plan.tp > 1:
        costs = mode_of(plan.tp_mode).costs(plan, pdtype, autocast)
        if plan.sp == 1:
            parts = step_parts(costs, config, rows // m, seq)
        else:
            t = seq + (-seq) % (2 * plan.sp)
            n = rows * (t // plan.sp)
            parts = dict(step_parts(costs, config, rows, t // plan.sp), first=step_parts(costs, config, rows, t)["first"],
                         last=[costs.norm(shape.dim, n), costs.lm_loss(shape.vocab_size, shape.dim, n, n)])
        fwd_bwd = lambda xs: sum(f + b for f, b in xs)  # noqa: E731
        # recompute reruns a block's forward up to the last tensor backward needs (torch's non-reentrant
        # checkpoint stops early): under 1D that leaves out the last row linear's all-reduce, whose output
        # nothing saves; the grid modes gather that linear's operands first, so they run it all again
        redo = parts["block"][:-1] if plan.tp_mode == "1d" else parts["block"]
        again = sum(f for f, _ in redo) if ckpt else 0.0
        per_mb = stage.blocks * (fwd_bwd(parts["block"]) + again)
        per_mb += (fwd_bwd(parts["first"]) if stage.first else 0.0) + (fwd_bwd(parts["last"]) if stage.last else 0.0)
        calls = m * stage.blocks * _TP_CALLS_PER_BLOCK[plan.tp_mode] * (1.5 if ckpt else 1.0)
        _add(out, ("tensor", "tp"), m * per_mb, calls)

    # sequence parallelism (with 1D tp inside each sp rank: heads split over tp)
    if plan.sp > 1:
        elem = 2 if autocast is not None else 4
        first = {"bert": 1, "vit": 2}.get(_family(config), 0)
        kv = shape.kv_heads or shape.n_heads
        for op, b in sp_bytes(n_layers=shape.n_layers, heads=shape.n_heads // plan.tp,
                              kv_heads=kv // plan.tp if kv % plan.tp == 0 else 1, head_dim=shape.q_dim // shape.n_heads,
                              batch=rows, seq=seq, sp=plan.sp, mode=plan.sp_mode, masked=masked, elem=elem,
                              dim=shape.dim, first_token=first, recompute=ckpt).items():
            _add(out, (op, "sp"), b, shape.n_layers * (plan.sp - 1) if op == "send" else shape.n_layers)

    # gradients over dp (x sp): DDP's buckets, ZeRO's reduce-scatter + all-gather, or FSDP2's units
    n = plan.dp * plan.sp
    grad_bytes = sum(p.numel() * p.element_size() for p in ps)
    if n > 1 and plan.zero == 0:
        group = "dpsp" if plan.sp > 1 else "dp"
        _add(out, ("all_reduce", group), _all_reduce(n, grad_bytes), max(1, math.ceil(grad_bytes / (25 * 2 ** 20))))
    elif n > 1 and plan.zero in (1, 2):
        group = "dpsp" if plan.sp > 1 else "dp"
        for numel, size in _buckets(ps):
            padded = math.ceil(numel / n) * n * size
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded)
            _add(out, ("all_gather", group), (n - 1) / n * padded)
    elif n > 1 and plan.zero == 3:
        group = "dpsp" if plan.sp > 1 else "dp"
        blocks = (spec.blocks if spec is not None else "blocks") + "."
        trainable = {id(p) for p in ps}
        for name, p in named.items():
            if id(p) not in trainable:
                continue
            _, chunk, per_row = _fsdp_rows(p, n)
            padded = chunk * n * per_row * p.element_size()
            gathers = 2 if name.startswith(blocks) else 1  # the root unit stays gathered into backward
            _add(out, ("all_gather", group), gathers * (n - 1) / n * padded, 0)
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded, 0)
        units = shape.n_layers + 1
        _add(out, ("all_gather", group), 0.0, 2 * units - 1)
        _add(out, ("reduce_scatter", group), 0.0, units)

    # the pipeline: activations forward, their gradients back, the tied embedding, the loss
    if plan.pp > 1:
        _add_pipeline(out, shape, plan, stage, rows, seq, masked, named, spec)

    # train_step's scalars: the label count and the loss summed over dp (float64 on CPU)
    if plan.dp > 1:
        _add(out, ("all_reduce", "dp"), 2 * _all_reduce(plan.dp, 8), 2)
    return out


def _family(config) -> str:
    name = type(config).__name__.lower()
    return "bert" if "bert" in name else "vit" if "vit" in name else "gpt"


def _add_pipeline(out: dict, shape: Shape, plan: Plan, stage: Stage, rows: int, seq: int, masked: bool,
                  named: dict, spec) -> None:
    m = plan.microbatches
    micro = rows // m
    e = 4  # the stream stays fp32 between stages (autocast casts inside the blocks)
    act = micro * seq * shape.dim * e / (plan.tp if plan.tp_mode != "1d" else 1)  # 2D/3D: this rank's block
    block_rows = micro // plan.batch_parts
    extra = block_rows * 8 * (seq if masked else 1) + block_rows * seq * 8  # mask (int64; (B, 1) ones), labels
    if not stage.last:  # x and the residual forward, with the mask and labels
        _add(out, ("send", "pp"), m * (2 * act + extra), 4 * m)
    if not stage.first:  # the gradients of x and the residual back
        _add(out, ("send", "pp"), m * 2 * act, 2 * m)
    shared = set(spec.first) & set(spec.last) if spec is not None else set()
    tied = [p for name, p in named.items() if p.requires_grad and name.rsplit(".", 1)[0] in shared]
    if tied and stage.first != stage.last:  # summed over the first and last stage's ranks (a pair)
        _add(out, ("all_reduce", "pp_embed"), sum(_all_reduce(2, p.numel() * p.element_size()) for p in tied),
             len(tied))
    _add(out, ("broadcast", "pp"), (plan.pp - 1) / plan.pp * 8, 1)


# ----------------------------------------------------------------------------- FLOPs and time


def step_flops(shape: Shape, batch: int, seq: int, recompute: bool = False, *, parts: bool = False):
    """FLOPs of one training step over a ``batch`` x ``seq`` global batch (Narayanan et al.):
    per block forward ``2 B s (4 h^2 + 2 h f) + 4 B s^2 h``, the logits ``2 B s h V``; backward
    twice forward, recompute one forward of the blocks more. Grouped-query attention and SwiGLU
    (Llama): ``2 B s ((2 q + 2 kv) h + 3 h f) + 4 B s^2 q`` with ``q``, ``kv`` the query and key
    widths. ``parts``: (all blocks, head) apart."""
    h, f = shape.dim, shape.hidden
    q, kv = shape.q_dim, shape.kv_dim
    block = 2 * batch * seq * ((2 * q + 2 * kv) * h + shape.mlp_matrices * h * f) + 4 * batch * seq * seq * q
    blocks = (3 + (1 if recompute else 0)) * shape.n_layers * block
    head = 3 * 2 * batch * seq * h * shape.vocab_size
    return (blocks, head) if parts else blocks + head


@dataclass
class Estimate:
    """Everything ``cuboid plans`` says of one plan (per rank: the busiest one)."""

    plan: Plan
    name: str = ""
    fits: bool = True
    why: str = ""
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    masters: float = 0.0
    activations: float = 0.0
    activations_checkpointed: float = 0.0
    sent: dict = field(default_factory=dict)      # group -> bytes
    sent_total: float = 0.0
    bubble: float = 0.0
    flops: float = 0.0                             # this rank's FLOPs per step
    compute_s: float = 0.0
    comm_s: float = 0.0
    optimizer_s: float = 0.0
    bubble_s: float = 0.0
    step_s: float = 0.0
    memory: float = 0.0                            # model states + activations (as the plan checkpoints)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.describe()
        return d


def tensor_axes(plan: Plan) -> tuple:
    """The groups a tensor mode's traffic runs over (its grid's axes)."""
    if plan.tp == 1:
        return ()
    return {"1d": ("tp",), "2d": ("tp_row", "tp_col")}.get(plan.tp_mode, ("tp_row", "tp_col", "tp_dep"))


def predict(config, plan: Plan, rank_params: dict, hw: Hardware, batch: int, seq: int, *, spec=None,
            block_cuts: Sequence[range] = (), masked: bool = False, name: str = "",
            layers_only: bool = False) -> Estimate:
    """The :class:`Estimate` of ``plan`` for a model of ``config`` on ``hw``.

    ``rank_params``: ``{rank: {name: parameter}}`` for the ranks to look at (meta tensors of each one's
    shards and stages); the figures are the busiest of them. ``spec``: the model's sharding spec;
    ``block_cuts``: the pipeline's block ranges per stage; ``layers_only``: the blocks without embeddings
    and head (what the tensor-parallel papers time). A grid mode's traffic is split evenly over its axes,
    each priced on the link its group spans.
    """
    shape = Shape.of(config)
    if layers_only:
        stages = [Stage(shape.n_layers, first=False, last=False)]
    else:
        stages = stages_of(plan, block_cuts, shape.n_layers)
    est = Estimate(plan=plan, name=name)
    per_node = min(hw.gpus_per_node, plan.world_size)
    rate = hw.rate(plan.dtype)
    crowd = hw.crowding(per_node)
    from .mesh import Mesh

    worst = -1.0
    for rank, params in rank_params.items():
        mesh = Mesh.layout(plan, rank)
        stage = stages[mesh.coords.get("pp", 0)]
        states = model_states(list(params.values()), plan)
        micro = batch // plan.dp // (plan.microbatches if plan.pp > 1 else 1)
        act = activation_bytes(shape, plan, stage, micro, seq, checkpoint=False)
        act_ck = activation_bytes(shape, plan, stage, micro, seq, checkpoint=True)
        sent = traffic(config, plan, params, stage, batch, seq, spec=spec, masked=masked)
        comm_s, by_group = 0.0, {}
        for (op, group), (nbytes, calls) in sent.items():
            axes = tensor_axes(plan) if op == "tensor" else (group,)
            for a in axes:
                link = hw.link(mesh.group_ranks.get(a, [rank]))
                comm_s += link.time(nbytes / len(axes), calls / len(axes)) * crowd
            by_group[group] = by_group.get(group, 0.0) + nbytes
        block_share = stage.blocks / max(shape.n_layers, 1)
        blocks, head = step_flops(shape, batch, seq, plan.activation_checkpoint, parts=True)
        flops = (blocks * block_share + (head if stage.last else 0.0)) / (plan.dp * plan.tp * plan.sp)
        compute_s = (flops / rate + elementwise_elements(shape, plan, stage, batch, seq)
                     * hw.elementwise_ns * 1e-9) * crowd
        # an idle stage's core goes to the other ranks when there are more ranks than cores (CPU profiles)
        idle = max(0.0, 2.0 - per_node / hw.cores) if hw.cores and per_node > hw.cores else 1.0
        bubble_s = compute_s * bubble_fraction(plan) * min(idle, 1.0)
        opt_bytes = sum(p.numel() for p in _trainable(params.values())) / (plan.dp * plan.sp if plan.zero else 1) * ADAMW_TOUCHED_BYTES
        optimizer_s = opt_bytes / hw.memory_bytes_per_s * crowd
        step = compute_s + bubble_s + comm_s + optimizer_s
        held = activation_bytes(shape, plan, stage, micro, seq)  # as the plan checkpoints: none, full or selective
        if states["total"] + held > est.memory:
            est.memory, memory_parts = states["total"] + held, (states["total"], held)
        if step > worst:
            worst = step
            est.params, est.grads = states["params"], states["grads"]
            est.optimizer, est.masters = states["optimizer"], states["masters"]
            est.activations, est.activations_checkpointed = act, act_ck
            est.sent, est.sent_total = by_group, sum(by_group.values())
            est.bubble, est.flops = bubble_fraction(plan), flops
            est.compute_s, est.comm_s, est.optimizer_s, est.bubble_s, est.step_s = (
                compute_s, comm_s, optimizer_s, bubble_s, step)
    if est.memory > hw.memory_bytes:
        states, held = memory_parts
        est.fits = False
        est.why = (f"needs {est.memory / 1e9:.1f} GB per rank ({states / 1e9:.1f} GB model states, {held / 1e9:.1f} GB "
                   f"activations{' checkpointed' if plan.activation_checkpoint else ''}), more than the "
                   f"{hw.memory_bytes / 1e9:.0f} GB of a {hw.name} device")
    return est
