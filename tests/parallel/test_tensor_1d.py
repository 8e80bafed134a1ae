"""1D tensor parallelism: every d1 layer and a whole GPT match one device, and the traffic matches the docs.

Each tp world (2 and 4 gloo ranks) is started once; one worker runs every
check and returns {check: (error, tolerance)}. Tolerance: 1e-5 relative (fp32)
for values, exact for byte counts and for sliced / gathered weights. AdamW runs
with eps=1e-3 for the reason given in test_data_parallel.py.
"""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from .launch import run_world

TOL = 1e-5


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() if b.numel() else 0.0


def _grad_err(sharded, ref):
    """Max relative error of gathered grads of every layer of ``sharded`` against ``ref``'s."""
    from cuboid.zoo.common import sharded_parameters

    refs = {n: p for n, _, _, p in sharded_parameters(ref)}
    def full_grad(mod, local, p):  # replicated layers are plain single-device layers
        return mod.full_tensor_like(local, p.grad) if hasattr(mod, "full_tensor_like") else p.grad

    return max(rel(full_grad(mod, local, p), refs[name].grad) for name, mod, local, p in sharded_parameters(sharded))


def _param_err(sharded, ref):
    from cuboid.zoo.common import sharded_parameters

    refs = {n: p for n, _, _, p in sharded_parameters(ref)}
    return max(rel(mod.full_tensor(local), refs[name]) for name, mod, local, _ in sharded_parameters(sharded))


def _layer_checks(group, p, r, out):
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor import ColumnLinear, RowLinear, VocabEmbedding, vocab_parallel_cross_entropy
    from cuboid.parallel.tensor.d1 import Costs

    torch.manual_seed(0)  # same full layers and inputs on every rank
    B, T, H, HID = 3, 5, 12, 16
    x = torch.randn(B, T, H)

    # Column (gathered, packed, local) and Row (parallel / replicated input)
    for packed in (1, 3):
        full = L.Linear(H, 8 * packed)
        for gather in (True, False):
            col = ColumnLinear.from_full(full, group, packed=packed, gather_output=gather)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = full(xa), col(xb)
            if not gather:  # own slice of each segment
                n = 8 // p
                ya = torch.cat([s[..., r * n:(r + 1) * n] for s in ya.split(8, -1)], -1)
            g = torch.randn(ya.shape)
            (ya * g).sum().backward()
            (yb * g).sum().backward()
            key = f"column packed={packed} gather={gather}"
            out[key + " out"] = (rel(yb, ya), TOL)
            if gather:
                out[key + " dx"] = (rel(xb.grad, xa.grad), TOL)
            for name in ("weight", "bias"):
                grad, ref_grad = col._param(name).grad, full._param(name).grad
                if gather:
                    out[f"{key} d{name}"] = (rel(col.full_tensor_like(name, grad), ref_grad), TOL)
                else:  # only this rank's rows of the reference saw a gradient
                    out[f"{key} d{name} local"] = (rel(grad, col.local_part(name, ref_grad)), TOL)
                out[f"{key} {name} roundtrip"] = (rel(col.full_tensor(name), full._param(name)), 0.0)
            full.zero_grad()
    row_full = L.Linear(HID, H)
    for parallel in (True, False):
        row = RowLinear.from_full(row_full, group, input_is_parallel=parallel)
        z = torch.randn(B, T, HID)
        za, zb = z.clone().requires_grad_(), z.clone().requires_grad_()
        ya = row_full(za)
        yb = row(zb.chunk(p, -1)[r] if parallel else zb)
        g = torch.randn(ya.shape)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        key = f"row parallel={parallel}"
        out[key + " out"] = (rel(yb, ya), TOL)
        own = (lambda t: t.chunk(p, -1)[r]) if parallel else (lambda t: t)
        out[key + " dx"] = (rel(own(zb.grad), own(za.grad)), TOL)
        out[key + " dweight"] = (rel(row.full_tensor_like("weight", row.weight.grad), row_full.weight.grad), TOL)
        out[key + " dbias"] = (rel(row.bias.grad, row_full.bias.grad), TOL)
        row_full.zero_grad()

    # Column -> Row MLP: values, grads, and the bytes of d1.Costs (fp32, then bf16 autocast: half)
    fc, proj = L.Linear(H, HID), L.Linear(HID, H)
    c, w = ColumnLinear.from_full(fc, group), RowLinear.from_full(proj, group)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    proj(F.gelu(fc(xa))).square().sum().backward()
    with comm.count() as tally:
        with comm.count() as inner:
            yb = w(F.gelu(c(xb)))
        yb.square().sum().backward()
    out["mlp dx"] = (rel(xb.grad, xa.grad), TOL)
    out["mlp dfc"] = (rel(c.full_tensor_like("weight", c.weight.grad), fc.weight.grad), TOL)
    out["mlp dproj"] = (rel(w.full_tensor_like("weight", w.weight.grad), proj.weight.grad), TOL)
    for dtype, fp32 in ((None, None), (torch.bfloat16, tally.total)):
        costs = Costs(p, autocast=dtype)
        (f1, b1), (f2, b2) = costs.linear("column", H, HID, B * T), costs.linear("row", HID, H, B * T)
        if dtype is not None:
            with comm.count() as tally, torch.autocast("cpu", dtype=dtype):
                with comm.count() as inner:
                    yb = w(F.gelu(c(xb)))
                yb.float().square().sum().backward()
            out["mlp bf16 bytes are half the fp32 ones"] = (abs(2 * tally.total - fp32), 0.0)
        key = f"mlp {dtype or 'fp32'}"
        out[key + " bytes fwd+bwd"] = (abs(tally.bytes("all_reduce", "tp") - f1 - b1 - f2 - b2), 0.0)
        out[key + " bytes total"] = (abs(tally.total - f1 - b1 - f2 - b2), 0.0)
        out[key + " calls == 2"] = (abs(tally.calls() - 2), 0.0)
        out[key + " fwd bytes (nested tally)"] = (abs(inner.total - f1 - f2), 0.0)

    # vocab embedding, head and loss; padded vocabularies (10, 5) must never leak
    for V in (10, 5, 8):
        emb = L.Embedding(V, H)
        with torch.no_grad():
            emb.weight.normal_()
        ve = VocabEmbedding.from_full(emb, group)
        key = f"vocab {V}"
        local = -(-V // p)
        out[key + " local rows"] = (abs(ve.weight.shape[0] - local), 0.0)
        out[key + " full_tensor"] = (rel(ve.full_tensor("weight"), emb.weight), 0.0)
        ids = torch.arange(B * T).reshape(B, T) % V
        ya, yb = emb(ids), ve(ids)
        g = torch.randn(ya.shape)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        out[key + " lookup"] = (rel(yb, ya), TOL)
        out[key + " dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        emb.zero_grad(), ve.zero_grad()
        h = torch.randn(B, T, H)
        labels = torch.randint(0, V, (B, T))
        labels[0, :2] = -100
        ha, hb = h.clone().requires_grad_(), h.clone().requires_grad_()
        logits = F.linear(ha, emb.weight)
        loss_a = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        loss_a.backward()
        with comm.count() as tally:
            loss_b = ve.lm_loss(hb, labels)
            loss_b.backward()
        expect = sum(Costs(p).lm_loss(V, H, B * T, B * T))
        out[key + " loss"] = (rel(loss_b, loss_a), TOL)
        out[key + " loss dh"] = (rel(hb.grad, ha.grad), TOL)
        out[key + " loss dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        pad = ve.weight.grad[ve.vocab_end - ve.local_start:]
        out[key + " pad grads zero"] = (pad.abs().sum().item(), 0.0)
        out[key + " loss bytes"] = (abs(tally.total - expect), 0.0)
        gathered = ve.lm_logits(h)
        out[key + " gathered logits"] = (rel(gathered, logits), TOL)
        # standalone loss on padded local logits, labels all ignored but one
        lab = torch.full((B, T), -100)
        lab[1, 1] = V - 1
        full_logits = torch.randn(B, T, V)
        padded = torch.cat([full_logits, torch.full((B, T, local * p - V), 7.0)], -1)
        lg = padded.chunk(p, -1)[r].clone().requires_grad_()
        la = full_logits.clone().requires_grad_()
        ref = F.cross_entropy(la.reshape(-1, V), lab.reshape(-1))
        ref.backward()
        got = vocab_parallel_cross_entropy(lg, lab, group, r * local, V)
        got.backward()
        dl = torch.cat([la.grad, torch.zeros(B, T, local * p - V)], -1).chunk(p, -1)[r]
        out[key + " ce sparse labels"] = (rel(got, ref), TOL)
        out[key + " ce sparse grad"] = (rel(lg.grad, dl), TOL)


def _gpt_checks(group, p, r, out):
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Plan, comm
    from cuboid.parallel.optim import LAMB, AdamW, clip_grad_norm_
    from cuboid.parallel.tensor import bytes_per_step, shard_1d
    from cuboid.zoo.common import sharded_parameters
    from safetensors import safe_open
    from safetensors.torch import save_file

    spec = zoo.SPECS["gpt"]
    for vocab in (512, 510):  # 510 pads on tp=4
        key = f"gpt v{vocab}"
        ref = cuboid.load("gpt-debug", seed=0, vocab_size=vocab).train()
        model = shard_1d(copy.deepcopy(ref), spec, group)
        # a meta model sharded then initialised through load_full is the same model
        meta = shard_1d(zoo.build("gpt-debug", vocab_size=vocab), spec, group)
        zoo.materialize(meta, "cpu", seed=0)
        out[key + " meta init"] = (_param_err(meta, ref), 0.0)
        # load from a safetensors file through get_slice (packed qkv, padded vocab)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, f"rank{r}.safetensors")
            save_file({n: t.contiguous() for n, t in ref.state_dict().items()}, path)
            fresh = shard_1d(zoo.build("gpt-debug", vocab_size=vocab), spec, group).to_empty(device="cpu")
            with safe_open(path, "pt") as f:
                for name, mod, local, _ in sharded_parameters(fresh):
                    mod.load_full(local, f.get_slice(name))
        out[key + " safetensors slices"] = (_param_err(fresh, ref), 0.0)
        out[key + " local qkv rows"] = (abs(model.blocks[0].attn.qkv.weight.shape[0] - 3 * 64 // p), 0.0)

        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, vocab, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        mask[3, 5:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        # AdamW for the vocab that divides, LAMB (per-tensor trust ratios: sharded norms) for the padded one;
        # optimizers and clipping read each parameter's placement: no reducer is passed
        make = (lambda ps: AdamW(ps, lr=1e-2, eps=1e-3)) if vocab == 512 else \
            (lambda ps: LAMB(ps, lr=1e-2, eps=1e-3, weight_decay=0.01))
        opt_ref, opt = make(ref.parameters()), make(model.parameters())
        params = list(model.parameters())
        for step in range(3):
            loss_ref = ref(**batch).loss
            with comm.count() as tally:
                loss = model(**batch).loss  # the zoo forward: vocab-parallel loss, logits never gathered
                loss.backward()
            loss_ref.backward()
            if step == 0:
                out[key + " loss"] = (rel(loss, loss_ref), TOL)
                out[key + " grads"] = (_grad_err(model, ref), TOL)
                expect = bytes_per_step(ref.config, Plan(tp=p), *ids.shape)
                out[key + " step bytes == bytes_per_step"] = (abs(tally.total - expect) / expect, 1e-12)
            n_ref = clip_grad_norm_(list(ref.parameters()), 0.5)
            n_tp = clip_grad_norm_(params, 0.5)
            out[f"{key} grad norm {step}"] = (rel(n_tp, n_ref), TOL)
            opt_ref.step(), opt.step()
            opt_ref.zero_grad(), opt.zero_grad()
        out[key + " params after 3 steps"] = (_param_err(model, ref), 3e-5 if vocab != 512 else TOL)
        with comm.count() as tally, torch.autocast("cpu", dtype=torch.bfloat16):  # matmul operands move in bf16
            model(**batch).loss.float().backward()
        expect = bytes_per_step(ref.config, Plan(tp=p), *ids.shape, autocast=torch.bfloat16)
        out[key + " bf16 step bytes == bytes_per_step"] = (abs(tally.total - expect) / expect, 1e-12)
        model.zero_grad()
        start = cuboid.load("gpt-debug", seed=0, vocab_size=vocab)
        moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), start.parameters()))
        out[key + " params moved (negated)"] = (-moved, -1e-3)
        pad = model.tok_emb.weight[model.tok_emb.vocab_end - model.tok_emb.local_start:]
        out[key + " pad rows stay zero"] = (pad.abs().sum().item(), 0.0)


def tp1d_worker():
    import torch.distributed as dist

    from cuboid.parallel import Mesh, Plan, comm

    p = int(os.environ["WORLD_SIZE"])
    mesh = Mesh.build(Plan(tp=p))
    group, r = mesh.group("tp"), mesh.coords["tp"]
    out = {"tp group name": (0.0 if comm.group_name(group) == "tp" else 1.0, 0.0),
           "tp rank": (abs(r - dist.get_rank()), 0.0)}
    _layer_checks(group, p, r, out)
    _gpt_checks(group, p, r, out)
    if p == 4:  # the 2D sub-grid groups exist and talk
        mesh2 = Mesh.build(Plan(tp=4, tp_mode="2d"))
        t = torch.ones(1)
        with comm.count() as tally:
            comm.all_reduce_(t, mesh2.group("tp_row"))
            comm.all_reduce_(t, mesh2.group("tp_col"))
        out["2d groups reduce"] = (abs(t.item() - 4), 0.0)
        out["2d group names"] = (abs(tally.bytes(group="tp_row") - 4) + abs(tally.bytes(group="tp_col") - 4), 0.0)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_1d_matches_single_device(world):
    reports = run_world(tp1d_worker, world, timeout=240)
    for rank, report in enumerate(reports):
        bad = {k: v for k, (v, tol) in report.items() if not v <= tol}
        assert not bad, (rank, bad)
    assert len(reports[0]) > 60


def test_mesh_tensor_grids():
    from cuboid.parallel import Mesh, Plan

    m = Mesh.layout(Plan(tp=4, tp_mode="2d"), rank=1)  # tensor rank 1 = row 0, column 1
    assert m.group_ranks["tp_row"] == [0, 1] and m.group_ranks["tp_col"] == [1, 3]
    assert (m.coords["tp_row"], m.coords["tp_col"]) == (1, 0)
    m = Mesh.layout(Plan(dp=2, tp=8, tp_mode="3d"), rank=13)  # dp 1, tensor rank 5 = (k 1, i 0, j 1)
    assert m.group_ranks["tp"] == list(range(8, 16))
    assert m.group_ranks["tp_dep"] == [9, 13] and m.group_ranks["tp_col"] == [13, 15]
    assert m.group_ranks["tp_row"] == [12, 13] and m.group_ranks["dp"] == [5, 13]
    m = Mesh.layout(Plan(tp=8, tp_mode="2.5d", depth=2), rank=6)  # (k 1, i 1, j 0)
    assert (m.group_ranks["tp_dep"], m.group_ranks["tp_col"], m.group_ranks["tp_row"]) == ([2, 6], [4, 6], [6, 7])
    assert m.groups["tp_row"] is None and "tp_row" not in Mesh.layout(Plan(tp=4), 0).groups
    m = Mesh.layout(Plan(tp=4, tp_mode="2.5d", depth=1), rank=3)
    assert m.group_ranks["tp_dep"] == [3] and m.size("tp_dep") == 1


def test_a_loss_without_labels_is_nan_with_zero_gradients():
    """A rank or micro-batch whose labels are all ignored (sequence chunks of a masked-LM batch) has a NaN
    loss, as F.cross_entropy, and its zeroed term must send zeros back, not 0 * (1 / 0) = NaN (BERT under
    tp=2,sp=4 has such ranks)."""
    from cuboid.parallel.head import cross_entropy
    from cuboid.parallel.tensor.base import vocab_parallel_cross_entropy

    for loss_of in (lambda x, y: vocab_parallel_cross_entropy(x, y, None, 0, 7),
                    lambda x, y: cross_entropy(x.half(), y)):  # the chunked half-precision path
        logits = torch.randn(3, 5, 7, requires_grad=True)
        labels = torch.full((3, 5), -100)
        loss = loss_of(logits, labels)
        assert torch.isnan(loss)
        (loss.nan_to_num(0.0) * 0.0).backward()
        assert torch.equal(logits.grad, torch.zeros_like(logits)), logits.grad
