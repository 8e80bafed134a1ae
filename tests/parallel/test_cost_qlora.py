"""The cost model's price of a 4-bit base (QLoRA, issue 50): bytes at the NF4 formula, and ``cuboid plans
--quantize nf4`` ranking with them.

- :func:`cuboid.kernels.nf4.nf4_nbytes` against what :func:`quantize_nf4` keeps and what bitsandbytes 0.50's
  ``quantize_4bit`` (nf4, double quantization) keeps for the same weight, and about 0.516 bytes a value;
- :func:`cuboid.parallel.quant.quantized_bytes` of a meta model (what the planner prices) against the bytes a
  loaded QLoRA model's NF4 layers hold;
- ``cuboid plans --quantize nf4`` on Llama 3.1 8B over two 16 GB devices: more plans fit than with bf16
  weights under LoRA (dp=2 among them), and dp=2's parameter bytes are the non-quantized parameters' plus the
  formula's over every block linear; over two 10 GB devices no plan fits bf16 weights and most fit the
  4-bit base.
"""
import json

import pytest
import torch

LLAMA_8B = dict(layers=32, dim=4096, q=4096, kv=1024, mlp=14336)


def test_nf4_bytes_against_quantize_and_bitsandbytes():
    from cuboid.kernels.nf4 import nf4_nbytes, quantize_nf4

    bnb = pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(0)
    for shape in ((64,), (3, 50), (256, 64), (64 * 257 + 5,)):
        w = torch.randn(shape, generator=g)
        n = w.numel()
        assert quantize_nf4(w).nbytes() == nf4_nbytes(n), shape
        assert quantize_nf4(w, double_quant=False).nbytes() == nf4_nbytes(n, double_quant=False), shape
        packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
        theirs = [packed, state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset]
        assert sum(t.numel() * t.element_size() for t in theirs) == nf4_nbytes(n), shape
    n = LLAMA_8B["dim"] * LLAMA_8B["mlp"]
    assert nf4_nbytes(n) == n // 2 + n // 64 + n // (64 * 256) * 4 + (16 + 256 + 1) * 4  # + the maps and offset
    assert 0.515 < nf4_nbytes(n) / n < 0.52 and 0.5625 <= nf4_nbytes(n, double_quant=False) / n < 0.563


def test_priced_bytes_are_the_loaded_models():
    import cuboid
    from cuboid.loading.builder import ModelBuilder
    from cuboid.loading.quantize import AdaptedBuilder
    from cuboid.parallel import Plan
    from cuboid.parallel.quant import held_nf4_bytes, quantized_bytes, quantized_layers

    model = cuboid.load("llama-debug", quantize="nf4", lora="r=4")
    held = [layer.nf4_weight() for _, layer in quantized_layers(model)]
    meta = AdaptedBuilder(ModelBuilder("llama-debug"), "nf4")(Plan())
    assert len(held) == 2 * 7 and all(p.is_meta for p in meta.parameters())
    assert quantized_bytes(meta) == quantized_bytes(model) == (sum(q.nbytes() for q in held),
                                                              max(q.numel for q in held))
    assert sum(held_nf4_bytes(layer) for _, layer in quantized_layers(model)) == quantized_bytes(model)[0]
    trainable = {n for n, p in meta.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the 4-bit base trains through adapters only


def _plans(capsys, *extra):
    from cuboid.cli import main

    code = main(["plans", "--model", "llama3.1-8b", "--batch", "2", "--seq", "512", "--layout", "half",
                 "--no-search", "--json", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return {r["plan"]: r for r in json.loads(out)}


def _dp2(rows) -> dict:
    """The row of plain dp=2 (as given or, when it did not fit, fully checkpointed)."""
    from cuboid.parallel import Plan

    plain = lambda q: (q.dp, q.tp, q.pp, q.sp, q.zero) == (2, 1, 1, 1, 0)  # noqa: E731
    hits = [r for p, r in rows.items() if plain(Plan.parse(p))]
    assert len(hits) == 1, list(rows)
    return hits[0]


def test_plans_quantize_nf4_fits_what_bf16_does_not(capsys):
    from cuboid import zoo
    from cuboid.kernels.nf4 import nf4_nbytes

    lora = _plans(capsys, "--gpus", "2", "--gpu-memory", "16GB", "--lora", "r=8,alpha=16")
    nf4 = _plans(capsys, "--gpus", "2", "--gpu-memory", "16GB", "--quantize", "nf4")
    assert not _dp2(lora)["fits"] and _dp2(nf4)["fits"], (_dp2(lora)["why"], _dp2(nf4)["memory"])
    fits = lambda rows: {p.replace(",checkpoint=full", "") for p, r in rows.items() if r["fits"]}  # noqa: E731
    assert fits(lora) < fits(nf4), (fits(lora), fits(nf4))  # more plans fit: the ranking gains dp, sp, ZeRO
    # dp=2 holds every parameter: the bf16 ones (embeddings, head, norms, adapters) and the NF4 base
    c = zoo.config_of("llama3.1-8b")
    L = LLAMA_8B
    linears = [L["q"] * L["dim"], L["kv"] * L["dim"], L["kv"] * L["dim"], L["dim"] * L["q"],
               L["mlp"] * L["dim"], L["mlp"] * L["dim"], L["dim"] * L["mlp"]]
    base = L["layers"] * sum(nf4_nbytes(n) for n in linears)
    r, dims = 8, [(L["dim"], L["q"]), (L["dim"], L["kv"]), (L["dim"], L["kv"]), (L["q"], L["dim"]),
                  (L["dim"], L["mlp"]), (L["dim"], L["mlp"]), (L["mlp"], L["dim"])]
    adapters = L["layers"] * sum(r * (i + o) for i, o in dims)
    others = 2 * c.vocab_size * c.dim + (2 * L["layers"] + 1) * c.dim  # embeddings, head, norms
    row = _dp2(nf4)
    assert row["params"] == base + 2 * (others + adapters)
    assert row["grads"] == 2 * adapters and row["masters"] == 4 * adapters
    # two 10 GB devices: no plan fits bf16 weights, most fit the 4-bit base
    small_lora = _plans(capsys, "--gpus", "2", "--gpu-memory", "10GB", "--lora", "r=8,alpha=16")
    small_nf4 = _plans(capsys, "--gpus", "2", "--gpu-memory", "10GB", "--quantize", "nf4")
    assert not any(r["fits"] for r in small_lora.values())
    assert sum(r["fits"] for r in small_nf4.values()) > len(small_nf4) / 2, small_nf4


def test_plans_leave_out_tensor_cuts_through_nf4_blocks():
    """llama-debug's attention output and MLP down projections cut over tp=2 keep 32 and 80 columns a rank, so
    no tp plan takes its 4-bit base (the load refuses them); widened to whole blocks of 64 per rank, tp=2 is
    ranked. The planner's shape rule (quant.check_whole_blocks) gives the load's answer (quant._local_part on
    quantized weights) for every layer of the first and last rank of tp=2 and tp=4, narrow and widened."""
    from cuboid.kernels.nf4 import quantize_nf4
    from cuboid.loading.builder import ModelBuilder
    from cuboid.loading.planner import rank_plans
    from cuboid.parallel import Mesh, Plan, cost
    from cuboid.parallel.quant import BlockCutError, _local_part, block_linears, check_whole_blocks, quantize_linears

    hw = cost.load_hardware("h100")
    wide = dict(head_dim=32, mlp_hidden=256)
    narrow = {e.plan.tp for e in rank_plans("llama-debug", 2, hw, 8, 32, quantize="nf4", search=False)}
    widened = {e.plan.tp for e in rank_plans(ModelBuilder("llama-debug", overrides=wide), 2, hw, 8, 32,
                                             quantize="nf4", search=False)}
    assert narrow == {1} and widened == {1, 2}, (narrow, widened)
    answers = []
    for overrides in ({}, wide):
        for spec in ("tp=2", "tp=4"):
            plan = Plan.parse(spec)
            for rank in (0, plan.tp - 1):
                model = ModelBuilder("llama-debug", overrides=overrides)(plan, Mesh.layout(plan, rank))
                mods = dict(model.named_modules())
                for path in quantize_linears(model, block_linears(model)):
                    layer, answer = mods[path], []
                    for rule in (lambda: check_whole_blocks(layer),
                                 lambda: _local_part(layer, quantize_nf4(torch.randn(layer.nf4_full_shape)), "cpu")):
                        try:
                            rule()
                            answer.append(True)
                        except BlockCutError:
                            answer.append(False)
                    assert answer[0] == answer[1], (overrides, spec, rank, path, answer)
                    answers.append(answer[0])
    assert any(answers) and not all(answers)
