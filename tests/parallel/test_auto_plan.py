"""``plan="auto"`` and the cost model behind it (issue 25).

- The ranking rules on 64 H100s of 80 GB (pure cost model, a handful of
  plans each): gpt2-xl and gpt2-medium rank a dp / ZeRO plan first; DDP,
  ZeRO-1 and ZeRO-2 differ as overlap says (DDP's bucketed all-reduce and
  ZeRO-2's reduce-scatter hide behind backward, ZeRO-1's does not, ZeRO-1/2's
  all-gather after the step is exposed); a model that does not fit one GPU
  gets a tensor or pipeline split first, its tensor groups inside a node (a
  39B model; a 13B one at 4 sequences per GPU runs ZeRO-3 alone first,
  bench/RESULTS.md says by how much).
- Rings across nodes are priced hierarchically; small GEMMs run slower.
- The memory model against the bytes a forward leaves alive for backward
  (counted exactly, every storage an op made; bench/checkpointing.py's
  tracker) for each layout and checkpointing, and the model states after a
  step in the half-weights layout exactly.
- ``auto`` specs, sizes like ``80G``, bad ``--seq`` / ``--batch`` refused in one line.
- One 2-rank gloo world (a module fixture) for both multi-rank checks:
  ``cuboid.load("gpt2", plan="auto")`` gives every rank the same plan; and for
  DDP, ZeRO-1/2/3 (half weights), tp=2 (autocast) and a 1F1B pp=2 (fp32 and autocast), on every
  rank through ``cuboid.load`` / ``AdamW(model.parameters())`` /
  ``cuboid.train_step``: parameter, optimizer-state and master bytes after the
  steps and gradient bytes at the step equal ``cost.model_states`` exactly, no
  gradient outlives the step, and the live tensor bytes the run added equal
  the peak's fixed part (DDP's buckets and the pipeline's receive buffers
  included) plus ZeRO's padding, within TORCH_SCALARS bytes.
"""
from __future__ import annotations

import pytest
import torch

from .launch import run_world

def _h100():
    from cuboid.parallel import cost

    return cost.load_hardware("h100")


def _ranked(model, plans, batch=256, seq=1024):
    from cuboid.parallel import Plan
    from cuboid.loading.planner import rank_plans

    return rank_plans(model, 64, _h100(), batch, seq, dtype="bf16", plans=[Plan.parse(p + ",dtype=bf16") for p in plans])


DP_FAMILY = ["dp=64", "dp=64,zero=1", "dp=64,zero=2", "dp=64,zero=3"]


@pytest.mark.parametrize("model, others", [
    ("gpt2-xl", ["dp=8,pp=8,microbatches=8", "dp=16,pp=4,microbatches=16", "dp=32,pp=2,microbatches=8"]),
    ("gpt2-medium", ["dp=8,tp=8", "dp=16,tp=4", "dp=8,pp=8,microbatches=8", "dp=16,pp=2,tp=2,microbatches=4"]),
])
def test_data_parallel_first_and_overlap_orders_ddp_zero1_zero2(model, others):
    ests = _ranked(model, DP_FAMILY + others)
    assert ests[0].fits and ests[0].plan.tp == ests[0].plan.pp == ests[0].plan.sp == 1, ests[0].plan.describe()
    by = {(e.plan.zero, e.plan.checkpoint): e for e in ests if e.plan.dp == 64}
    ddp, z1, z2 = by[0, "none"], by[1, "none"], by[2, "none"]
    # ZeRO-1 reduces after backward and gathers after the step: nothing hidden
    assert z1.comm_s == pytest.approx(z1.comm_total_s, rel=1e-9)
    # ZeRO-2 hides its reduce-scatter (not the gather); DDP hides all but its last bucket
    assert ddp.comm_s < z2.comm_s < z1.comm_s
    assert ddp.comm_s < 0.1 * ddp.comm_total_s
    assert ddp.step_s < z2.step_s < z1.step_s


def test_a_model_too_big_for_one_gpu_is_split_inside_a_node_first():
    from cuboid import zoo

    config = zoo.config_of("gpt-debug", dim=8192, n_layers=48, n_heads=64, vocab_size=51200, n_positions=2048,
                           mlp_hidden=0)  # Megatron's 39.1B row: 630 GB of model states, unsharded
    plans = ["dp=64,zero=2", "dp=64,zero=3", "dp=32,tp=2,zero=3", "dp=8,tp=8,zero=1", "dp=16,tp=4,zero=3",
             "dp=32,pp=2,microbatches=4,zero=3", "dp=8,pp=2,tp=4,microbatches=8,zero=1"]
    ests = _ranked(config, plans, batch=256, seq=2048)
    top = ests[0]
    assert top.fits and (top.plan.tp > 1 or top.plan.pp > 1), top.plan.describe()
    assert 8 % top.plan.tp == 0  # tensor groups are the fastest axis: inside one 8-GPU node
    assert not next(e for e in ests if e.plan.describe().startswith("dp=64,zero=2")).fits


def test_hierarchical_rings_and_small_gemms():
    hw = _h100()
    nbytes = 1e9
    flat = hw.inter.time(nbytes, 1)
    over_nodes = hw.collective_time("all_reduce", nbytes, 1, range(64))       # 8 ranks on each of 8 nodes
    one_per_node = hw.collective_time("all_reduce", nbytes, 1, range(0, 64, 8))  # 1 rank per node: its own NIC
    inside = hw.collective_time("all_reduce", nbytes, 1, range(8))
    assert inside == pytest.approx(hw.intra.time(nbytes, 1))
    assert one_per_node == pytest.approx(flat)
    assert inside < over_nodes < flat / 3
    assert hw.efficiency(128) == pytest.approx(0.5) and hw.efficiency(768) > hw.efficiency(96)
    from cuboid.parallel import cost

    assert cost.load_hardware("local").efficiency(64) == 1.0 and cost.load_hardware("local").overlap == 0.0


# ------------------------------------------------------------------------------------------- memory

SMALL = dict(vocab_size=1024, n_positions=128, dim=256, n_layers=4, n_heads=4, mlp_hidden=0)


@pytest.mark.parametrize("checkpoint", ["none", "full", "selective"])
@pytest.mark.parametrize("layout", ["fp32", "autocast", "half"])
def test_memory_model_against_what_a_forward_keeps(layout, checkpoint):
    from bench.checkpointing import made_tracker  # the repository root is on sys.path (last), as for tests.*

    import cuboid
    from cuboid import kernels, zoo
    from cuboid.parallel import Plan, cost

    config = zoo.config_of("gpt-debug", **SMALL)
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    plan = Plan(checkpoint=checkpoint, dtype="fp32" if layout == "fp32" else "bf16")
    model = cuboid.load(config, plan=plan, dtype=torch.bfloat16 if layout == "half" else None)
    made = made_tracker()
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout != "fp32")
    with made, amp, kernels.use_backend("torch"):
        out = model(input_ids=ids, labels=ids)
    held = made.live()
    params = dict(model.named_parameters())
    assert cost.layout_of(plan, next(iter(params.values())).dtype) == layout
    parts = cost.peak_bytes(cost.Shape.of(config), plan, cost.Stage(4), params, 4, 128, layout,
                            cost.model_states(list(params.values()), plan))
    # a checkpointed block's autocast copies are made again in its recompute: the peak's, not the forward's
    copies = parts["copies"] if checkpoint == "none" else 0.0
    predicted = parts["activations"] + copies + parts["head"]
    assert predicted == pytest.approx(held, rel=0.2), (layout, checkpoint, held, parts)
    del out


def test_loss_chunk_follows_the_kernel_on_each_device():
    """The head's transient bytes are the fused loss's own chunk: 2^24 fp32 logits (and the input-dtype ones) on
    CPU; on CUDA 512 MiB of logits in their dtype, overwritten by their gradient (Llama 3's vocabulary: 2048
    rows in bf16), so a GPU plan's peak is not priced with the CPU's chunk."""
    from cuboid import zoo
    from cuboid.parallel import Plan, cost
    from cuboid.parallel.cost.memory import head_bytes

    shape = cost.Shape.of(zoo.config_of("llama3.1-8b"))
    vocab = shape.vocab_size
    _, cpu = head_bytes(shape, Plan(), 8, 2048, "autocast", "cpu")
    _, gpu = head_bytes(shape, Plan(), 8, 2048, "autocast", "cuda")
    _, gpu_fp32 = head_bytes(shape, Plan(), 8, 2048, "fp32", "cuda")
    assert cpu == (2 ** 24 // vocab) * vocab * 4 * 2
    assert gpu == 2048 * vocab * 2
    assert gpu_fp32 == 1024 * vocab * 4
    _, tp8 = head_bytes(shape, Plan(tp=8), 8, 2048, "autocast", "cuda")  # a tp=8 slice: the whole batch is one chunk
    assert tp8 == 8 * 2048 * (vocab // 8) * 2


def test_half_weights_layout_states_after_a_step_are_exact():
    import cuboid
    from cuboid import kernels, zoo
    from cuboid.parallel import Plan, cost, zero
    from cuboid.parallel.optim import AdamW

    config = zoo.config_of("gpt-debug", **SMALL)
    model = cuboid.load(config, plan=Plan(dtype="bf16"), dtype=torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    with kernels.use_backend("torch"):
        cuboid.train_step(model, opt, {"input_ids": ids, "labels": ids})
    held = zero.model_state_bytes(model, opt)
    want = cost.model_states(list(model.parameters()), model.parallel.plan)
    n = sum(p.numel() for p in model.parameters())
    assert want["params"] == held["params"] == 2 * n and want["masters"] == held["masters"] == 4 * n
    assert want["optimizer"] == held["optimizer"] == 8 * n


# ------------------------------------------------------------------------------------------- auto specs


def test_auto_specs_sizes_and_refusals():
    from cuboid import zoo
    from cuboid.parallel import cost
    from cuboid.loading.planner import auto_plan, check_batch, choice_line, is_auto, parse_auto, parse_size

    assert is_auto("auto") and is_auto("auto,tp=2") and not is_auto("dp=2") and not is_auto(None)
    assert parse_auto("auto,tp=2,batch=16,memory=8G") == ({"tp": 2}, {"batch": "16", "memory": "8G"})
    assert parse_auto("auto,activation_checkpoint=true") == ({"checkpoint": "full"}, {})  # the other spelling
    assert parse_size("80G") == parse_size("80GB") == 80e9 and parse_size("1GiB") == 2 ** 30
    with pytest.raises(ValueError, match="neither a plan field"):
        parse_auto("auto,nope=1")
    hw = cost.load_hardware("local")
    plan, ests = auto_plan("gpt-debug", "auto,tp=2", world=4, batch=8, seq=32, hw=hw, memory=4e9)
    assert plan.tp == 2 and plan.world_size == 4 and all(e.plan.tp == 2 for e in ests)
    line = choice_line(ests, 4, hw, 8, 32)
    assert line.startswith("plan auto: ") and "runner-up" in line and "\n" not in line
    config = zoo.config_of("gpt2")
    with pytest.raises(ValueError, match="1 to 1024 positions"):
        check_batch(config, 8, 4096)
    with pytest.raises(ValueError, match="at least 1"):
        check_batch(config, 0, 128)


# ------------------------------------------------------------------------------------------- 2 gloo ranks
# One world hosts both checks below (a module fixture): plan="auto", then the bytes held after a step.

# a vocabulary that pads under vocab-parallel heads and cuts unevenly under FSDP2's rows, 3 blocks (an uneven
# pipeline cut), MLP 3x: small, so six plans take a few seconds
HELD = dict(vocab_size=251, n_positions=64, dim=64, n_layers=3, n_heads=4, mlp_hidden=192)
HELD_BATCH, HELD_SEQ = 8, 16
# (plan, half-precision weights): the three ZeRO stages in the half layout (masters), DDP, 1D tensor
# parallelism under autocast (fp32 weights), a 1F1B pipeline in fp32 and under autocast
HELD_PLANS = [("dp=2", False), ("dp=2,zero=1,dtype=bf16", True), ("dp=2,zero=2,dtype=bf16", True),
              ("dp=2,zero=3,dtype=bf16", True), ("tp=2,dtype=bf16", False), ("pp=2,microbatches=2", False),
              ("pp=2,microbatches=2,dtype=bf16", False)]
# torch's own small tensors a run leaves alive besides the model and optimizer (DeviceMesh's rank table, 8 bytes
# under ZeRO-3; the pipeline loss reducer's scalar, 4 bytes): not model memory, the only slack in the count
TORCH_SCALARS = 64


def _live_bytes() -> int:
    """Bytes of every live CPU storage a Python tensor refers to (each storage once)."""
    import gc

    gc.collect()
    seen: dict = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu":  # DTensors: their locals
            s = o.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _padding(params, plan, dp_rank) -> int:
    """Bytes the ZeRO layouts allocate beyond the rank's pieces: stages 1/2 pad each flat bucket to n equal
    shards; FSDP2 pads a rank's rows of a parameter to ceil(rows / n) (its storage; the local tensor is a view)."""
    import math

    from cuboid.parallel.zero import plan_buckets

    n = plan.dp * plan.sp
    ps = [p for p in dict.fromkeys(params) if p.requires_grad]
    if n == 1 or plan.zero == 0:
        return 0
    if plan.zero in (1, 2):
        return sum((math.ceil(k / n) * n - k) * b[0].element_size()
                   for b in plan_buckets(ps) for k in [sum(p.numel() for p in b)])
    out = 0
    for p in ps:
        rows = p.shape[0] if p.dim() else 1
        chunk = math.ceil(rows / n)
        mine = min(chunk, max(0, rows - dp_rank * chunk))
        out += (chunk - mine) * (p.numel() // max(rows, 1)) * p.element_size()
    return out


def _states_worker(plans) -> dict:
    """For each plan: this rank's bytes, measured after and during a ``train_step``, beside the cost model's."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import cost, state_of, zero
    from cuboid.parallel.optim import AdamW
    from cuboid.loading.planner import _Shards

    config = zoo.config_of("gpt-debug", **HELD)
    ids = torch.randint(0, config.vocab_size, (HELD_BATCH, HELD_SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    report = {}
    for spec, half in plans:
        dtype = torch.bfloat16 if half else None
        before = _live_bytes()
        model = cuboid.load(config, plan=spec, dtype=dtype)
        opt = AdamW(model.parameters(), lr=1e-3)
        at_step: list = []  # gradients as the step finds them (ZeRO-1: whole, before its reduce-scatter)
        opt.register_step_pre_hook(lambda o, args, kwargs: at_step.append(zero.model_state_bytes(model, o)["grads"]))
        cuboid.train_step(model, opt, batch)
        cuboid.train_step(model, opt, batch)
        held = zero.model_state_bytes(model, opt)
        live = _live_bytes() - before
        plan, mesh = model.parallel.plan, model.parallel.mesh
        meta = _Shards(config, dtype=dtype).of(plan, mesh.rank)  # the planner's meta shards of this rank
        named = dict(meta.named_parameters())
        dp_rank = mesh.coords.get("dpsp", mesh.coords.get("dp", 0))
        want = cost.model_states(list(named.values()), plan, dp_rank=dp_rank)
        stage = cost.stages_of(plan, state_of(meta).stages or (), config.n_layers)[mesh.coords.get("pp", 0)]
        micro = HELD_BATCH // plan.dp // plan.microbatches
        layout = cost.layout_of(plan, next(iter(named.values())).dtype)
        parts = cost.peak_bytes(cost.Shape.of(config), plan, stage, named, micro, HELD_SEQ, layout, want)
        # what the model says a rank holds between steps: its pieces, their moments and masters, DDP's gradient
        # buckets and the pipeline's receive buffers (the peak's fixed part)
        kept = want["params"] + want["optimizer"] + want["masters"] + parts["buckets"] + parts["pipeline"]
        report[spec] = {"held": held, "want": want, "grads_at_step": at_step, "live": live, "kept": kept,
                        "padding": _padding(list(named.values()), plan, dp_rank), "layout": layout}
        del model, opt, at_step
    return report


def _two_rank_worker():
    import cuboid

    model = cuboid.load("gpt2", plan="auto,batch=4,seq=64")
    auto = model.parallel.plan.describe(), model.parallel.plan.world_size
    del model
    return auto, _states_worker(HELD_PLANS)


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(_two_rank_worker, 2, timeout=420)


def test_load_gpt2_with_plan_auto_on_two_ranks(two_ranks):
    got = [auto for auto, _ in two_ranks]
    assert got[0] == got[1] and got[0][1] == 2, got


def test_bytes_held_after_a_step_equal_the_cost_model_on_two_ranks(two_ranks):
    """On every rank, through ``cuboid.load`` / ``AdamW(model.parameters())`` / ``cuboid.train_step``: parameter,
    optimizer-state and master bytes after two steps and gradient bytes at the step equal
    :func:`cost.model_states` exactly (sums of integers); no gradient outlives the step; and every live tensor
    byte the run added equals the model's fixed part (those states, DDP's buckets, the pipeline's receive
    buffers) plus the ZeRO layouts' padding, within TORCH_SCALARS bytes of torch's own bookkeeping."""
    for rank, (_, report) in enumerate(two_ranks):
        assert [spec for spec, _ in HELD_PLANS] == list(report), (rank, list(report))
        for spec, r in report.items():
            held, want = r["held"], r["want"]
            for what in ("params", "optimizer", "masters"):
                assert held[what] == want[what], (rank, spec, what, held[what], want[what])
            assert r["grads_at_step"] == [want["grads"]] * 2, (rank, spec, r["grads_at_step"], want["grads"])
            assert held["grads"] == 0, (rank, spec, held["grads"])
            expected = r["kept"] + r["padding"]
            assert expected <= r["live"] <= expected + TORCH_SCALARS, (rank, spec, r["live"], expected, r)
    print("\nbytes held after a step on 2 ranks: plan, rank: held / predicted (params, optimizer, masters; grads "
          "at the step) and live / kept + padding")
    for rank, (_, report) in enumerate(two_ranks):
        for spec, r in report.items():
            h, w = r["held"], r["want"]
            print(f"  {spec:24s} {rank}: {h['params']}/{w['params']} {h['optimizer']}/{w['optimizer']} "
                  f"{h['masters']}/{w['masters']}; {r['grads_at_step'][-1]}/{w['grads']}; live {r['live']} / "
                  f"{r['kept']} + {r['padding']}")
