"""2D (q=2, tp=4) and 2.5D (d=2, q=2, tp=8) tensor parallelism: layers and a GPT match one device.

Each world is started once; one worker runs every check and returns
{check: (error, tolerance)}. Every layer's forward and backward (gradients
gathered to full tensors) match the single-device layer holding the same full
weights, fp32 1e-5 relative; byte counts of a forward + backward equal
``grid.Costs`` (per layer) and ``bytes_per_step`` (a GPT training step)
exactly, and halve under bf16 autocast; sliced / gathered weights are exact.
The 2.5D world (8 processes on few cores) runs a smaller but real subset.
"""
import copy

import torch
import torch.nn.functional as F

from .launch import run_world

TOL = 1e-5
B, T, IN, OUT, H = 4, 3, 8, 12, 8  # B splits into d q = 4 blocks


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() if b.numel() else 0.0


class Local:
    """This rank's block of full tensors: batch block k q + i on dim 0, hidden block j of the last dim."""

    def __init__(self, grid):
        self.g = grid

    def batch(self, t):
        return t.chunk(self.g.d * self.g.q, 0)[self.g.batch_index]

    def hid(self, t, parts=1):  # block j of each of ``parts`` segments of the last dim
        return torch.cat([s.chunk(self.g.q, -1)[self.g.j] for s in t.chunk(parts, -1)], -1)

    def __call__(self, t, parts=1):
        return self.hid(self.batch(t), parts)


def _grads(mod, ref, out, key, names=("weight", "bias")):
    for name in names:
        p = getattr(mod, name, None)
        if p is not None:
            out[f"{key} d{name}"] = (rel(mod.full_tensor_like(name, p.grad), getattr(ref, name).grad), TOL)
            out[f"{key} {name} roundtrip"] = (rel(mod.full_tensor(name), getattr(ref, name)), 0.0)


def _linear_checks(C, grid, out, variants):
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor.grid import Costs

    loc = Local(grid)
    for packed, parallel, recompute in variants:
        full = L.Linear(IN, OUT)  # packed=3: three segments of OUT / 3
        with torch.no_grad():
            full.bias.normal_()
        lin = C["linear"].from_full(full, grid, packed=packed, input_is_parallel=parallel, recompute=recompute)
        x = torch.randn(B, T, IN)
        xa = x.clone().requires_grad_()
        xb = (loc(x) if parallel else loc.batch(x)).clone().requires_grad_()
        ya = full(xa)
        g = torch.randn(ya.shape)
        (ya * g).sum().backward()
        with comm.count() as tally:
            with comm.count() as fwd:
                yb = lin(xb)
            (yb * loc(g, packed)).sum().backward()
        key = f"linear packed={packed} parallel={parallel} recompute={recompute}"
        out[key + " out"] = (rel(yb, loc(ya, packed)), TOL)
        out[key + " dx"] = (rel(xb.grad, loc(xa.grad) if parallel else loc.batch(xa.grad)), TOL)
        _grads(lin, full, out, key)
        costs = Costs(grid.q, grid.d)
        f_bytes, b_bytes = costs.linear("column", IN, OUT, B * T, input_is_parallel=parallel, recompute=recompute)
        out[key + " fwd bytes"] = (abs(fwd.total - f_bytes), 0.0)
        out[key + " bwd bytes"] = (abs(tally.total - fwd.total - b_bytes), 0.0)
        if (packed, parallel, recompute) == (1, True, False):  # bf16 autocast: every gather moves half the bytes
            with comm.count() as half, torch.autocast("cpu", dtype=torch.bfloat16):
                lin(xb).float().sum().backward()
            out[key + " bf16 bytes are half"] = (abs(2 * half.total - tally.total), 0.0)
            bf16 = Costs(grid.q, grid.d, autocast=torch.bfloat16).linear("column", IN, OUT, B * T)
            out[key + " bf16 bytes"] = (abs(half.total - sum(bf16)), 0.0)


def _norm_checks(C, grid, out):
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor.grid import Costs

    loc = Local(grid)
    full = L.LayerNorm(H)
    with torch.no_grad():
        full.weight.normal_(), full.bias.normal_()
    ln = C["norm"].from_full(full, grid)
    x, r = torch.randn(B, T, H) * 3 + 1, torch.randn(B, T, H)
    for fused in (False, True):
        key = f"layernorm fused={fused}"
        xa, ra = x.clone().requires_grad_(), r.clone().requires_grad_()
        xb, rb = loc(x).clone().requires_grad_(), loc(r).clone().requires_grad_()
        g, g2 = torch.randn(B, T, H), torch.randn(B, T, H)
        full.zero_grad(), ln.zero_grad()
        if fused:
            ya, sa = full(xa, ra)
            yb, sb = ln(xb, rb)
            ((ya * g).sum() + (sa * g2).sum()).backward()
            ((yb * loc(g)).sum() + (sb * loc(g2)).sum()).backward()
            out[key + " residual out"] = (rel(sb, loc(sa)), TOL)
            out[key + " dresidual"] = (rel(rb.grad, loc(ra.grad)), TOL)
        else:
            ya = full(xa)
            (ya * g).sum().backward()
            with comm.count() as tally:
                with comm.count() as fwd:
                    yb = ln(xb)
                (yb * loc(g)).sum().backward()
            f_bytes, b_bytes = Costs(grid.q, grid.d).norm(H, B * T)
            out[key + " fwd bytes"] = (abs(fwd.total - f_bytes), 0.0)
            out[key + " bwd bytes"] = (abs(tally.total - fwd.total - b_bytes), 0.0)
        out[key + " out"] = (rel(yb, loc(ya)), TOL)
        out[key + " dx"] = (rel(xb.grad, loc(xa.grad)), TOL)
        _grads(ln, full, out, key)


def _vocab_checks(C, grid, out, vocabs):
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor.grid import Costs

    loc, q, d = Local(grid), grid.q, grid.d
    costs = Costs(q, d)
    for V in vocabs:
        key = f"vocab {V}"
        emb, bias = L.Embedding(V, H), L.LearnedTensor(V)
        with torch.no_grad():
            emb.weight.normal_(), bias.weight.normal_()
        ve, vt = C["vocab"].from_full(emb, grid), C["vocab_tensor"].from_full(bias, grid)
        Vp = -(-V // q ** 2) * q ** 2
        out[key + " local shape"] = (abs(ve.weight.shape[0] - Vp // q) + abs(vt.weight.shape[0] - Vp // q ** 2), 0.0)
        out[key + " full_tensor"] = (rel(ve.full_tensor("weight"), emb.weight), 0.0)
        out[key + " bias full_tensor"] = (rel(vt.full_tensor("weight"), bias.weight), 0.0)
        ids = (torch.arange(B * T).reshape(B, T) * 7) % V
        ya = emb(ids)
        g = torch.randn(ya.shape)
        (ya * g).sum().backward()
        with comm.count() as tally:
            yb = ve(loc.batch(ids))
        (yb * loc(g)).sum().backward()
        out[key + " lookup"] = (rel(yb, loc(ya)), TOL)
        out[key + " lookup fwd bytes"] = (abs(tally.total - costs.lookup(V, H, B * T)[0]), 0.0)
        out[key + " lookup dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        emb.zero_grad(), ve.zero_grad()
        # tied head + loss, -100 labels; the first batch block has none at all
        h = torch.randn(B, T, H)
        labels = torch.randint(0, V, (B, T))
        labels[0, :2] = -100
        labels[: B // (d * q)] = -100
        labels[-1, -1] = V - 1
        ha, hb = h.clone().requires_grad_(), loc(h).clone().requires_grad_()
        logits = F.linear(ha, emb.weight, bias.weight)
        loss_a = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        loss_a.backward()
        with comm.count() as tally:
            with comm.count() as fwd:
                loss_b = ve.lm_loss(hb, loc.batch(labels), bias=vt())
            loss_b.backward()
        f_bytes, b_bytes = costs.lm_loss(V, H, B * T, B * T, bias=True)
        out[key + " loss fwd bytes"] = (abs(fwd.total - f_bytes), 0.0)
        out[key + " loss bwd bytes"] = (abs(tally.total - fwd.total - b_bytes), 0.0)
        out[key + " loss"] = (rel(loss_b, loss_a), TOL)
        out[key + " loss dh"] = (rel(hb.grad, loc(ha.grad)), TOL)
        out[key + " loss dweight"] = (rel(ve.full_tensor_like("weight", ve.weight.grad), emb.weight.grad), TOL)
        out[key + " loss dbias"] = (rel(vt.full_tensor_like("weight", vt.weight.grad), bias.weight.grad), TOL)
        pad = ve.weight.grad[ve.vocab_end - ve.local_start:]
        real = max(0, min(V - (grid.j * q + grid.i) * (Vp // q ** 2), Vp // q ** 2))
        out[key + " pad grads zero"] = (pad.abs().sum().item() + vt.weight.grad[real:].abs().sum().item(), 0.0)
        out[key + " gathered logits"] = (rel(ve.lm_logits(loc(h), bias=vt()), logits), TOL)


def _small_checks(C, grid, out):
    """Embedding2D, LearnedTensor2D, Head2D + the batch-mean cross-entropy, split_input / gather_output."""
    from cuboid.parallel import comm, layers as L
    from cuboid.parallel.tensor.grid import Costs, cross_entropy, gather_output, split_input

    loc = Local(grid)
    pos = L.Embedding(6, H)
    pe = C["embedding"].from_full(pos, grid)
    cls = L.LearnedTensor(1, 1, H)
    with torch.no_grad():
        cls.weight.normal_()
    te = C["tensor"].from_full(cls, grid)
    ids = torch.arange(T).unsqueeze(0)
    types = torch.randint(0, 6, (B, T))
    g1, g2, g3 = torch.randn(B, T, H), torch.randn(B, T, H), torch.randn(B, 1, H)
    ((pos(ids) * g1).sum() + (pos(types) * g2).sum() + (cls().expand(B, -1, -1) * g3).sum()).backward()
    y1, y2, y3 = pe(ids), pe(loc.batch(types)), te()
    ((y1 * loc(g1)).sum() + (y2 * loc(g2)).sum() + (y3.expand(y2.shape[0], -1, -1) * loc(g3)).sum()).backward()
    out["embedding positions"] = (rel(y1, loc.hid(pos(ids))), TOL)
    out["embedding batch ids"] = (rel(y2, loc(pos(types))), TOL)
    out["tensor value"] = (rel(y3, loc.hid(cls())), TOL)
    _grads(pe, pos, out, "embedding", ("weight",))
    _grads(te, cls, out, "tensor", ("weight",))

    C_ = 3
    full = L.Linear(H, C_)
    with torch.no_grad():
        full.bias.normal_()
    head = C["head"].from_full(full, grid)
    x = torch.randn(B, H)
    labels = torch.tensor([0, 2, -100, 1])
    xa, xb = x.clone().requires_grad_(), loc(x).clone().requires_grad_()
    ya = full(xa)
    F.cross_entropy(ya, labels).backward()
    with comm.count() as tally:
        with comm.count() as fwd:
            yb = head(xb)
            loss = head.loss_from_logits(yb, loc.batch(labels))
        loss.backward()
    f_bytes, b_bytes = Costs(grid.q, grid.d).head(H, C_, B, loss=True)
    out["head fwd bytes"] = (abs(fwd.total - f_bytes), 0.0)
    out["head bwd bytes"] = (abs(tally.total - fwd.total - b_bytes), 0.0)
    out["head out"] = (rel(yb, loc.batch(ya)), TOL)
    out["head gathered logits"] = (rel(head.gather_logits(yb), ya), 0.0)
    out["head loss (grid.cross_entropy)"] = (rel(cross_entropy(yb, loc.batch(labels), grid), loss), 0.0)
    out["head loss"] = (rel(loss, F.cross_entropy(ya, labels)), TOL)
    out["head dx"] = (rel(xb.grad, loc(xa.grad)), TOL)
    _grads(head, full, out, "head")

    z = torch.randn(B, T, H)
    back = gather_output(split_input(z, grid, hidden=True), grid, hidden=True)
    out["split/gather roundtrip"] = (rel(back, z), 0.0)
    out["split ids"] = (rel(split_input(types, grid).float(), loc.batch(types).float()), 0.0)


def _batch(name, ref):
    g = torch.Generator().manual_seed(7)
    c = ref.config
    if name.startswith("vit"):
        return {"pixel_values": torch.randn(4, c.channels, c.image_size, c.image_size, generator=g),
                "labels": torch.tensor([3, 0, 9, 1])}
    ids = torch.randint(0, c.vocab_size, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 5:] = 0
    if getattr(c, "head", "") == "cls":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, 0, 2, 1])}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _zoo_checks(name, shard, grid, out, meta_check=True, **overrides):
    """A whole zoo model sharded by its spec: meta init, the zoo forward on batch-split inputs, loss,
    logits, every gathered grad and the clipped grad norm (no reducer: the parameters' placements),
    against the single-device model; a GPT step's bytes against ``bytes_per_step``."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Plan, comm
    from cuboid.parallel.optim import clip_grad_norm_
    from cuboid.parallel.tensor import bytes_per_step
    from cuboid.parallel.tensor.grid import split_input
    from cuboid.zoo.common import sharded_parameters

    key = f"{name} {overrides}"
    ref = cuboid.load(name, seed=0, **overrides).train()
    spec = zoo.spec_of(ref)
    model = shard(copy.deepcopy(ref), spec, grid)
    refs = dict(ref.named_parameters())
    if meta_check:
        meta = zoo.materialize(shard(zoo.build(name, **overrides), spec, grid), "cpu", seed=0)
        out[key + " meta init"] = (max(rel(mod.full_tensor(local), refs[n]) for n, mod, local, _ in
                                       sharded_parameters(meta)), 0.0)
    batch = _batch(name, ref)
    local = {k: split_input(v, grid) for k, v in batch.items()}
    out_ref = ref(**batch)
    with comm.count() as tally:  # a training step: the logits are not gathered until read
        out_tp = model(**local)  # the zoo forward itself, on batch-split inputs
        out_tp.loss.backward()
    logits, loss = out_tp.logits, out_tp.loss  # the models route heads through the layers: whole batch
    out_ref.loss.backward()
    if name.startswith("gpt"):
        plan = Plan(tp=grid.d * grid.q ** 2, tp_mode="2.5d" if grid.d > 1 else "2d", depth=grid.d)
        expect = bytes_per_step(ref.config, plan, *batch["input_ids"].shape)
        out[key + " step bytes == bytes_per_step"] = (abs(tally.total - expect) / expect, 1e-12)
    out[key + " loss"] = (rel(loss, out_ref.loss), TOL)
    out[key + " logits"] = (rel(logits, out_ref.logits), TOL)
    out[key + " hidden (local block)"] = (rel(out_tp.last_hidden_state, Local(grid)(out_ref.last_hidden_state)), TOL)
    out[key + " grads"] = (max(rel(mod.full_tensor_like(local, p.grad), refs[n].grad)
                               for n, mod, local, p in sharded_parameters(model)), TOL)
    params = list(model.parameters())
    n_ref = clip_grad_norm_(list(ref.parameters()), 0.5)
    n_tp = clip_grad_norm_(params, 0.5)
    out[key + " grad norm"] = (rel(n_tp, n_ref), TOL)
    if name.startswith("gpt"):  # under bf16 autocast the matmul operands are gathered in bf16
        with comm.count() as tally, torch.autocast("cpu", dtype=torch.bfloat16):
            model(**local).loss.float().backward()
        expect = bytes_per_step(ref.config, plan, *batch["input_ids"].shape, autocast=torch.bfloat16)
        out[key + " bf16 step bytes == bytes_per_step"] = (abs(tally.total - expect) / expect, 1e-12)


def tp2d_worker():
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.tensor import d2
    from cuboid.parallel.tensor.grid import Grid

    grid = Grid.from_mesh(Mesh.build(Plan(tp=4, tp_mode="2d")))
    torch.manual_seed(0)  # same full layers and inputs on every rank
    out = {"grid": (abs(grid.q - 2) + abs(grid.d - 1), 0.0)}
    _linear_checks(d2.CLASSES, grid, out, [(1, True, False), (3, True, False), (1, False, False), (1, True, True)])
    _norm_checks(d2.CLASSES, grid, out)
    _vocab_checks(d2.CLASSES, grid, out, (10, 5, 8))
    _small_checks(d2.CLASSES, grid, out)
    from cuboid.parallel import layers as L

    full = L.Linear(8, 24)  # a grid given only its row and column groups gathers full tensors over each
    bare = d2.Linear2D.from_full(full, Grid(grid.row, grid.col), packed=3)
    out["grid without plane: full_tensor"] = (rel(bare.full_tensor("weight"), full.weight), 0.0)
    _zoo_checks("gpt-debug", d2.shard_2d, grid, out, vocab_size=510)  # vocab pads to 512
    _zoo_checks("bert-debug", d2.shard_2d, grid, out, vocab_size=510)  # MLM head, tied, with its bias
    _zoo_checks("bert-debug", d2.shard_2d, grid, out, head="cls", num_labels=3)  # pooler + classifier
    _zoo_checks("vit-debug", d2.shard_2d, grid, out)  # patch projection, CLS token, positions
    return out


def tp2p5d_worker():
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel.tensor import d2p5
    from cuboid.parallel.tensor.grid import Grid

    grid = Grid.from_mesh(Mesh.build(Plan(tp=8, tp_mode="2.5d", depth=2)))
    torch.manual_seed(0)
    out = {"grid": (abs(grid.q - 2) + abs(grid.d - 2), 0.0)}
    _linear_checks(d2p5.CLASSES, grid, out, [(3, True, False)])
    _norm_checks(d2p5.CLASSES, grid, out)
    _vocab_checks(d2p5.CLASSES, grid, out, (10,))
    _small_checks(d2p5.CLASSES, grid, out)
    _zoo_checks("gpt-debug", d2p5.shard_2p5d, grid, out, meta_check=False, vocab_size=510)
    return out


def _check(reports, at_least):
    for rank, report in enumerate(reports):
        bad = {k: v for k, (v, tol) in report.items() if not v <= tol}
        assert not bad, (rank, bad)
    assert len(reports[0]) >= at_least, len(reports[0])


def test_tensor_2d_matches_single_device():
    _check(run_world(tp2d_worker, 4, timeout=240), 80)


def test_tensor_2p5d_matches_single_device():
    _check(run_world(tp2p5d_worker, 8, timeout=240), 40)


def test_layouts_without_processes():
    """Shapes, slices and errors need no process group (a layout-only mesh)."""
    import pytest
    from cuboid.parallel import Mesh, Plan, ShardingSpec, layers as L
    from cuboid.parallel.tensor import d2, d2p5
    from cuboid.parallel.tensor.grid import Grid

    grid = Grid.from_mesh(Mesh.layout(Plan(tp=4, tp_mode="2d"), rank=1))  # (i 0, j 1)
    qkv = d2.Linear2D(8, 24, grid=grid, packed=3, device="meta")
    assert tuple(qkv.weight.shape) == (12, 4) and tuple(qkv.bias.shape) == (6,)
    assert qkv.shard_slices("weight") == [(slice(4, 8), slice(0, 4)), (slice(12, 16), slice(0, 4)),
                                          (slice(20, 24), slice(0, 4))]
    assert qkv.shard_slices("bias") == [(slice(4, 6),), (slice(12, 14),), (slice(20, 22),)]
    ve = d2.VocabEmbedding2D(5, 8, grid=grid, device="meta")  # Vp = 8: block j=1 holds rows 4..8, real 4..5
    assert (ve.vocab_start, ve.vocab_end, tuple(ve.weight.shape)) == (4, 5, (4, 4))
    full = torch.arange(40.0).reshape(5, 8)
    part = ve.local_part("weight", full)
    assert torch.equal(part[0], full[4, :4]) and not part[1:].any()
    with pytest.raises(ValueError, match="does not split"):
        d2.LayerNorm2D(6, grid=grid)
    with pytest.raises(ValueError, match="2.5D"):
        d2.Linear2D(8, 8, grid=Grid(q=2, d=2, i=0, j=0, k=1))
    deep = Grid.from_mesh(Mesh.layout(Plan(tp=8, tp_mode="2.5d", depth=2), rank=6))  # (k 1, i 1, j 0)
    assert (deep.k, deep.i, deep.j, deep.batch_index) == (1, 1, 0, 3)
    assert tuple(d2p5.Linear2p5D(8, 8, grid=deep, device="meta").weight.shape) == (4, 4)
    with pytest.raises(TypeError, match="role 'norm'"):
        d2.shard_2d(torch.nn.ModuleDict({"x": L.Linear(4, 4)}), ShardingSpec(roles={"x": "norm"}), grid)
