"""3D tensor parallelism at tp=8 (q=2): every d3 layer, an alternating Linear pair, GPT and ViT match one device.

One world of 8 gloo ranks is started once; one worker runs every check and
returns {check: (error, tolerance)}. Tolerance: 1e-5 relative (fp32) for
values, exact for byte counts (``d3.Costs`` per layer, ``bytes_per_step`` for a
GPT training step; half under bf16 autocast), for sliced / gathered weights
and for padding.
"""
import copy
import os
import tempfile

import torch
import torch.nn.functional as F

from .launch import run_world
from .test_tensor_1d import _grad_err, _param_err, rel

TOL = 1e-5


def _layer_checks(mesh, out):
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor import d3

    q = mesh.size("tp_row")
    i, j, k = (mesh.coords[a] for a in ("tp_col", "tp_row", "tp_dep"))
    B, T = 4, 3                      # N = 12 rows; B splits over q^2 = 4
    N = B * T                        # rows, fp32

    def split(t, layout="block", hidden=True):
        return d3.split_input(t.detach(), mesh, layout=layout, hidden=hidden).clone().requires_grad_()

    def own(t, layout, packed=1):  # this rank's part of a full activation, packed segments kept apart
        t = d3.split_input(t.detach(), mesh, layout=layout)
        c = mesh.coords[d3.LAYOUTS[layout][1]]
        return torch.cat([s.chunk(q, -1)[c] for s in t.chunk(packed, -1)], -1)

    def check_params(key, new, ref):
        for name, p in ref.named_parameters(recurse=False):
            out[f"{key} d{name}"] = (rel(new.full_tensor_like(name, new._param(name).grad), p.grad), TOL)
            out[f"{key} {name} roundtrip"] = (rel(new.full_tensor(name), p), 0.0)
            out[f"{key} {name} local_part"] = (rel(new.local_part(name, p.detach()), new._param(name)), 0.0)

    torch.manual_seed(0)  # same full layers and inputs on every rank
    costs = d3.Costs(q)

    # Linear3D: column (block -> inner), packed qkv, row (inner -> block)
    for role, K, O in (("column", 8, 12), ("column_qkv", 8, 24), ("row", 12, 8)):
        full = L.Linear(K, O)
        with torch.no_grad():
            full.bias.normal_()
        lin = d3.Linear3D.from_full(full, mesh, role=role)
        lin_in, lin_out = ("inner", "block") if role == "row" else ("block", "inner")
        packed = 3 if role == "column_qkv" else 1
        x = torch.randn(B, T, K, requires_grad=True)
        xs = split(x, lin_in)
        y_ref, y = full(x), lin(xs)
        g = torch.randn(y_ref.shape)
        (y_ref * g).sum().backward()
        (y * own(g, lin_out, packed)).sum().backward()
        out[f"{role} out"] = (rel(y, own(y_ref, lin_out, packed)), TOL)
        out[f"{role} dx"] = (rel(xs.grad, own(x.grad, lin_in)), TOL)
        check_params(role, lin, full)
        out[f"{role} local shape"] = (abs(lin.weight.numel() * q ** 3 - O * K), 0.0)
        if role == "column_qkv":  # whole heads: the j-th 1/q of each of W_q, W_k, W_v
            rows = torch.cat([full.weight[s * 8 + j * 4:s * 8 + (j + 1) * 4] for s in range(3)])
            out["qkv rows are segment blocks j"] = (rel(lin.weight, rows[:, (i * q + k) * 2:(i * q + k + 1) * 2]), 0.0)
            out["qkv shard_slices is a list of 3"] = (abs(len(lin.shard_slices("weight")) - 3), 0.0)

    # two consecutive Linear3D (the alternating layout) = the unsharded MLP, and the exact traffic
    fc, proj = L.Linear(8, 16), L.Linear(16, 8)
    c, r = d3.Linear3D.from_full(fc, mesh, role="column"), d3.Linear3D.from_full(proj, mesh, role="row")
    x = torch.randn(B, T, 8, requires_grad=True)
    xs = split(x)
    proj(F.gelu(fc(x))).square().sum().backward()
    r(F.gelu(c(xs))).square().sum().backward()
    out["mlp out dx"] = (rel(xs.grad, own(x.grad, "block")), TOL)
    out["mlp dfc"] = (rel(c.full_tensor_like("weight", c.weight.grad), fc.weight.grad), TOL)
    out["mlp dproj"] = (rel(r.full_tensor_like("weight", r.weight.grad), proj.weight.grad), TOL)
    out["mlp dproj bias"] = (rel(r.full_tensor_like("bias", r.bias.grad), proj.bias.grad), TOL)
    for needs_dx in (True, False):
        K, O = 8, 12
        lin = d3.Linear3D.from_full(L.Linear(K, O), mesh)
        xs = split(torch.randn(B, T, K)).requires_grad_(needs_dx)
        with comm.count() as tally:
            with comm.count() as fwd:
                y = lin(xs)
            y.square().sum().backward()
        f, bwd = costs.linear("column", K, O, N, dx=needs_dx)
        key = f"linear bytes (dx={needs_dx})"
        out[key + " fwd"] = (abs(fwd.total - f), 0.0)
        out[key + " bwd"] = (abs(tally.total - fwd.total - bwd), 0.0)
        out[key + " calls"] = (abs(tally.calls() - (7 if needs_dx else 6)), 0.0)
        out[key + " groups"] = (abs(fwd.calls(group="tp_dep") + fwd.calls(group="tp_row")
                                    + fwd.calls(group="tp_col") - 3), 0.0)
        if needs_dx:  # bf16 autocast: every operand and gradient moves in 2 bytes
            with comm.count() as half, torch.autocast("cpu", dtype=torch.bfloat16):
                lin(xs).float().square().sum().backward()
            out[key + " bf16 is half"] = (abs(2 * half.total - tally.total), 0.0)
            out[key + " bf16"] = (abs(half.total - sum(d3.Costs(q, autocast=torch.bfloat16).linear("column", K, O, N))),
                                  0.0)

    # LayerNorm3D, plain and with the fused residual, and its exact traffic
    H = 8
    ln = L.LayerNorm(H)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    ln3 = d3.LayerNorm3D.from_full(ln, mesh)
    x, res = torch.randn(B, T, H, requires_grad=True), torch.randn(B, T, H, requires_grad=True)
    xs, rs = split(x), split(res)
    ya, ha = ln(x, res)
    with comm.count() as tally:
        with comm.count() as fwd:
            yb, hb = ln3(xs, rs)
        g1, g2 = torch.randn(ya.shape), torch.randn(ya.shape)
        ((yb * own(g1, "block")).sum() + (hb * own(g2, "block")).sum()).backward()
    ((ya * g1).sum() + (ha * g2).sum()).backward()
    out["norm out"] = (rel(yb, own(ya, "block")), TOL)
    out["norm residual out"] = (rel(hb, own(ha, "block")), TOL)
    out["norm dx"] = (rel(xs.grad, own(x.grad, "block")), TOL)
    out["norm dresidual"] = (rel(rs.grad, own(res.grad, "block")), TOL)
    check_params("norm", ln3, ln)
    f, bwd = costs.norm(H, N)
    out["norm bytes fwd"] = (abs(fwd.total - f), 0.0)
    out["norm bytes bwd"] = (abs(tally.total - fwd.total - bwd), 0.0)
    ln.zero_grad(), ln3.zero_grad()
    xs2 = split(x)
    (ln3(xs2) * own(g1, "block")).sum().backward()
    (ln(x) * g1).sum().backward()
    out["norm plain out grad"] = (rel(ln3.full_tensor_like("weight", ln3.weight.grad), ln.weight.grad), TOL)

    # vocabulary: lookup, tied head, loss with -100 labels, bias; padded vocabularies (10, 5) must never leak
    for V in (10, 5, 16):
        emb, bias = L.Embedding(V, H), L.LearnedTensor(V)
        with torch.no_grad():
            emb.weight.normal_(), bias.weight.normal_()
        ve, vb = d3.VocabEmbedding3D.from_full(emb, mesh), d3.VocabTensor3D.from_full(bias, mesh)
        key = f"vocab {V}"
        vl = -(-V // q ** 2)
        out[key + " local rows"] = (abs(ve.weight.shape[0] - vl), 0.0)
        out[key + " full_tensor"] = (rel(ve.full_tensor("weight"), emb.weight), 0.0)
        out[key + " bias full_tensor"] = (rel(vb.full_tensor("weight"), bias.weight), 0.0)
        ids = torch.arange(N).reshape(B, T) * 7 % V
        ya = emb(ids)
        g = torch.randn(ya.shape)
        ids_b, g_b, vp = d3.split_input(ids, mesh), own(g, "block"), vl * q ** 2
        with comm.count() as tally:
            with comm.count() as fwd:
                yb = ve(ids_b)
            (yb * g_b).sum().backward()
        (ya * g).sum().backward()
        f, bwd = costs.lookup(V, H, N)
        out[key + " lookup bytes fwd"] = (abs(fwd.total - f), 0.0)
        out[key + " lookup bytes bwd"] = (abs(tally.total - fwd.total - bwd), 0.0)
        out[key + " lookup"] = (rel(yb, own(ya, "block")), TOL)
        out[key + " dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        emb.zero_grad(), ve.zero_grad()
        h = torch.randn(B, T, H, requires_grad=True)
        labels = torch.randint(0, V, (B, T))
        labels[0, :2] = -100
        labels[3, 1] = -100
        hs = split(h)
        logits = F.linear(h, emb.weight, bias.weight)
        loss_a = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        loss_a.backward()
        labels_b = d3.split_input(labels, mesh)
        with comm.count() as tally:
            with comm.count() as fwd:
                loss_b = ve.lm_loss(hs, labels_b, bias=vb())
            loss_b.backward()
        f, bwd = costs.lm_loss(V, H, N, N, bias=True)
        out[key + " loss bytes fwd"] = (abs(fwd.total - f), 0.0)
        out[key + " loss bytes bwd"] = (abs(tally.total - fwd.total - bwd), 0.0)
        out[key + " loss"] = (rel(loss_b, loss_a), TOL)
        out[key + " loss dh"] = (rel(hs.grad, own(h.grad, "block")), TOL)
        out[key + " loss dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        out[key + " loss dbias"] = (rel(vb.full_tensor_like("weight", vb.weight.grad), bias.weight.grad), TOL)
        first = (i * q + k) * vl  # padded vocab index of this rank's first table row
        pad = slice(max(0, min(vl, V - first)), vl)
        out[key + " pad rows zero"] = (ve.weight[pad].abs().sum().item(), 0.0)
        out[key + " pad grads zero"] = (ve.weight.grad[pad].abs().sum().item(), 0.0)
        bpad = slice(max(0, min(vl * q, V - i * vl * q)), vl * q)
        out[key + " bias pad grads zero"] = (vb.weight.grad[bpad].abs().sum().item(), 0.0)
        with torch.no_grad():
            out[key + " gathered logits"] = (rel(ve.lm_logits(hs, bias=vb()), logits), TOL)
            out[key + " gathered logits shape"] = (abs(ve.lm_logits(hs).shape[-1] - V), 0.0)

    # Embedding3D (split and broadcast ids), LearnedTensor3D
    pe = L.Embedding(6, H)
    pe3 = d3.Embedding3D.from_full(pe, mesh)
    ids = torch.randint(0, 6, (B, T))
    pos = torch.arange(T).unsqueeze(0)
    ya = pe(ids) + pe(pos)
    yb = pe3(d3.split_input(ids, mesh)) + pe3(pos)
    g = torch.randn(ya.shape)
    (ya * g).sum().backward()
    (yb * own(g, "block")).sum().backward()
    out["embedding out"] = (rel(yb, own(ya, "block")), TOL)
    check_params("embedding", pe3, pe)
    with comm.count() as tally:
        (pe3(pos) * own(g, "block")).sum().backward()
    out["embedding bytes bwd"] = (abs(tally.total - costs.embedding(6, H)[1]), 0.0)
    tok = L.LearnedTensor(1, T, H)
    with torch.no_grad():
        tok.weight.normal_()
    tok3 = d3.LearnedTensor3D.from_full(tok, mesh)
    x = torch.randn(B, T, H)
    ((x + tok()) * g).sum().backward()
    ((split(x) + tok3()) * own(g, "block")).sum().backward()
    out["tensor out"] = (rel(split(x) + tok3(), own(x + tok(), "block")), TOL)
    check_params("tensor", tok3, tok)

    # Head3D: classifier (hidden -> replicated), pooler (hidden -> hidden), patch embedding (full -> hidden)
    for in_l, out_l, K, O in (("hidden", "replicated", 8, 3), ("hidden", "hidden", 8, 8), ("full", "hidden", 6, 8)):
        full = L.Linear(K, O)
        with torch.no_grad():
            full.bias.normal_()
        head = d3.Head3D.from_full(full, mesh, in_layout=in_l, out_layout=out_l)
        x = torch.randn(B, T, K, requires_grad=True)
        xs = split(x, hidden=in_l == "hidden")
        ya = full(x)
        g = torch.randn(ya.shape)
        g_b = g if out_l == "replicated" else own(g, "block")
        with comm.count() as tally:
            with comm.count() as fwd:
                yb = head(xs)
            (yb * g_b).sum().backward()
        (ya * g).sum().backward()
        key = f"head {in_l}->{out_l}"
        f, bwd = costs.head(K, O, N, in_l, out_l)
        out[key + " bytes fwd"] = (abs(fwd.total - f), 0.0)
        out[key + " bytes bwd"] = (abs(tally.total - fwd.total - bwd), 0.0)
        out[key + " out"] = (rel(yb, ya if out_l == "replicated" else own(ya, "block")), TOL)
        own_dx = own(x.grad, "block") if in_l == "hidden" else d3.split_input(x.grad, mesh)
        out[key + " dx"] = (rel(xs.grad, own_dx), TOL)
        check_params(key, head, full)

    # split_input / gather_output round trips
    x = torch.randn(B, T, H)
    for layout in ("block", "inner"):
        back = d3.gather_output(d3.split_input(x, mesh, layout=layout, hidden=True), mesh, layout=layout, hidden=True)
        out[f"split/gather {layout}"] = (rel(back, x), 0.0)


def _model_checks(mesh, out):
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import comm
    from cuboid.parallel.optim import AdamW, clip_grad_norm_
    from cuboid.parallel.tensor import bytes_per_step, d3
    from cuboid.zoo.common import sharded_parameters
    from safetensors import safe_open
    from safetensors.torch import save_file

    # GPT, vocab 510 (padded to 512): sharded copy, meta init, loss/grads/clipping/AdamW against one device
    ref = cuboid.load("gpt-debug", seed=0, vocab_size=510).train()
    model = d3.shard_3d(copy.deepcopy(ref), zoo.SPECS["gpt"], mesh)
    meta = d3.shard_3d(zoo.build("gpt-debug", vocab_size=510), zoo.SPECS["gpt"], mesh)
    zoo.materialize(meta, "cpu", seed=0)
    out["gpt meta init"] = (_param_err(meta, ref), 0.0)
    with tempfile.TemporaryDirectory() as d:  # each rank reads only its slices (packed qkv, padded vocab)
        path = os.path.join(d, f"rank{mesh.rank}.safetensors")
        save_file({n: t.contiguous() for n, t in ref.state_dict().items()}, path)
        fresh = d3.shard_3d(zoo.build("gpt-debug", vocab_size=510), zoo.SPECS["gpt"], mesh).to_empty(device="cpu")
        with safe_open(path, "pt") as f:
            for name, mod, local, _ in sharded_parameters(fresh):
                mod.load_full(local, f.get_slice(name))
    out["gpt safetensors slices"] = (_param_err(fresh, ref), 0.0)
    kinds = (model.blocks[0].attn.qkv, d3.Linear3D), (model.ln_f, d3.LayerNorm3D), (model.pos_emb, d3.Embedding3D)
    out["gpt types"] = (0.0 if all(isinstance(m, t) for m, t in kinds) else 1.0, 0.0)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 510, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    params = list(model.parameters())
    opt_ref, opt = AdamW(ref.parameters(), lr=1e-2, eps=1e-3), AdamW(params, lr=1e-2, eps=1e-3)
    # the model-level integration: ids/labels in the block layout, the attention's mask in the inner one
    local = {"input_ids": d3.split_input(ids, mesh), "labels": d3.split_input(labels, mesh),
             "attention_mask": d3.split_input(mask, mesh, layout="inner")}
    for step in range(2):
        loss_ref = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        with comm.count() as tally:  # the zoo forward: vocab-parallel loss, logits never gathered
            loss = model(**local).loss
            loss.backward()
        loss_ref.backward()
        if step == 0:
            out["gpt loss"] = (rel(loss, loss_ref), TOL)
            out["gpt grads"] = (_grad_err(model, ref), TOL)
            expect = bytes_per_step(ref.config, mesh.plan, *ids.shape)
            out["gpt step bytes == bytes_per_step"] = (abs(tally.total - expect) / expect, 1e-12)
        n_ref = clip_grad_norm_(list(ref.parameters()), 0.5)
        n_3d = clip_grad_norm_(params, 0.5)  # the parameters' placements: (tp, replicas)
        out[f"gpt grad norm {step}"] = (rel(n_3d, n_ref), TOL)
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    out["gpt params after 2 AdamW steps"] = (_param_err(model, ref), TOL)
    vl = model.tok_emb.weight.shape[0]
    first = (mesh.coords["tp_col"] * 2 + mesh.coords["tp_dep"]) * vl  # padded index of the first local row
    out["gpt pad rows stay zero"] = (model.tok_emb.weight[max(0, min(vl, 510 - first)):].abs().sum().item(), 0.0)

    # ViT runs its own forward unchanged: pixels split, labels whole (the classifier's logits are replicated)
    ref = cuboid.load("vit-debug", seed=0).train()
    model = d3.shard_3d(copy.deepcopy(ref), zoo.SPECS["vit"], mesh)
    out["vit types"] = (0.0 if isinstance(model.patch, d3.Head3D) and isinstance(model.cls_token, d3.LearnedTensor3D)
                        and model.classifier.out_layout == "replicated" else 1.0, 0.0)
    pixels = torch.randn(4, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    a = ref(pixel_values=pixels, labels=labels)
    b = model(pixel_values=d3.split_input(pixels, mesh), labels=labels)
    a.loss.backward()
    b.loss.backward()
    out["vit logits"] = (rel(b.logits, a.logits), TOL)
    out["vit loss"] = (rel(b.loss, a.loss), TOL)
    out["vit grads"] = (_grad_err(model, ref), TOL)

    # BERT classifier, no padding: its own forward too (ids split; pooler hidden -> hidden; classifier replicated)
    ref = cuboid.load("bert-debug", seed=0, head="cls").train()
    model = d3.shard_3d(copy.deepcopy(ref), zoo.SPECS["bert"], mesh)
    ids, labels = torch.randint(0, 512, (4, 8), generator=g), torch.randint(0, 2, (4,), generator=g)
    a = ref(input_ids=ids, labels=labels)
    b = model(input_ids=d3.split_input(ids, mesh), labels=labels)
    a.loss.backward()
    b.loss.backward()
    out["bert pooler is hidden->hidden"] = (0.0 if model.pooler.out_layout == "hidden" else 1.0, 0.0)
    out["bert loss"] = (rel(b.loss, a.loss), TOL)
    out["bert pooled"] = (rel(b.pooler_output, d3.split_input(a.pooler_output, mesh, hidden=True)), TOL)
    out["bert grads"] = (_grad_err(model, ref), TOL)


def tp3d_worker():
    from cuboid.parallel import Mesh, Plan

    mesh = Mesh.build(Plan(tp=8, tp_mode="3d"))
    out = {}
    _layer_checks(mesh, out)
    _model_checks(mesh, out)
    return out


def test_tensor_3d_matches_single_device():
    reports = run_world(tp3d_worker, 8, timeout=240)
    for rank, report in enumerate(reports):
        bad = {k: v for k, (v, tol) in report.items() if not v <= tol}
        assert not bad, (rank, bad)
    assert len(reports[0]) > 80


def test_single_rank_cube_is_single_device():
    """q = 1: every 3D layer is its single-device layer (no process group at all)."""
    from cuboid.parallel import Mesh, Plan, layers as L
    from cuboid.parallel.tensor import d3

    mesh = Mesh.layout(Plan(tp=1, tp_mode="3d"))
    torch.manual_seed(0)
    x, ids = torch.randn(2, 3, 8), torch.randint(0, 10, (2, 3))
    lin, ln, emb = L.Linear(8, 24), L.LayerNorm(8), L.Embedding(10, 8)
    assert torch.allclose(d3.Linear3D.from_full(lin, mesh, role="column_qkv")(x), lin(x))
    assert torch.allclose(d3.LayerNorm3D.from_full(ln, mesh)(x), ln(x), atol=1e-6)
    ve = d3.VocabEmbedding3D.from_full(emb, mesh)
    assert torch.equal(ve(ids), emb(ids))
    ref = F.cross_entropy(F.linear(x, emb.weight).reshape(-1, 10), ids.reshape(-1))
    assert torch.allclose(ve.lm_loss(x, ids), ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: bf16 product, grads in the params' dtype
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        lin3 = d3.Linear3D.from_full(lin, mesh, role="column_qkv")
        ya, yb = lin(xa), lin3(xb)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    assert yb.dtype == ya.dtype == torch.bfloat16 and lin3.weight.grad.dtype == torch.float32
    assert torch.allclose(lin3.weight.grad, lin.weight.grad, rtol=2e-2, atol=1e-2)
    assert torch.allclose(xb.grad, xa.grad, rtol=2e-2, atol=1e-2)
    try:
        d3.Linear3D(8, 8, mesh=Mesh.layout(Plan(tp=1)), role="diagonal")
    except ValueError as e:
        assert "column" in str(e)
    else:
        raise AssertionError("a bad role must be refused")
    try:  # a 1D mesh of 8 is no cube
        d3.LayerNorm3D(8, mesh=Mesh.layout(Plan(tp=8), rank=1))
    except ValueError as e:
        assert "q x q x q" in str(e)
    else:
        raise AssertionError("a 1D mesh must be refused")
    plan = Mesh.layout(Plan(tp=8, tp_mode="3d"), rank=5)  # layout only: local shapes for planning, on meta
    qkv = d3.Linear3D(64, 192, mesh=plan, role="column_qkv", device="meta")
    assert tuple(qkv.weight.shape) == (96, 16) and qkv.replicas("bias") == 4 and qkv.replicas("weight") == 1
