"""The cost of a training step under a plan: bytes held, bytes sent, FLOPs, bubble, and a predicted time.

``cuboid plans --gpus N`` ranks plans with it and ``plan="auto"`` takes its
first. Two kinds of figure:

- **Exact** (the tests hold them equal to what a run holds and sends):
  model-state bytes (parameters, gradients, optimizer state, masters) from
  the parameters a rank really holds (the caller passes them: meta tensors of
  this rank's shards and stages, in the layout it trains in) through the
  ZeRO formulas and bucket layout of :mod:`cuboid.parallel.zero` (:mod:`.memory`);
  bytes sent per group (:mod:`.traffic`). The optimizer is AdamW.
- **Estimated**: the peak bytes of the fullest rank (:func:`.memory.peak_bytes`:
  activations as the code keeps them per layout, autocast's weight copies,
  the loss head's temporaries), FLOPs (Narayanan et al., arXiv 2104.04473),
  and the step time:

  * compute: each GEMM class (the blocks' linears, attention, the head) at
    the profile's sustained rate times :meth:`.Hardware.efficiency` of its
    smallest dimension (tensor slices and short micro-batches run slower);
  * communication, each collective on the links its group spans
    (:meth:`.Hardware.collective_time`: hierarchical across nodes), with what
    overlaps hidden: DDP's bucketed all-reduce and ZeRO-2's reduce-scatter
    behind the backward (the last bucket stays exposed), FSDP2's (ZeRO-3)
    gathers and reduce-scatters behind forward and backward (the first and
    last unit exposed), pipeline sends behind the other micro-batches (the
    fill and drain exposed); ZeRO-1's reduce-scatter and ZeRO-1/2's
    all-gather after the step, tensor and sequence collectives, the experts'
    all-to-alls, their gradients' all-reduce after backward (ZeRO-2's and
    FSDP2's over ``edp`` overlap as over dp) and the tied
    embedding's all-reduce are on the critical path. Under a pipeline the
    gradient traffic overlaps only the last micro-batch's backward;
  * the optimizer's memory traffic and the pipeline bubble.

  CPU profiles (``cores`` set: ``local``) price the activation elements that
  are not matmul work (``elementwise_ns``), slow every part by what their
  calibration measured when all cores are busy, and overlap nothing (gloo
  runs on the cores the compute needs: ``overlap = 0``).

Hardware profiles: :mod:`.hardware`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ..plan import Plan
from .hardware import Hardware
from .memory import (ADAMW_TOUCHED_BYTES, SELECTIVE_KEPT, activation_bytes, elementwise_elements,
                     expert_parameters, layout_of, model_states, peak_bytes, trainable)
from .shape import Shape, Stage, bubble_fraction, dtype_bytes, stages_of, step_flops
from .traffic import DDP_BUCKET_BYTES, traffic

DEFAULT_HEADROOM = 0.10        # of device memory left free: allocator fragmentation, NCCL buffers, the CUDA context
ELEMENTWISE_TOUCHES = 4        # an activation element is written in forward, read in backward, its gradient
                               # written and read (fused kernels touch it about this often)
BLOCK_ELEMENTS = 17            # activation elements per token and hidden unit of a block (Korthikanti et al.)
LAYOUT_NAMES = {"fp32": "fp32 weights and training", "autocast": "fp32 weights under autocast",
                "half": "half weights + fp32 masters"}


@dataclass
class Estimate:
    """Everything ``cuboid plans`` says of one plan: time parts of the slowest rank, memory of the fullest."""

    plan: Plan
    name: str = ""
    fits: bool = True
    why: str = ""
    layout: str = "fp32"
    params: float = 0.0                            # exact, the fullest rank's
    grads: float = 0.0
    optimizer: float = 0.0
    masters: float = 0.0
    activations: float = 0.0                       # Korthikanti et al., without checkpointing
    activations_checkpointed: float = 0.0
    sent: dict = field(default_factory=dict)      # group -> bytes (exact)
    sent_total: float = 0.0
    bubble: float = 0.0
    flops: float = 0.0                             # this rank's FLOPs per step
    compute_s: float = 0.0
    comm_s: float = 0.0                            # exposed: not hidden behind compute
    comm_total_s: float = 0.0                      # every collective, as if nothing overlapped
    optimizer_s: float = 0.0
    bubble_s: float = 0.0
    step_s: float = 0.0
    memory: float = 0.0                            # the fullest rank's peak (estimated)
    peak_parts: dict = field(default_factory=dict)
    peak_rank: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.describe()
        return d


def tensor_axes(plan: Plan) -> tuple:
    """The groups a tensor mode's traffic runs over (its grid's axes)."""
    if plan.tp == 1:
        return ()
    return {"1d": ("tp",), "2d": ("tp_row", "tp_col")}.get(plan.tp_mode, ("tp_row", "tp_col", "tp_dep"))


def compute_seconds(shape: Shape, plan: Plan, stage: Stage, hw: Hardware, batch: int, seq: int) -> float:
    """Seconds of a rank's FLOPs in a step: the blocks' linears, the experts' grouped GEMMs, attention and the
    head, each at the profile's rate times the efficiency of its smallest GEMM dimension (micro-batch tokens,
    tensor slice widths; an expert's rows: the ``tokens x top_k x ep / experts`` the ``ep`` ranks send it)."""
    blocks, head = step_flops(shape, batch, seq, plan.checkpoint == "full", parts=True)
    layers = max(shape.n_layers, 1)
    share = stage.blocks / layers
    per_rank = plan.dp * plan.tp * plan.sp
    h, f, q = shape.dim, shape.hidden, shape.q_dim
    experts = shape.sparse_layers * shape.expert_macs() / layers  # per layer, averaged over the layers
    linear = shape.linear_macs() / layers - experts
    attention = 2 * shape.attention_span(seq) * q
    m = plan.microbatches
    tokens = batch / plan.dp / m * seq / plan.sp / (plan.batch_parts or 1)
    width = plan.tp if plan.tp_mode == "1d" else plan.tp ** 0.5
    eff_linear = hw.efficiency(min(tokens, h / (1 if plan.tp_mode == "1d" else width), min(q, f) / width))
    eff_attention = hw.efficiency(seq / plan.sp)
    eff_head = hw.efficiency(min(tokens, h, shape.vocab_size / plan.tp)) if shape.vocab_size else 1.0
    work = linear + experts + attention
    block_share = linear / work / eff_linear + attention / work / eff_attention
    if experts:
        rows = tokens * shape.top_k * plan.ep / shape.experts
        block_share += experts / work / hw.efficiency(min(rows, h, shape.expert_width))
    block_s = blocks * share / per_rank * block_share
    head_s = head / per_rank / eff_head if stage.last else 0.0
    return (block_s + head_s) / hw.rate(plan.dtype)


def elementwise_seconds(hw: Hardware, plan: Plan, elements: float) -> float:
    """Seconds of the work that is not matmul (norms, softmax, activations, adds) over ``elements`` activation
    elements: a CPU profile's measured ``elementwise_ns`` each; on accelerators memory-bound, each element
    touched :data:`ELEMENTWISE_TOUCHES` times at the profile's memory bandwidth. Its share of a step falls as
    the hidden size grows (matmul work grows with its square)."""
    if hw.cores:
        return elements * hw.elementwise_ns * 1e-9
    return elements * ELEMENTWISE_TOUCHES * dtype_bytes(plan.dtype) / hw.memory_bytes_per_s


def _exposed(plan: Plan, hw: Hardware, timed: dict, compute_s: float, grad_bytes: float) -> float:
    """Seconds of communication not hidden behind compute (the module docstring says what overlaps)."""
    m = plan.microbatches
    backward = compute_s * 2 / 3 / m       # the window of the gradient traffic: the last micro-batch's backward
    exposed, pool, last = 0.0, 0.0, 0.0
    for (op, group), t in timed.items():
        if group in ("dp", "dpsp") and plan.zero == 0 and op == "all_reduce":
            pool += t
            last += t * min(1.0, DDP_BUCKET_BYTES / max(grad_bytes, 1.0))
        elif group in ("dp", "dpsp", "edp") and plan.zero == 2 and op == "reduce_scatter":
            pool += t
            last += t * min(1.0, DDP_BUCKET_BYTES / max(grad_bytes, 1.0))
        elif group in ("dp", "dpsp", "edp") and plan.zero == 3:
            pool += t
            last += t / 8                    # the first gather and the last reduce-scatter, about a unit each
        elif op == "send" and group == "pp":
            exposed += min(t, t / m * (plan.pp - 1))
        else:
            exposed += t
    window = compute_s / m if plan.zero == 3 else backward
    return exposed + max(last, pool - hw.overlap * window)


@dataclass
class _Setting:
    """What every rank of one prediction shares: the model, plan, profile and batch."""

    shape: Shape
    config: object
    plan: Plan
    hw: Hardware
    batch: int
    seq: int
    spec: object
    masked: bool
    crowd: float               # the profile's slowdown for the ranks sharing a node
    per_node: int


def _timed_traffic(s: _Setting, rank: int, params: dict, stage: Stage, group_ranks: dict) -> tuple:
    """({(op, group): seconds}, {group: bytes}) of a rank's traffic, each collective on the links its group
    spans; a grid mode's traffic is split evenly over its axes."""
    sent = traffic(s.config, s.plan, params, stage, s.batch, s.seq, spec=s.spec, masked=s.masked)
    timed, by_group = {}, {}
    for (op, group), (nbytes, calls) in sent.items():
        axes = tensor_axes(s.plan) if op == "tensor" else (group,)
        kind = "all_reduce" if op == "tensor" else op
        for a in axes:
            t = s.hw.collective_time(kind, nbytes / len(axes), calls / len(axes), group_ranks.get(a, [rank]))
            timed[op, group] = timed.get((op, group), 0.0) + t * s.crowd
        by_group[group] = by_group.get(group, 0.0) + nbytes
    return timed, by_group


def _rank_times(s: _Setting, rank: int, params: dict, stage: Stage, group_ranks: dict, layout: str,
                experts: list) -> dict:
    """The step time parts of one rank (seconds), with its traffic; ``experts``: those of ``params`` that are a
    mixture of experts' experts (:func:`.memory.expert_parameters`)."""
    plan, hw, shape = s.plan, s.hw, s.shape
    ps = trainable(params.values())
    timed, by_group = _timed_traffic(s, rank, params, stage, group_ranks)
    elements = elementwise_elements(shape, plan, stage, s.batch, s.seq)
    if plan.checkpoint == "selective":  # rebuilds a block's non-matmul activations
        elements *= 1 + (BLOCK_ELEMENTS - SELECTIVE_KEPT) / BLOCK_ELEMENTS
    compute_s = (compute_seconds(shape, plan, stage, hw, s.batch, s.seq)
                 + elementwise_seconds(hw, plan, elements)) * s.crowd
    grad_bytes = sum(p.numel() for p in ps) * (2 if layout == "half" else 4)
    comm_s = _exposed(plan, hw, timed, compute_s, grad_bytes)
    # an idle stage's core goes to the other ranks when there are more ranks than cores (CPU profiles)
    idle = max(0.0, 2.0 - s.per_node / hw.cores) if hw.cores and s.per_node > hw.cores else 1.0
    bubble_s = compute_s * bubble_fraction(plan) * min(idle, 1.0)
    mine = {id(p) for p in experts} if plan.ep > 1 else set()
    shards = (plan.dp * plan.sp if plan.zero else 1, plan.dp * plan.sp // plan.ep if plan.zero else 1)
    opt_bytes = sum(p.numel() / shards[id(p) in mine] for p in ps) * ADAMW_TOUCHED_BYTES
    optimizer_s = opt_bytes / hw.memory_bytes_per_s * s.crowd
    return dict(compute_s=compute_s, comm_s=comm_s, optimizer_s=optimizer_s, bubble_s=bubble_s,
                step_s=compute_s + bubble_s + comm_s + optimizer_s, comm_total_s=sum(timed.values()),
                sent=by_group, sent_total=sum(by_group.values()))


def _take_memory(est: Estimate, s: _Setting, stage: Stage, peak: dict, states: dict, rank: int, layout: str) -> None:
    """Record the fullest rank's memory in ``est``."""
    micro = s.batch // s.plan.dp // s.plan.microbatches
    est.memory, est.peak_parts, est.peak_rank, est.layout = peak["total"], peak, rank, layout
    est.params, est.grads = states["params"], states["grads"]
    est.optimizer, est.masters = states["optimizer"], states["masters"]
    est.activations = activation_bytes(s.shape, s.plan, stage, micro, s.seq, checkpoint=False)
    est.activations_checkpointed = activation_bytes(s.shape, s.plan, stage, micro, s.seq, checkpoint=True)


def _take_time(est: Estimate, s: _Setting, stage: Stage, times: dict) -> None:
    """Record the slowest rank's time parts, traffic and FLOPs in ``est``."""
    plan, shape = s.plan, s.shape
    for k, v in times.items():
        setattr(est, k, v)
    blocks, head = step_flops(shape, s.batch, s.seq, plan.checkpoint == "full", parts=True)
    est.bubble = bubble_fraction(plan)
    est.flops = (blocks * stage.blocks / max(shape.n_layers, 1) + (head if stage.last else 0.0)) / (
        plan.dp * plan.tp * plan.sp)


def _refuse_if_full(est: Estimate, hw: Hardware, headroom: float) -> None:
    """Mark ``est`` as not fitting, with the sentence why, when its fullest rank needs more than ``hw`` leaves."""
    room = hw.memory_bytes * (1 - headroom)
    if est.memory <= room:
        return
    p = est.peak_parts
    est.fits = False
    est.why = (f"needs {est.memory / 1e9:.1f} GB on its fullest rank ({p['states'] / 1e9:.1f} GB model states, "
               f"{(p['activations'] + p['rebuilt']) / 1e9:.1f} GB activations ({est.plan.checkpoint} checkpointing), "
               f"{(p['copies'] + p['head'] + p['temporaries']) / 1e9:.1f} GB weight copies and loss head), more "
               f"than the {room / 1e9:.1f} GB usable of a {hw.memory_bytes / 1e9:.0f} GB {hw.name} device "
               f"({headroom:.0%} headroom)")


def predict(config, plan: Plan, rank_params: dict, hw: Hardware, batch: int, seq: int, *, spec=None,
            block_cuts: Sequence[range] = (), masked: bool = False, name: str = "",
            layers_only: bool = False, layout: Optional[str] = None,
            headroom: float = DEFAULT_HEADROOM, quantized: Optional[dict] = None) -> Estimate:
    """The :class:`Estimate` of ``plan`` for a model of ``config`` (a :class:`~.shape.Shape`, or a config its
    family registered) on ``hw``.

    ``rank_params``: ``{rank: {name: parameter}}`` for the ranks to look at (meta tensors of each one's
    shards and stages, in the dtype it trains its weights in); the time is the slowest's, the memory the
    fullest's. ``spec``: the model's sharding spec; ``block_cuts``: the pipeline's block ranges per stage;
    ``layers_only``: the blocks without embeddings and head (what the tensor-parallel papers time);
    ``layout``: ``fp32`` / ``autocast`` / ``half`` (default: from the parameters' dtype and the plan's);
    ``headroom``: the share of device memory a plan must leave free to fit. A grid mode's traffic is split
    evenly over its axes, each priced on the links its group spans. Without a pipeline, ``microbatches`` > 1
    is priced as gradient accumulation (Megatron's micro-batches; cuboid's trainer accumulates by its
    ``micro_batch_size``, the enumeration leaves it at 1). ``quantized``: ``{rank: (bytes, elements)}`` of a
    frozen 4-bit base (QLoRA) beside the parameters, :func:`cuboid.parallel.quant.quantized_bytes`: its bytes
    are held with the parameters and its largest weight is dequantized for one matmul at a time
    (:func:`.memory.peak_bytes`).
    """
    from ..mesh import Mesh

    shape = Shape.of(config)
    if layers_only:
        stages = [Stage(shape.n_layers, first=False, last=False)]
    else:
        stages = stages_of(plan, block_cuts, shape.n_layers)
    per_node = min(hw.gpus_per_node, plan.world_size)
    s = _Setting(shape, config, plan, hw, batch, seq, spec, masked, hw.crowding(per_node), per_node)
    blocks_prefix = (spec.blocks if spec is not None else "blocks") + "."
    device_type = "cpu" if hw.cores else "cuda"  # CPU profiles have cores
    est = Estimate(plan=plan, name=name)
    slowest, fullest = -1.0, -1.0
    for rank, params in rank_params.items():
        mesh = Mesh.layout(plan, rank)
        stage = stages[mesh.coords.get("pp", 0)]
        ps = trainable(params.values())
        lay = layout or layout_of(plan, ps[0].dtype if ps else None)
        experts = expert_parameters(params, spec)
        nf4_bytes, nf4_largest = (quantized or {}).get(rank, (0, 0))
        states = model_states(list(params.values()), plan, experts=experts, quantized=nf4_bytes)
        micro = batch // plan.dp // plan.microbatches
        peak = peak_bytes(shape, plan, stage, params, micro, seq, lay, states, blocks_prefix, device_type, experts,
                          dequantized=nf4_largest * (4 if lay == "fp32" else 2))
        if peak["total"] > fullest:
            fullest = peak["total"]
            _take_memory(est, s, stage, peak, states, rank, lay)
        times = _rank_times(s, rank, params, stage, mesh.group_ranks, lay, experts)
        if times["step_s"] > slowest:
            slowest = times["step_s"]
            _take_time(est, s, stage, times)
    _refuse_if_full(est, hw, headroom)
    return est
