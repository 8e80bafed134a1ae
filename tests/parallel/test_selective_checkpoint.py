"""Selective activation checkpointing (``checkpoint=selective``): one device's numbers, less memory, every plan.

- Parity: loss and every gradient of gpt-debug, bert-debug, vit-debug and llama-debug with dropout 0.1
  equal the run without checkpointing (the recompute replays the dropout masks), as do full recompute's.
- Memory: the bytes a forward leaves alive for backward (every storage an op made in the forward that is
  still alive after it: autograd's saved tensors, checkpoint inputs, the selective cache, the kept collective
  buffers) lie strictly between full recompute's and no checkpointing's. ``saved_tensors_hooks`` cannot
  measure this: inside a checkpointed block the checkpoint's own hooks take every saved tensor, and the
  selective cache is not a saved tensor, so full and selective count the same there.
- A region recomputed twice (the ZBV schedule's input and weight passes) gives the same gradients again.
- A kept matmul output changed in place after the forward is an error, never a wrong gradient.
- Plan field: parse, describe and dict/JSON/TOML round trips; old spellings keep their meaning; one-sentence
  errors.
- Two ranks (tp=2, sp=2 ring): gradients (with dropout under tp) equal the run without checkpointing and
  one device's; a step sends what full recompute sends (a block's collectives run again in its recompute),
  and with ``keep_collectives`` what no checkpointing sends (kept, replayed, not re-sent).

Parity under every plan is the generated test's (``tests/parallel/test_plans.py``, its ``EXTRA``).
"""
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .launch import run_world
from .test_data_parallel import global_batch

FAMILIES = ("gpt-debug", "bert-debug", "vit-debug", "llama-debug")
MODES = ("none", "full", "selective")
DROPOUT = 0.1


class MadeInForward(TorchDispatchMode):
    """Every storage an op makes while active; :meth:`live` sums those still alive (weak references)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # new storages only: a view (of a weight, say) is not memory made here
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() not in inputs:
                    known = self.refs.get(s.data_ptr())
                    if known is None or known() is None:  # an address freed and reused
                        self.refs[s.data_ptr()] = weakref.ref(s)
        return out

    def live(self) -> int:
        gc.collect()
        return sum(s.nbytes() for s in (r() for r in self.refs.values()) if s is not None)


def _load(name, mode, **extra):
    import cuboid

    plan = None if mode == "none" else f"checkpoint={mode}"
    return cuboid.load(name, plan, seed=0, dropout=DROPOUT, **extra).train()


def _step(model, batch):
    """(loss, {name: grad}, bytes the forward left alive for backward)."""
    torch.manual_seed(5)  # the dropout masks
    with MadeInForward() as made:
        loss = model(**batch).loss
    held = made.live()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, held


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name in FAMILIES:
        for mode in MODES:
            model = _load(name, mode)
            out[name, mode] = _step(model, global_batch(name, model))
    return out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_loss_and_gradients_equal_no_checkpointing(runs, name, mode):
    loss, grads, _ = runs[name, mode]
    ref_loss, ref_grads, _ = runs[name, "none"]
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in ref_grads.items():
        assert (grads[n] - g).abs().max().item() <= 1e-6 * max(1.0, g.abs().max().item()), n


@pytest.mark.parametrize("name", FAMILIES)
def test_dropout_is_on(name):
    """The parity above means something: the masks change the loss, so a recompute drawing other masks
    would change the gradients."""
    model = _load(name, "selective")
    batch = global_batch(name, model)
    torch.manual_seed(5)
    a = model(**batch).loss.item()
    torch.manual_seed(6)
    assert model(**batch).loss.item() != a


@pytest.mark.parametrize("name", FAMILIES)
def test_selective_holds_between_full_and_none(runs, name):
    held = {mode: runs[name, mode][2] for mode in MODES}
    assert held["full"] < held["selective"] < held["none"], held


def test_a_region_recomputed_twice_gives_the_same_gradients():
    model = _load("gpt-debug", "selective")
    batch = global_batch("gpt-debug", model)
    torch.manual_seed(5)
    loss = model(**batch).loss
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)  # a second graph task: the blocks are recomputed again
    assert all(torch.equal(a, b) for a, b in zip(first, second))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)  # kept (addmm)
        return h, torch.sigmoid(h) * 2  # the sigmoid's output is recomputed from h


def test_a_kept_output_changed_in_place_is_an_error():
    from cuboid.parallel import checkpoint_blocks

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_Branch()])
    checkpoint_blocks(model, mode="selective")
    x = torch.randn(4, 8, requires_grad=True)
    h, g = model.blocks[0](x)
    h.mul_(2)  # what the recompute would read back
    with pytest.raises(RuntimeError, match="kept in forward was changed in place afterwards"):
        g.sum().backward()


def test_a_full_rope_table_cache_keeps_what_a_forward_used():
    """Gemma 3's local and global bases take two entries of the shared rope-table cache. With the cache full
    (a process that ran other models: a notebook, a sweep, a warm test world), a forward that hits the
    oldest entry and then adds the other base's must not evict the first: the recompute would compute that
    table again, which selective checkpointing refuses (a block must replay what its forward did)."""
    import cuboid
    from cuboid.parallel.layers import Rotary

    saved = dict(Rotary._cached)
    try:
        model = cuboid.load("gemma3-debug", "checkpoint=selective", seed=0, vocab_size=64).train()
        batch = global_batch("llama-debug", model)
        Rotary._cached.clear()
        model(**batch)
        first, second = list(Rotary._cached)  # the first block's base, then the other's
        tables = Rotary._cached[first]
        Rotary._cached.clear()
        Rotary._cached[first] = tables  # the oldest entry, then others up to the bound
        for n in range(Rotary.CACHED - 1):
            Rotary._cached[("another model's", n)] = tables
        model(**batch).loss.backward()  # the second base's entry is added in the forward: one entry goes
        assert first in Rotary._cached and second in Rotary._cached
        assert all(p.grad is not None for p in model.parameters())
    finally:
        Rotary._cached.clear()
        Rotary._cached.update(saved)


def test_checkpoint_blocks_modes():
    from cuboid.parallel import checkpoint_blocks

    model = _Stack()
    x = torch.randn(4, 8)
    want = model(x)
    for mode in ("full", "selective", "full"):  # another mode replaces the first
        checkpoint_blocks(model, mode=mode)
        assert all(b._cuboid_checkpointed == mode for b in model.blocks)
        assert torch.equal(model(x.requires_grad_()), want)
    with pytest.raises(ValueError, match="checkpoint mode must be one of full, selective, got 'some'"):
        checkpoint_blocks(model, mode="some")
    with pytest.raises(ValueError, match="keep_collectives applies to mode selective"):
        checkpoint_blocks(model, mode="full", keep_collectives=True)


# ------------------------------------------------------------------------------------------- the plan field

def test_plan_field_round_trips(tmp_path):
    from cuboid.parallel import Plan

    selective = Plan.parse("dp=2,checkpoint=selective")
    assert selective.checkpoint == "selective" and not hasattr(selective, "activation_checkpoint")
    assert selective.describe() == "dp=2,checkpoint=selective"
    full = Plan.parse("dp=2,activation_checkpoint=true")  # the other spelling: full recompute
    assert full == Plan.parse("dp=2,checkpoint=full") == Plan(dp=2, checkpoint="full")
    assert full.checkpoint == "full" and full.describe() == "dp=2,checkpoint=full"
    assert Plan.parse("checkpoint=none") == Plan() and Plan().checkpoint == "none"
    for plan in (selective, full, Plan(tp=2, checkpoint="selective", dtype="bf16")):
        assert Plan.parse(plan.describe()) == plan
        assert Plan.from_dict(plan.to_dict()) == plan
        assert Plan.from_json(plan.to_json()) == plan
        assert Plan.from_toml(plan.to_toml()) == plan
    assert Plan.from_dict({"activation_checkpoint": True}).checkpoint == "full"  # a dict written before the field
    # replace sets the other spelling: the planner turns full recompute on with activation_checkpoint=True
    assert selective.replace(activation_checkpoint=True).checkpoint == "full"
    assert full.replace(activation_checkpoint=False).checkpoint == "none"
    assert full.replace(checkpoint="selective") == selective


@pytest.mark.parametrize("spec,message", [
    ("checkpoint=some", "plan field checkpoint must be one of none, full, selective, got 'some'"),
    ("checkpoint=true", "plan field checkpoint must be one of none, full, selective, got True"),
    ("activation_checkpoint=selective", r"activation_checkpoint must be true or false, got 'selective' "
                                        r"\(selective recompute is checkpoint=selective\)"),
    ("activation_checkpoint=true,checkpoint=selective", "contradict each other"),
])
def test_plan_field_errors(spec, message):
    from cuboid.parallel import Plan

    with pytest.raises(ValueError, match=message) as info:
        Plan.parse(spec)
    assert str(info.value).count(". ") == 0  # one sentence


# ------------------------------------------------------------------------------------------- two ranks

VARIANTS = MODES + ("selective, collectives kept",)


def two_rank_worker():
    """Per plan (tp=2 with dropout, sp=2 without: its ranks draw masks for their own chunks), the full gradients
    of each variant, their largest relative difference from the plan's run without checkpointing (and, for tp,
    from one device's), and the bytes each step sent."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import checkpoint_blocks, comm

    name, report = "gpt-debug", {}
    for spec, dropout in (("tp=2", DROPOUT), ("sp=2", 0.0)):
        ref = cuboid.load(name, seed=0, dropout=dropout).train()
        batch = global_batch(name, ref)
        torch.manual_seed(11)
        ref(**batch).loss.backward()
        grads, sent = {"one device": {n: p.grad for n, p in ref.named_parameters()}}, {}
        for variant in VARIANTS:
            mode = variant.split(",")[0]
            model = cuboid.load(name, spec if mode != "selective" else f"{spec},checkpoint=selective", seed=0,
                                dropout=dropout).train()
            if mode == "full":  # the same as the plan's activation_checkpoint=true, applied after loading
                checkpoint_blocks(model, mode="full")
            if variant != mode:
                checkpoint_blocks(model, mode="selective", keep_collectives=True)
            torch.manual_seed(11)
            with comm.count() as tally:
                model(**cuboid.rank_share(model, batch)).loss.backward()
            sent[variant] = tally.total
            grads[variant] = {full: mod.full_tensor_like(local, p.grad)
                              for full, mod, local, p in zoo.common.sharded_parameters(model)}

        def err(a, b):
            return max(((grads[a][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                       for n, g in grads[b].items())

        report[spec] = {v: err(v, "none") for v in VARIANTS[1:]}
        report[spec].update({"one device": err("none", "one device"), "sent": sent})
    return report


def test_two_ranks_match_and_send_what_they_recompute():
    """Selective recompute re-sends a block's collectives as full recompute does (the same bytes); with
    ``keep_collectives`` it sends what no checkpointing sends."""
    for report in run_world(two_rank_worker, 2, timeout=600):
        for spec, r in report.items():
            assert all(r[v] < 1e-6 for v in VARIANTS[1:]) and r["one device"] < 1e-5, (spec, r)
            sent = r["sent"]
            assert sent["selective"] == sent["full"] > sent["none"] == sent["selective, collectives kept"], (spec, sent)


# ------------------------------------------------------------------------------------------- the cost model

def test_cost_model_prices_selective_between_full_and_none():
    from cuboid import zoo
    from cuboid.parallel import Plan, cost

    shape, stage = cost.Shape.of(zoo.config_of("gpt2")), cost.Stage(12, first=False, last=False)
    for base in ("single", "tp=2", "tp=2,tp_sequence=true", "tp=4,tp_mode=2d", "sp=2", "dp=2,pp=2,microbatches=2"):
        plan = Plan.parse(base)
        held = {mode: cost.activation_bytes(shape, plan.replace(checkpoint=mode), stage, 2, 512) for mode in MODES}
        assert held["full"] < held["selective"] < held["none"], (base, held)
    # one device: the measured elements per token and hidden unit, kept by every block, one block's others rebuilt
    tokens_h_e = 2 * 512 * 768 * 4
    one = cost.activation_bytes(shape, Plan(checkpoint="selective"), stage, 2, 512)
    assert one == 12 * tokens_h_e * cost.SELECTIVE_KEPT + tokens_h_e * (17 - cost.SELECTIVE_KEPT)
