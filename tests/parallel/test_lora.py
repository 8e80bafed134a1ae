"""LoRA under every kind of plan, through the public path: ``cuboid.load(name, plan, lora=...)``, an optimizer
built the plain way over ``model.parameters()``, the natural loop and ``cuboid.train_step``.

One 4-rank world runs tp1d (dp2 x tp2, and tp4 whose Llama key/value heads are replicated), 2D, pp2 x dp2,
sp2 x dp2, ZeRO-3 (dp2 x tp2) and pp2 x dp2 under ZBV (and more, listed in PLANS) in turn on GPT and Llama, each against one device's LoRA run computed once
in the parent: three steps (the natural loop, ``train_step``, the natural loop; a pipeline ``train_step``
only), losses within 1e-5, adapters within 1e-6 (test_plans' norm without the largest 0.1% of element
differences), base weights bit-unchanged, and optimizer state on adapters only. Each plan then saves its
adapters in peft's layout (the file holds one device's values) and loads them back under the same plan.
"""
import pytest
import torch

from .launch import run_world
from .test_data_parallel import global_batch
from .test_plans import even_batch, gathered, rel_norm

STEPS = 3
LORA = dict(r=4, alpha=8, targets=("attn", "mlp"))
DROPOUT = dict(LORA, dropout=0.2)  # under 1D without dp every rank drops what one device drops (row inputs too)
DROPOUT_PLANS = ["tp=4"]
FAMILIES = {"gpt-debug": {"vocab_size": 510}, "llama-debug": {"vocab_size": 510, "n_kv_heads": 2}}
PLANS = ["dp=2,tp=2", "tp=4", "tp=4,tp_mode=2d", "dp=2,pp=2,microbatches=2", "dp=2,sp=2", "dp=2,tp=2,zero=3",
         # beside the list: Megatron sequence parallelism, ZeRO 1 and 2
         "dp=2,tp=2,tp_sequence=true", "dp=4,zero=1", "dp=2,sp=2,sp_mode=all_to_all,zero=2",
         "dp=2,pp=2,microbatches=2,zero=3", "pp=2,tp=2,microbatches=2,schedule=interleaved",
         # ZBV: a frozen embedding stage must still hand the next stage a stream that asks for a gradient
         "dp=2,pp=2,microbatches=2,schedule=zbv"]


def _opt(params):
    from cuboid.parallel.optim import AdamW

    return AdamW(params, lr=1e-2, eps=1e-3)


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _steps(model, name, opt, pipelined, dp_group=None, dp=1):
    """The three steps (natural loop / train_step alternating; train_step only under pp); the losses."""
    import cuboid
    from cuboid.parallel import comm
    from cuboid.parallel.optim import clip_grad_norm_

    losses = []
    for step in range(STEPS):
        if not pipelined and step % 2 == 0:
            out = model(**cuboid.rank_share(model, even_batch(name, model)))
            out.loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            loss = out.loss.detach().clone().reshape(1)
            if dp > 1:
                comm.all_reduce_(loss, dp_group)
            losses.append(loss.item() / dp)
        else:
            losses.append(cuboid.train_step(model, opt, global_batch(name, model), max_grad_norm=1.0).loss)
    return losses


def one_device():
    """name -> {pipelined: (initial params, params after, losses)} of one device's LoRA runs."""
    import cuboid

    out = {}
    for name, extra in FAMILIES.items():
        for key, lora, pipelined in ((False, LORA, False), (True, LORA, True), ("dropout", DROPOUT, False)):
            torch.manual_seed(5)  # the dropout masks' generator (prepare makes it equal over tp)
            model = cuboid.load(name, seed=0, lora=lora, **extra).train()
            init = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt = _opt(model.parameters())
            losses = _steps(model, name, opt, pipelined)
            out[(name, key)] = (init, {n: p.detach().clone() for n, p in model.named_parameters()}, losses)
    return out


def lora_worker(refs, root):
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo.lora import save_adapters

    report = {}
    for spec, lora in [(s, LORA) for s in PLANS] + [(s, DROPOUT) for s in DROPOUT_PLANS]:
        plan = Plan.parse(spec)
        mesh = Mesh.build(plan)
        for name, extra in FAMILIES.items():
            dropout = lora is DROPOUT
            init, want, want_losses = refs[(name, "dropout" if dropout else plan.pp > 1)]
            torch.manual_seed(5)
            model = cuboid.load(name, plan, seed=0, mesh=mesh, lora=lora, **extra).train()
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            assert all(_adapter(n) for n in trainable), (spec, sorted(trainable)[:4])
            assert trainable or plan.pp > 1, spec  # (a pipeline rank may hold no block: ZBV's 4 stages, 2 blocks)
            opt = _opt(model.parameters())
            losses = _steps(model, name, opt, plan.pp > 1, mesh.group("dp"), mesh.size("dp"))
            held = {id(p) for p in opt.state}
            names = {id(p): n for n, p in model.named_parameters()}
            assert all(_adapter(names[i]) for i in held), (spec, name, "optimizer state off adapters")
            assert len(held) == len(trainable), (spec, name, "adapters without optimizer state")
            pairs = gathered(model)
            base = [(n, t) for n, t in pairs if not _adapter(n)]
            changed = [n for n, t in base if not torch.equal(t, init[n])]
            adapters = [(n, t) for n, t in pairs if _adapter(n)]
            key = f"{spec}/{name}" + ("/dropout" if dropout else "")
            report[key] = {"adapters": 0.0, "moved": None}  # a pipeline rank may hold none (ZBV's ends)
            if adapters:
                got = torch.cat([t.flatten() for _, t in adapters])
                ref = torch.cat([want[n].flatten() for n, _ in adapters])
                moved = torch.cat([(want[n] - init[n]).flatten() for n, _ in adapters])
                report[key] = {"adapters": rel_norm(got, ref), "moved": float(moved.abs().max())}
            report[key].update({
                "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
                "base_changed": changed, "adapters_seen": len(adapters),
            })
            # saved in peft's layout from this plan (tp pieces gathered, pp stages sent to rank 0, ZeRO-3 rows
            # gathered), then loaded back under the same plan into a fresh model: the same adapters
            folder = f"{root}/{spec}-{name}" + ("-dropout" if dropout else "")
            save_adapters(model, folder)
            back = cuboid.load(name, plan, seed=0, mesh=mesh, lora=folder, **extra)
            again = dict((n, t) for n, t in gathered(back) if _adapter(n))
            report[key]["reloaded_equal"] = all(torch.equal(again[n], t) for n, t in adapters)
            dist.barrier()
    return report


def test_lora_parity_4_ranks(tmp_path):
    from safetensors.torch import load_file

    from cuboid.kernels import use_backend

    with use_backend("torch"):  # the CPU path the ranks run (this process has the Triton interpreter on)
        refs = one_device()
    reports = run_world(lora_worker, 4, refs, str(tmp_path), timeout=600)
    for rank, report in enumerate(reports):
        assert len(report) == (len(PLANS) + len(DROPOUT_PLANS)) * len(FAMILIES)
        for key, errs in report.items():
            assert errs["base_changed"] == [], (rank, key, errs["base_changed"][:3])
            assert errs["adapters_seen"] == 0 or errs["moved"] > 1e-3, (rank, key, "the adapters did not train")
            assert errs["adapters_seen"] > 0 or "pp=" in key, (rank, key)
            assert errs["loss"] < 1e-5, (rank, key, errs)
            assert errs["adapters"] < 1e-6, (rank, key, errs)
            assert errs["reloaded_equal"], (rank, key, "adapters loaded back under the plan differ")
    for spec in PLANS:  # every adapter of the model in the file, and one device's values
        for name in FAMILIES:
            saved = load_file(str(tmp_path / f"{spec}-{name}" / "adapter_model.safetensors"))
            want = refs[(name, "pp=" in spec)][1]
            n_want = sum(1 for n in want if _adapter(n))
            assert len(saved) >= n_want, (spec, name, len(saved), n_want)
            if name == "llama-debug":  # one peft tensor per zoo adapter: compare them all
                peft = {k.replace("base_model.model.model.layers.", "blocks.").replace("self_attn.", "attn.")
                        .replace("q_proj", "q").replace("k_proj", "k").replace("v_proj", "v")
                        .replace("o_proj", "proj").replace("gate_proj", "gate").replace("up_proj", "up")
                        .replace("down_proj", "proj"): t for k, t in saved.items()}
                got = torch.cat([peft[n].flatten() for n in sorted(peft)])
                ref = torch.cat([want[n].flatten() for n in sorted(peft)])
                assert rel_norm(got, ref) < 1e-6, (spec, name)


def test_lora_one_device_every_family():
    """Every family gets adapters by role; only they train (plain torch AdamW holds state for them alone), the
    base stays bit-equal, and the model's loss moves."""
    import cuboid
    from cuboid.kernels import use_backend
    from cuboid.parallel.lora import adapted

    with use_backend("torch"):
        _every_family(cuboid, adapted)


def _every_family(cuboid, adapted):
    for name, want in (("gpt-debug", {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}),
                       ("bert-debug", {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}),
                       ("vit-debug", {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}),
                       ("llama-debug", {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.gate", "mlp.up", "mlp.proj"})):
        model = cuboid.load(name, lora=dict(r=2, alpha=4, dropout=0.1)).train()
        paths = [p for p, _ in adapted(model)]
        assert {p.split(".", 2)[2] for p in paths} == want, name
        assert len(paths) == len(want) * model.config.n_layers
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [cuboid.train_step(model, opt, global_batch(name, model)).loss for _ in range(3)]
        assert losses[-1] != losses[0], name
        assert {id(p) for p in opt.state} == {id(p) for p in model.parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if _adapter(n):
                assert p.requires_grad
            else:
                assert not p.requires_grad and p.grad is None and torch.equal(p, before[n]), n


def test_lora_under_3d_is_refused():
    import cuboid
    from cuboid.parallel import Mesh, Plan

    plan = Plan(tp=8, tp_mode="3d")
    with pytest.raises(NotImplementedError, match="3D"):
        cuboid.load("gpt-debug", plan, device="meta", mesh=Mesh.layout(plan), lora=LORA)


# ---------------------------------------------------------------- adapters on the experts under expert parallelism

MOE = "qwen3-moe-debug"
MOE_LORA = dict(r=4, alpha=8, targets=("attn", "experts"))
EP_PLANS = ["dp=2,ep=2", "dp=2,ep=2,zero=1", "dp=2,ep=2,zero=3"]


def _moe_adapter(name: str) -> bool:
    return _adapter(name) or ".experts.lora_" in name


def _moe_run(model):
    import cuboid

    opt = _opt([p for p in model.parameters() if p.requires_grad])
    return [cuboid.train_step(model, opt, global_batch(MOE, model), max_grad_norm=1.0).loss for _ in range(STEPS)]


def ep_lora_worker(want, root):
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo.lora import save_adapters

    init, after, want_losses = want
    report = {}
    for spec in EP_PLANS:
        plan = Plan.parse(spec)
        mesh = Mesh.build(plan)
        model = cuboid.load(MOE, plan, seed=0, mesh=mesh, lora=MOE_LORA).train()
        local = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts.lora_" in n}
        losses = _moe_run(model)
        pairs = dict(gathered(model))
        names = sorted(n for n in pairs if _moe_adapter(n))
        got = torch.cat([pairs[n].flatten() for n in names])
        ref = torch.cat([after[n].flatten() for n in names])
        folder = f"{root}/{spec}"
        save_adapters(model, folder)  # the experts' adapters gathered over ep
        back = dict(gathered(cuboid.load(MOE, plan, seed=0, mesh=mesh, lora=folder)))
        report[spec] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
                        "adapters": rel_norm(got, ref), "local": local, "names": names,
                        "base_changed": [n for n in pairs
                                         if not _moe_adapter(n) and not torch.equal(pairs[n], init[n])],
                        "reloaded_equal": all(torch.equal(back[n], pairs[n]) for n in names)}
    return report


def test_lora_on_experts_under_ep_2_ranks(tmp_path):
    """Adapters on attention and the experts under dp=2 x ep=2 (ZeRO 0, 1, 3): each rank holds its experts'
    adapters (E / 2 of them), three train_steps equal one device's (losses 1e-5, adapters 1e-6), the base
    stays bit-equal, and the adapters saved from the plan load back equal."""
    import cuboid
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        model = cuboid.load(MOE, seed=0, lora=MOE_LORA).train()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses = _moe_run(model)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts = model.config.n_experts
    reports = run_world(ep_lora_worker, 2, (init, after, losses), str(tmp_path), timeout=600)
    for rank, report in enumerate(reports):
        for spec, errs in report.items():
            assert errs["local"] and all(shape[0] == experts // 2 for shape in errs["local"].values()), (spec, errs)
            assert any(".experts.lora_" in n for n in errs["names"]), spec
            assert errs["base_changed"] == [], (rank, spec, errs["base_changed"][:3])
            assert errs["loss"] < 1e-5 and errs["adapters"] < 1e-6, (rank, spec, errs["loss"], errs["adapters"])
            assert errs["reloaded_equal"], (rank, spec)
    moved = max(float((after[n] - init[n]).abs().max()) for n in after if ".experts.lora_" in n)
    assert moved > 1e-3  # the experts' adapters trained
