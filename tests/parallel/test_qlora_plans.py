"""QLoRA (a frozen NF4 base, ``cuboid.load(..., quantize="nf4", lora=...)``) under the plans on 2 ranks: dp,
ZeRO-3, 1D tensor parallelism and the pipeline each take one device's three steps (losses
within 1e-5, adapters within 1e-6 as test_lora measures them), the 4-bit weights stay buffers (no gradient, no
optimizer state), every rank's dequantized slice equals the same slice of one device's weight bit for bit,
and the cost model's price of each rank's 4-bit base (quant.quantized_bytes) is the bytes its layers hold.
The model is llama-debug widened to 128 (tp's row cuts then hold whole blocks of 64). A folder transformers +
bitsandbytes saved in 4 bits loads under tp=2 (each rank slicing the stored codes) with one device's logits, and
``cuboid.zoo.to_hf`` of it under tp=2 writes every tensor bit-equal to the folder transformers saved."""
import torch

from .launch import run_world
from .test_lora import LORA, _adapter, _opt, _steps
from .test_plans import gathered, rel_norm

NAME = "llama-debug"
EXTRA = dict(dim=128, head_dim=32, mlp_hidden=256, vocab_size=512)
PLANS = ["dp=2", "dp=2,zero=3", "tp=2", "pp=2,microbatches=2"]


def _weights(model):
    """path -> this rank's dequantized fp32 weight of every NF4 layer."""
    from cuboid.parallel.quant import quantized_layers

    return {p: layer.dequantized(torch.float32) for p, layer in quantized_layers(model)}


def one_device():
    import cuboid

    out = {}
    for pipelined in (False, True):
        model = cuboid.load(NAME, seed=0, lora=LORA, quantize="nf4", **EXTRA).train()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses = _steps(model, NAME, _opt(model.parameters()), pipelined)
        out[pipelined] = (init, {n: p.detach().clone() for n, p in model.named_parameters()}, losses,
                          _weights(model))
    return out


def bnb_folder(root):
    """A tiny Llama saved by transformers + bitsandbytes in 4-bit NF4 with double quantization."""
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(f"{root}/full")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    LlamaForCausalLM.from_pretrained(f"{root}/full", quantization_config=bnb, device_map="cpu").save_pretrained(
        f"{root}/bnb4")
    return f"{root}/bnb4"


BNB_IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def bnb_logits(folder, plan=None, mesh=None, write=None):
    """Logits of the bitsandbytes folder loaded under ``plan``; ``write``: a folder ``cuboid.zoo.to_hf`` writes the
    loaded model to (every rank)."""
    import cuboid

    model = cuboid.load(folder, plan, mesh=mesh, dtype=torch.float32).eval()
    if write:
        cuboid.zoo.to_hf(model, write)
    with torch.no_grad():
        return model(input_ids=BNB_IDS).logits


def qlora_worker(refs, folder, want_logits):
    import cuboid
    from cuboid.parallel import Mesh, Plan

    report = {}
    plan = Plan.parse("tp=2")
    logits = bnb_logits(folder, plan, Mesh.build(plan), write=f"{folder}-tp2")  # written from the tp shards
    report["bnb tp=2"] = float((logits - want_logits).abs().max())
    for spec in PLANS:
        plan = Plan.parse(spec)
        mesh = Mesh.build(plan)
        init, want, want_losses, weights = refs[plan.pp > 1]
        model = cuboid.load(NAME, plan, seed=0, mesh=mesh, lora=LORA, quantize="nf4", **EXTRA).train()
        opt = _opt(model.parameters())
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        losses = _steps(model, NAME, opt, plan.pp > 1, mesh.group("dp"), mesh.size("dp"))
        # each rank's dequantized slice is one device's weight, sliced as the layer slices it
        from cuboid.parallel.quant import held_nf4_bytes, quantized_bytes, quantized_layers

        slices_equal = all(torch.equal(layer.dequantized(torch.float32),
                                       layer.local_part("weight", weights[p]))
                           for p, layer in quantized_layers(model))
        held = [layer.nf4_weight() for _, layer in quantized_layers(model)]
        pairs = gathered(model)
        adapters = [(n, t) for n, t in pairs if _adapter(n)]
        report[spec] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
            "adapters": rel_norm(torch.cat([t.flatten() for _, t in adapters]),
                                 torch.cat([want[n].flatten() for n, _ in adapters])) if adapters else 0.0,
            "seen": len(adapters), "quantized": len(quantized_layers(model)),
            "trainable_adapters_only": all(_adapter(n) for n in trainable),
            "state_on_adapters_only": len(opt.state) == len(trainable),
            "slices_equal": slices_equal,
            # the cost model's price of this rank's 4-bit base (tp: its slices' codes and fp32 scales)
            "priced": quantized_bytes(model) == (sum(held_nf4_bytes(layer) for _, layer in quantized_layers(model)),
                                                 max(q.numel for q in held)),
            "base_unchanged": all(torch.equal(t, init[n]) for n, t in pairs if not _adapter(n)),
        }
    return report


def test_qlora_plans_2_ranks(tmp_path):
    from cuboid.kernels import use_backend

    with use_backend("torch"):  # the CPU path the ranks run (this process has the Triton interpreter on)
        refs = one_device()
        folder = bnb_folder(tmp_path)
        want_logits = bnb_logits(folder)
    assert refs[False][2][-1] != refs[False][2][0]  # the adapters train on the 4-bit base
    reports = run_world(qlora_worker, 2, refs, folder, want_logits, timeout=600)
    for rank, report in enumerate(reports):
        assert sorted(report) == sorted(PLANS + ["bnb tp=2"])
        assert report.pop("bnb tp=2") < 1e-5, (rank, "a bitsandbytes folder under tp=2")
        for spec, r in report.items():
            assert r["quantized"] > 0 and (r["seen"] > 0), (rank, spec, r)
            assert r["trainable_adapters_only"] and r["state_on_adapters_only"], (rank, spec, r)
            assert r["slices_equal"] and r["base_unchanged"] and r["priced"], (rank, spec, r)
            assert r["loss"] < 1e-5 and r["adapters"] < 1e-6, (rank, spec, r)
    # cuboid.zoo.to_hf under tp=2 (each rank holding slices) writes what transformers + bitsandbytes saved
    from safetensors.torch import load_file

    ours, theirs = load_file(f"{folder}-tp2/model.safetensors"), {}
    for f in (tmp_path / "bnb4").glob("*.safetensors"):
        theirs.update(load_file(str(f)))
    assert set(ours) == set(theirs) and any(k.endswith(".nested_absmax") for k in ours)
    bad = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not bad, bad[:5]



def test_every_enumerated_plan_meets_qlora():
    """The generated plan test's QLoRA field (plan_qlora.qlora_options, turned by the plan's index): in each world
    (2, 4, 8 ranks) every enumerated, ready and EXTRA plan has a run on a 4-bit base with LoRA (some of them with
    the reliability checks: their save is read back onto its base), and every 2D/2.5D/3D grid instead a run that
    checked the one-sentence refusal (test_plans._runs without a world: the runs' options only, the refusal on
    the meta device)."""
    from unittest import mock

    from cuboid.parallel import Plan
    from cuboid.zoo import READY_PLANS

    from . import plan_qlora
    from .plan_reliability import checks_reliability
    from .test_plans import FAMILIES, OPTIMIZERS, _runs, families_per_plan, generated

    both = set()  # (world, plan index) of the QLoRA runs that also take the reliability checks
    for world in (2, 4, 8):
        plans, others = generated(world)
        for group, per_plan in ((plans, families_per_plan(world, plans)), (others, len(FAMILIES))):
            met = set()  # plans with a QLoRA run
            with mock.patch.object(plan_qlora, "check_grid_refused", wraps=plan_qlora.check_grid_refused) as grid:
                for index, _, plan, name, extra, *_ in _runs(group, OPTIMIZERS, True, per_plan, FAMILIES, world):
                    if extra.get("quantize") == "nf4":
                        assert plan.tp == 1 or plan.tp_mode == "1d", (world, plan.describe())
                        met.add(index)
                        if checks_reliability(index, name, world):
                            both.add((world, index))
            grids = {i for i, spec in enumerate(group)
                     if (lambda p: p.tp > 1 and p.tp_mode != "1d")(Plan.parse(spec, READY_PLANS))}
            assert met == set(range(len(group))) - grids, (world, sorted(set(range(len(group))) - grids - met))
            checked = {c.args[1] for c in grid.call_args_list}
            assert checked == {Plan.parse(group[i], READY_PLANS) for i in grids}, (world, len(checked), len(grids))
    assert {w for w, _ in both} == {2, 4, 8}, both  # a QLoRA save read back onto its base in every world
