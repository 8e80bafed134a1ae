"""Bytes a rank holds under a plan: model states (exact) and activations, copies and temporaries (estimated).

- **Model states** (:func:`model_states`, exact: the tests hold them equal to
  what :func:`.zero.model_state_bytes` measures): parameters, gradients, AdamW
  moments and fp32 masters of the rank's own pieces, in the layout its
  parameters have. Two layouts are costed (:func:`layout_of`): fp32 weights
  under autocast (``autocast``: 4 + 4 + 8/N bytes per parameter, gradients
  reduced in fp32) and half-precision weights with fp32 masters (``half``:
  2 + 2 + 12/N, the ZeRO paper's layout, ``cuboid.load(dtype=torch.bfloat16)``);
  ``fp32`` is fp32 training.
- **Activations** (:func:`activation_bytes`: Korthikanti et al., arXiv
  2205.05198, with flash attention; :func:`held_activations`: the bytes the
  code keeps, measured per layout: the residual stream stays fp32 under
  autocast, a checkpointed block keeps its input and the residual).
- **Peak** (:func:`peak_bytes`): the states, the activations of the micro-batches
  in flight, autocast's half-precision weight copies saved for backward (every
  block's linears; whole copies under ZeRO-3, whose gathered units FSDP2 keeps
  too), the fused loss head's saved gradients, the table its late logits
  keep where that is not the parameter (ZeRO-3, 2D/3D) and its logits
  chunk, and what stays between steps: DDP's gradient buckets and the
  pipeline's receive buffers (:func:`pipeline_buffers`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..plan import Plan
from .shape import Shape, Stage, dtype_bytes, in_flight

ADAMW_STATE_BYTES = 8          # two fp32 moments per element (plus a 4-byte master of half-precision params)
ADAMW_TOUCHED_BYTES = 28       # an fp32 AdamW step reads p, g, m, v and writes p, m, v
LAYOUTS = ("fp32", "autocast", "half")


def gradient_buckets(ps) -> list:
    """(elements, element bytes) of each ZeRO-1/2 flat bucket of trainable ``ps`` (:func:`.zero.plan_buckets`)."""
    from ..zero import plan_buckets

    return [(sum(p.numel() for p in b), b[0].element_size()) for b in plan_buckets(ps)]


def fsdp_rows(p: torch.Tensor, n: int) -> tuple:
    """(rows, rows per rank, elements per row) of FSDP2's dim-0 cut of ``p`` over ``n`` ranks."""
    rows = p.shape[0] if p.dim() else 1
    return rows, math.ceil(rows / n), p.numel() // max(rows, 1)


def trainable(params) -> list:
    """The parameters of ``params`` that take gradients, each once (tied ones appear under two names)."""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def expert_parameters(named: dict, spec) -> list:
    """The parameters among ``named`` (name -> parameter) of the modules ``spec`` gives the role ``experts``: a
    mixture-of-experts layer's experts, sharded over ``ep`` and averaged (and ZeRO-sharded) over ``edp``, the
    ``dp x sp / ep`` ranks holding the same experts (:mod:`cuboid.parallel.experts`). None without a spec."""
    if spec is None:
        return []
    return [p for n, p in named.items() if "." in n and _role(spec, n.rsplit(".", 1)[0]) == "experts"]


_ROLES: dict = {}  # (id(spec), module path) -> (spec, role): the planner asks for every parameter of every plan


def _role(spec, path: str):
    """``spec.role_of(path)``, remembered (the spec is kept with its answers, so its id is not reused)."""
    hit = _ROLES.get((id(spec), path))
    if hit is None or hit[0] is not spec:
        hit = _ROLES[id(spec), path] = (spec, spec.role_of(path))
    return hit[1]


def model_states(params: Sequence[torch.Tensor], plan: Plan, dp_rank: int = 0, *, experts=(),
                 quantized: int = 0) -> dict:
    """Bytes of parameters, gradients and AdamW state this rank holds, from its parameters ``params``
    (meta tensors do: the shapes of its shards and stages) under ``plan``'s ZeRO stage over ``dp`` (under
    sp over dp x sp: :func:`.zero.group_of`).

    What :func:`.zero.model_state_bytes` measures after a backward with the optimizer's state made:
    ``params`` (ZeRO-3: this rank's rows), ``grads`` (ZeRO-2: its bucket shards), ``optimizer``
    (moments of its pieces) and ``masters`` (fp32 copies of half-precision pieces). ``dp_rank``: which
    rank of the ZeRO group (ZeRO-3's last ranks may hold fewer rows; rank 0 holds the most). ``experts``:
    those of ``params`` that are a mixture of experts' experts (:func:`expert_parameters`): this rank's
    ``E / ep`` experts, whose ZeRO group is ``edp`` (``dp x sp / ep`` ranks) with buckets and units of their
    own; ``dp_rank`` is the rank's index ``d`` among the ``dp x sp`` ranks, in ``edp`` ``d // ep`` (the
    mesh's layout: runs of ``ep`` consecutive ranks hold every expert once). ``quantized``: bytes of a
    frozen 4-bit base this rank keeps as buffers (:func:`cuboid.parallel.quant.quantized_bytes`), counted
    with the parameters: no gradient, no optimizer state, no ZeRO shard.
    """
    ps = trainable(params)
    mine = {id(p) for p in experts} if plan.ep > 1 else set()  # without ep the experts are parameters like others
    groups = [([p for p in ps if id(p) not in mine], plan.dp * plan.sp, dp_rank),
              ([p for p in ps if id(p) in mine], plan.dp * plan.sp // plan.ep, dp_rank // plan.ep)]
    frozen = sum(p.numel() * p.element_size() for p in dict.fromkeys(params) if not p.requires_grad)
    out = {"params": frozen + quantized, "grads": 0, "optimizer": 0, "masters": 0}
    for group, n, rank in groups:
        if group:
            _add_states(out, group, plan.zero, n, rank)
    out["total"] = sum(out.values())
    return out


def _add_states(out: dict, ps: list, zero: int, n: int, dp_rank: int) -> None:
    """Add to ``out`` the states of trainable ``ps`` under ZeRO stage ``zero`` over ``n`` ranks."""
    pbytes = sum(p.numel() * p.element_size() for p in ps)
    if zero == 0 or n == 1:
        pieces = [(p.numel(), p.element_size()) for p in ps]
        out["params"] += pbytes
        out["grads"] += pbytes
    elif zero in (1, 2):
        pieces = []
        for numel, size in gradient_buckets(ps):
            pieces.append((math.ceil(numel / n), size))
            out["grads"] += (math.ceil(numel / n) if zero == 2 else numel) * size
        out["params"] += pbytes
    else:  # FSDP2 keeps rows [r ceil(R / n), (r + 1) ceil(R / n)) of every parameter on rank r
        pieces = []
        for p in ps:
            rows, chunk, per_row = fsdp_rows(p, n)
            held = min(chunk, max(0, rows - dp_rank * chunk))
            pieces.append((held * per_row, p.element_size()))
        held = sum(k * s for k, s in pieces)
        out["params"] += held
        out["grads"] += held
    out["optimizer"] += sum(k * ADAMW_STATE_BYTES for k, _ in pieces)
    out["masters"] += sum(k * 4 for k, s in pieces if s < 4)


def _activation_split(plan: Plan) -> tuple:
    """(elements per token and hidden unit a rank holds of a block's 17 (Korthikanti et al.), the split of
    a block's input): 1D tensor parallelism splits 12 of them over ``tp`` (``tp_sequence`` all 17), the
    grid modes all 17."""
    split_all = plan.tp if (plan.tp_mode != "1d" or plan.tp_sequence) else 1
    return (17 / plan.tp if split_all > 1 else 5 + 12 / plan.tp), split_all


# fp32 elements per token and hidden unit a block keeps under checkpoint=selective (its matmuls' outputs, the
# fused attention's output, its input), measured, not derived: bench/checkpointing.py counts the bytes a forward
# leaves alive inside the blocks (gpt2 shapes; bench/RESULTS.md has the counts). Of these, 1D tensor parallelism
# cuts the column linears' outputs and the attention (3 + 1 + 4 = SELECTIVE_SPLIT_1D) and leaves the row linears'
# partial sums and the block input whole; tp_sequence leaves only the two partial sums whole; the grid modes cut
# all of it.
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
    per_token = shape.dim * per + shape.routed_elements()
    return stage.blocks * tokens * per_token * (4 / 3 if plan.checkpoint == "full" else 1.0)


def activation_bytes(shape: Shape, plan: Plan, stage: Stage, micro_rows: int, seq: int,
                     checkpoint=None) -> float:
    """Estimated activations a rank holds at its peak (Korthikanti et al. with flash attention).

    Per block and token: 34 bytes per hidden unit in half precision (17
    elements; a sparse layer's routing keeps :meth:`.Shape.routed_elements` more, in fp32, unsplit by tensor
    parallelism); 1D tensor parallelism splits 12 of them over ``tp`` (with
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
    e = dtype_bytes(plan.dtype)
    tokens = micro_rows * seq / plan.sp
    h = shape.dim
    per, split_all = _activation_split(plan)
    per_block = tokens * (h * e * per + 4 * shape.routed_elements())
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


# ----------------------------------------------------------------------------- what the code keeps (peak)

# bytes per token and hidden unit one block keeps for backward at tp = 1, per layout, measured on CPU with
# RssAnon and the held-bytes count (bench/checkpointing.py, bench/memory_model.py; gpt2 shapes, no dropout):
# without checkpointing fp32 keeps 17.94 elements; under bf16 autocast with fp32 weights 36.2 bytes (Korthikanti's
# 34 without dropout masks, plus the residual stream that stays fp32).
# A fully checkpointed block keeps its input and the residual: 2 fp32 elements, a bf16 input plus the fp32
# residual under autocast (6 bytes), two half tensors with half weights.
BLOCK_BYTES = {"none": {"fp32": 71.8, "autocast": 36.2, "half": 36.2},
               "full": {"fp32": 8.0, "autocast": 6.0, "half": 6.0}}
# fp32 temporaries of the optimizer step per element of the rank's pieces: the foreach AdamW's two (the square
# root of v and the update), a third with half weights (the gradient in fp32); measured with RssAnon on CPU
# (bench/memory_model.py: the bf16 rows, whose activations are small, peak in the step)
OPTIMIZER_TEMPORARIES = {"fp32": 2.0, "autocast": 2.0, "half": 3.0}


def layout_of(plan: Plan, param_dtype=None) -> str:
    """``fp32`` (fp32 training), ``autocast`` (fp32 weights, half autocast) or ``half`` (half weights, fp32
    masters) for a plan whose parameters are ``param_dtype`` (default fp32)."""
    if param_dtype is not None and param_dtype in (torch.bfloat16, torch.float16):
        return "half"
    return "fp32" if plan.dtype == "fp32" else "autocast"


def held_activations(shape: Shape, plan: Plan, stage: Stage, micro_rows: int, seq: int, layout: str,
                     parts: bool = False):
    """Bytes the blocks of ``stage`` keep for backward at the peak (the end of a forward, every micro-batch in
    flight), as the code keeps them in ``layout`` (:data:`BLOCK_BYTES`), split over the tensor and sequence
    ranks as :func:`activation_bytes` splits them, plus one block's activations rebuilt under recompute.
    ``parts``: (kept after the forward, rebuilt in backward) apart."""
    tokens, h = micro_rows * seq / plan.sp, shape.dim
    per, split_all = _activation_split(plan)
    none = tokens * (h * BLOCK_BYTES["none"][layout] * per / 17 + 4 * shape.routed_elements())
    full = tokens * h * BLOCK_BYTES["full"][layout] / split_all
    mode = plan.checkpoint
    held, rebuilt = none, 0.0
    if mode == "full":
        held, rebuilt = full, none
    elif mode == "selective":
        ratio = BLOCK_BYTES["none"][layout] / BLOCK_BYTES["none"]["fp32"]
        held = min(none, tokens * h * _selective_elements(plan) * 4 * ratio)
        rebuilt = none - held
    kept, again = in_flight(plan, stage) * stage.blocks * held, (rebuilt if stage.blocks else 0.0)
    return (kept, again) if parts else kept + again


def _block_matrices(params: dict, blocks: str = "blocks.", experts=()) -> tuple:
    """(elements of the block linears' weights, of one block's, of every other parameter) among ``params``;
    ``experts`` are not linears (their grouped GEMM is not cast by autocast)."""
    grouped = {id(p) for p in experts}
    mats = [p for n, p in params.items() if n.startswith(blocks) and p.dim() >= 2 and id(p) not in grouped]
    per_block: dict = {}
    for n, p in params.items():
        if n.startswith(blocks):
            key = n[len(blocks):].split(".", 1)[0]
            per_block[key] = per_block.get(key, 0) + p.numel()
    rest = sum(p.numel() for n, p in params.items() if not n.startswith(blocks))
    return sum(p.numel() for p in mats), max(per_block.values(), default=0), rest


def head_bytes(shape: Shape, plan: Plan, micro_rows: int, seq: int, layout: str, device_type: str = "cpu") -> tuple:
    """The fused loss head's bytes on the last stage: (kept from forward to backward: the gradients it makes in
    forward and saves, input rows x dim and weight vocab x dim, and the table the late logits keep where it
    is not the parameter itself: ZeRO-3's copy, the 2D/3D modes' gathered table, cast under autocast;
    transient in forward: one chunk of logits and its gradient). The chunk is the kernel's own
    (``kernels.linear_cross_entropy.default_chunk``): on CPU about 2^24 logits, worked on in fp32 beside the
    input-dtype logits; on CUDA about 512 MiB of logits in their dtype, overwritten by their gradient."""
    if not shape.vocab_size:
        return 0.0, 0.0
    from cuboid.kernels.linear_cross_entropy import default_chunk  # on use: the kernel module loads Triton

    tokens = micro_rows * seq / plan.sp / (plan.tp if plan.tp_mode != "1d" else 1)
    vocab = math.ceil(shape.vocab_size / plan.tp)
    wide = 2 if layout == "half" else 4
    own_table = plan.zero == 3 or (plan.tp > 1 and plan.tp_mode != "1d")  # else the output holds the parameter
    kept = (4 if layout == "fp32" else 2) if own_table else 0
    logits = torch.float32 if layout == "fp32" else torch.bfloat16
    rows = default_chunk(max(1, int(tokens)), vocab, device_type, logits)
    per_logit = 4 * 2 if device_type == "cpu" else logits.itemsize
    chunk = min(tokens, rows) * vocab * per_logit
    return tokens * shape.dim * wide + vocab * shape.dim * (wide + kept), chunk


def pipeline_buffers(plan: Plan, stage: Stage, dim: int, micro_rows: int, seq: int, layout: str = "fp32") -> float:
    """Receive buffers ``torch.distributed.pipelining`` keeps on a rank from its first step on: one per
    micro-batch for each input of a stage that receives activations (x and the residual, fp32, with the
    int64 mask (B, 1) and labels) and for each output gradient of a stage that receives them (x and the
    residual): per virtual stage (two under interleaved and ZBV) not first, resp. not last. Measured on 2
    gloo ranks (gpt-debug, dim 64, 8 x 16 tokens, test_auto_plan): equal to this under gpipe, 1F1B (2 and 4
    micro-batches) and interleaved in fp32, and under bf16 autocast (``layout``: x and its gradient arrive
    in bf16, the residual and its gradient in fp32; 1F1B); under ZBV the rank holding both ends keeps two
    more x-sized buffers (not counted here)."""
    if plan.pp == 1:
        return 0.0
    per_rank = 2 if plan.schedule in ("interleaved", "zbv") else 1
    act = micro_rows * seq * dim * 4 / (plan.tp if plan.tp_mode != "1d" else 1)  # 2D/3D: this rank's block
    block_rows = micro_rows // plan.batch_parts
    extra = block_rows * 8 + block_rows * seq * 8  # mask (int64 ones (B, 1); BERT's (B, s) not counted), labels
    x = act / 2 if layout == "autocast" else act  # a block's x output is autocast's bf16, and its gradient
    receives = (per_rank - int(stage.first)) * (x + act + extra) + (per_rank - int(stage.last)) * (x + act)
    return plan.microbatches * receives


def peak_bytes(shape: Shape, plan: Plan, stage: Stage, params: dict, micro_rows: int, seq: int, layout: str,
               states: dict, blocks: str = "blocks.", device_type: str = "cpu", experts=(),
               dequantized: float = 0.0) -> dict:
    """A rank's peak bytes, by part: ``states`` (:func:`model_states`), ``activations`` (kept by the blocks
    after the forward, :func:`held_activations`), ``rebuilt`` (one block's, recomputed in backward),
    ``copies`` (autocast's half copies of the block linears saved for backward without checkpointing: a
    checkpointed block casts them again in its recompute; not the ``experts``' weights, which their grouped GEMM
    reads uncast; FSDP2's gathered units under ZeRO-3), ``head``
    (the loss head's saved gradients and, where its late logits keep their own, the table:
    :func:`head_bytes`), ``temporaries`` (its logits chunk); ``total``: parameters, optimizer state and
    masters plus the larger of the forward's peak and the optimizer step's (the gradients and its
    temporaries, ``step``); DDP's gradient buckets (``buckets``) and the pipeline's receive buffers
    (``pipeline``, :func:`pipeline_buffers`) are held throughout. ``device_type`` ("cpu" or "cuda") picks
    the loss head's chunk rule (:func:`head_bytes`). ``dequantized``: bytes of the largest weight a 4-bit
    base dequantizes for one matmul (forward, and again for backward's input gradient: never kept), held
    beside the activations (``dequantized``); its NF4 layers make no autocast copies (not parameters)."""
    act, rebuilt = held_activations(shape, plan, stage, micro_rows, seq, layout, parts=True)
    mats, one_block, rest = _block_matrices(params, blocks, experts)
    pbytes = next((p.element_size() for p in params.values()), 4)
    copies = 0.0
    if layout == "autocast":
        copies = 2 * (mats if plan.checkpoint == "none" else mats / max(stage.blocks, 1))
    if plan.zero == 3 and plan.dp * plan.sp > 1:  # the root unit stays gathered, two block units at a time
        copies += (rest + 2 * one_block) * pbytes
    head, temporaries = head_bytes(shape, plan, micro_rows, seq, layout, device_type) if stage.last else (0.0, 0.0)
    buckets = states["grads"] if plan.zero == 0 and plan.dp * plan.sp > 1 else 0.0  # DDP's flat gradient buckets
    pipeline = pipeline_buffers(plan, stage, shape.dim, micro_rows, seq, layout)
    fixed = states["params"] + states["optimizer"] + states["masters"] + buckets + pipeline
    # the optimizer step: the foreach AdamW's fp32 temporaries over the rank's pieces (and the fp32 copy of a half
    # gradient), beside the gradients
    step = states["grads"] + states["optimizer"] / ADAMW_STATE_BYTES * 4 * OPTIMIZER_TEMPORARIES[layout]
    total = fixed + max(act + copies + head + max(rebuilt, temporaries) + dequantized, step)
    return {"states": states["total"], "activations": act, "rebuilt": rebuilt, "copies": copies, "head": head,
            "temporaries": temporaries, "buckets": buckets, "pipeline": pipeline, "step": step,
            "dequantized": dequantized, "total": total}
