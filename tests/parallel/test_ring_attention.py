"""Sequence parallelism (parallel/sequence.py): ring and all-to-all attention match the unsharded kernel.

One gloo world per size (2 and 4 ranks); one worker runs every check and
returns {check: (error, tolerance)}. Each case draws the whole sequence on
every rank (same seed), runs ``cuboid.kernels.attention`` on it in float64 as
the reference, and the sharded op in fp32 on this rank's shard; outputs and
q/k/v gradients are gathered back to global order (``zigzag_merge`` for the
zigzag layout). Tolerance: 1e-5 relative to the reference's largest entry.
Bytes are exact: the formulas of the module docstring.
"""
import pytest
import torch

from .launch import run_world

TOL = 1e-5
B, H, T, D = 2, 4, 48, 16  # T divides by 2 sp for sp = 2 and 4


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _mask(kind, sp, B=B, T=T):
    """None; "pad": padded tails of two lengths; "chunk": row 0 loses zigzag chunk 1, row 1 chunk 0
    (so with causal, row 1's first queries see no key at all: out = 0, lse = -inf)."""
    if kind is None:
        return None
    m = torch.ones(B, T, dtype=torch.bool)
    c = T // (2 * sp)
    if kind == "pad":
        m[0, T - 5:] = False
        m[-1, T - 2 * c - 3:] = False
    else:
        m[0, c:2 * c] = False
        m[-1, :c] = False
    return m


def _case(seed, causal, kind, sp, shard, gather, op, shape=(B, H, T, D), hkv=None, docs=None, docs_arg=None):
    """(out, dq, dk, dv) errors of ``op`` on fp32 shards against the float64 whole-sequence kernel.

    ``hkv``: K/V heads (grouped-query attention; default: as many as q's heads).
    ``docs``: packed rows, the whole (B, T) document ids (the reference takes them); ``docs_arg``: what
    ``op`` gets as doc_ids (default: ``docs``).
    """
    from cuboid.kernels import attention

    g = torch.Generator().manual_seed(seed)
    kv_shape = shape if hkv is None else (shape[0], hkv, *shape[2:])
    full = [torch.randn(*sh, generator=g, dtype=torch.float64) for sh in (shape, kv_shape, kv_shape, shape)]
    mask = _mask(kind, sp, shape[0], shape[2])
    ref = [t.clone().requires_grad_() for t in full[:3]]
    out = attention(*ref, causal=causal, key_padding_mask=mask, doc_ids=docs, backend="torch")
    out.backward(full[3])
    loc = [shard(t, 2).float().requires_grad_() for t in full[:3]]
    extra = {} if docs is None else {"doc_ids": docs if docs_arg is None else docs_arg}
    got = op(*loc, causal=causal, key_padding_mask=None if mask is None else shard(mask, 1), **extra)
    got.backward(shard(full[3], 2).float())
    errs = [rel(gather(got.detach()), out)]
    errs += [rel(gather(t.grad), r.grad) for t, r in zip(loc, ref)]
    return errs


def _record(out, key, errs, tol=TOL):
    for name, e in zip(("out", "dq", "dk", "dv"), errs):
        out[f"{key} {name}"] = (e, tol)


def sp_worker():
    import torch.distributed as dist

    from cuboid.kernels import interpreter_active, use_backend
    from cuboid.parallel import comm
    from cuboid.parallel.sequence import (all_to_all_attention, ring_attention, zigzag_merge, zigzag_positions,
                                          zigzag_split)

    if not dist.is_initialized():  # (a warm world's group may be started: tests/parallel/launch.py)
        dist.init_process_group("gloo")
    p, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(p)))
    comm.name_group(group, "sp")
    out = {}

    def zz_shard(t, dim):
        return zigzag_split(t, p, r, dim)

    def zz_gather(t):
        return zigzag_merge(comm.all_gather_list(t.contiguous(), group), p, dim=2)

    def ct_shard(t, dim):
        return t.chunk(p, dim=dim)[r].contiguous()

    def ct_gather(t):
        return torch.cat(comm.all_gather_list(t.contiguous(), group), dim=2)

    def ring(*a, **kw):
        return ring_attention(*a, group, **kw)

    def a2a(layout):
        return lambda *a, **kw: all_to_all_attention(*a, group, layout=layout, **kw)

    seed = 0
    for causal in (False, True):
        for kind in (None, "pad", "chunk"):
            seed += 1
            key = f"sp{p} causal={causal} mask={kind}"
            _record(out, "ring " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, ring))
            _record(out, "a2a contiguous " + key, _case(seed, causal, kind, p, ct_shard, ct_gather, a2a("contiguous")))
            _record(out, "a2a zigzag " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, a2a("zigzag")))

    # grouped-query attention: (H, Hkv) = (8, 4) on every path; multi-query (4, 1) on the ring, and
    # all-to-all refuses K/V heads that do not divide over sp (1 % sp != 0)
    for causal, kind, (h, hkv) in ((True, "pad", (8, 4)), (False, "chunk", (8, 4)), (True, "chunk", (4, 1))):
        seed += 1
        key = f"sp{p} gqa {h}/{hkv} causal={causal} mask={kind}"
        shape = (B, h, T, D)
        _record(out, "ring " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, ring, shape, hkv))
        if hkv % p == 0:
            _record(out, "a2a contiguous " + key,
                    _case(seed, causal, kind, p, ct_shard, ct_gather, a2a("contiguous"), shape, hkv))
            _record(out, "a2a zigzag " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, a2a("zigzag"), shape, hkv))

    # attention sinks (gpt-oss) with v's own head dim (latent attention), grouped heads, rows without any key
    for how, shard, gather, op in (("ring", zz_shard, zz_gather, ring),
                                   ("a2a contiguous", ct_shard, ct_gather, a2a("contiguous"))):
        seed += 1
        _record_sinks(out, f"{how} sp{p} sinks gqa 8/4 dv8 causal mask=chunk",
                      _sinks_case(seed, True, "chunk", p, shard, gather, op, group))

    if p == 2 and interpreter_active():  # the Triton path (forward kernel + _flash_bwd per block), interpreted
        with use_backend("triton"):
            _record_sinks(out, "ring triton sinks dv8 causal mask=pad",
                          _sinks_case(97, True, "pad", p, zz_shard, zz_gather, ring, group, shape=(1, 2, 16, 16),
                                      hkv=1, dv=16 + 8))
            errs = _case(99, True, "chunk", p, zz_shard, zz_gather, ring, shape=(2, 1, 16, 16))
            _record(out, "ring triton causal mask=chunk", errs)
            errs = _case(98, True, "pad", p, zz_shard, zz_gather, ring, shape=(1, 2, 16, 16), hkv=1)
            _record(out, "ring triton mqa causal mask=pad", errs)

    pos = zigzag_positions(T, p, r)
    out["positions == zigzag_split(arange)"] = (float((pos != zz_shard(torch.arange(T), 0)).sum()), 0.0)

    # heads not divisible by sp: one sentence
    x = torch.randn(B, 3, T // p, D)
    try:
        all_to_all_attention(x, x, x, group, causal=True)
        msg = ""
    except ValueError as e:
        msg = str(e)
    want = f"all_to_all_attention needs heads (3) divisible by sp ({p})."
    out["a2a heads % sp error"] = (0.0 if msg == want else 1.0, 0.0)
    try:
        all_to_all_attention(torch.randn(B, 4, T // p, D), x[:, :1], x[:, :1], group, causal=True)
        msg = ""
    except ValueError as e:
        msg = str(e)
    want = (f"all_to_all_attention needs the K/V heads (1) divisible by sp ({p}); "
            f"ring attention (sp_mode='ring') takes any number of K/V heads.")
    out["a2a kv heads % sp error"] = (0.0 if msg == want else 1.0, 0.0)

    # bytes: ring forward + backward, with and without a mask (the module docstring's formula)
    S = T // p
    n, e, a, m = B * H * S * D, 4, 4, B * S
    for kind in (None, "pad"):
        q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
        mask = None if kind is None else zz_shard(_mask(kind, p), 1)
        mb = 0 if mask is None else m
        with comm.count() as tally:
            ring_attention(q, k, v, group, causal=True, key_padding_mask=mask).sum().backward()
        fwd, bwd = (p - 1) * (2 * n * e + mb), (p - 1) * 2 * n * e + p * 2 * n * a
        out[f"ring bytes mask={kind}"] = (abs(tally.bytes("send", "sp") - (fwd + bwd)) + abs(tally.total - (fwd + bwd)),
                                          0.0)
        calls = (p - 1) * (2 + (mask is not None)) + (p - 1) * 2 + p * 2
        out[f"ring send calls mask={kind}"] = (abs(tally.calls("send", "sp") - calls), 0.0)
        for t in (q, k, v):
            t.grad = None
        with comm.count() as tally:
            all_to_all_attention(q, k, v, group, causal=True, key_padding_mask=mask).sum().backward()
        want = {"all_to_all": 8 * (p - 1) / p * n * e, "all_gather": (p - 1) * mb}
        out[f"a2a bytes mask={kind}"] = (sum(abs(tally.bytes(o, "sp") - w) for o, w in want.items())
                                         + abs(tally.total - sum(want.values())), 0.0)

    # GQA bytes: only the K/V heads travel the ring; all-to-all moves q, out and the K/V heads
    for h, hkv, how in ((4, 1, "ring"), (8, 4, "a2a")):
        q = torch.randn(B, h, S, D, requires_grad=True)
        k, v = (torch.randn(B, hkv, S, D, requires_grad=True) for _ in range(2))
        n, n_kv = B * h * S * D, B * hkv * S * D
        with comm.count() as tally:
            if how == "ring":
                ring_attention(q, k, v, group, causal=True).sum().backward()
                want = (p - 1) * 2 * n_kv * e + (p - 1) * 2 * n_kv * e + p * 2 * n_kv * a
                got = tally.bytes("send", "sp")
            else:
                all_to_all_attention(q, k, v, group, causal=True).sum().backward()
                want = 4 * (p - 1) / p * (n + n_kv) * e
                got = tally.bytes("all_to_all", "sp")
        out[f"{how} gqa bytes {h}/{hkv}"] = (abs(got - want) + abs(tally.total - want), 0.0)
    return out


def _sinks_case(seed, causal, kind, sp, shard, gather, op, group, shape=(B, 8, T, D), hkv=4, dv=8):
    """(out, dq, dk, dv, dsinks) errors of ``op`` with sinks and v's head dim ``dv`` on fp32 shards against the
    float64 whole-sequence attention; each rank's sinks gradient (its rows' or its heads' share) summed over
    the group."""
    from cuboid.kernels import attention
    from cuboid.parallel import comm

    g = torch.Generator().manual_seed(seed)
    kv_shape = (shape[0], hkv, *shape[2:])
    full = [torch.randn(*sh, generator=g, dtype=torch.float64)
            for sh in (shape, kv_shape, (*kv_shape[:3], dv), (*shape[:3], dv))]
    sinks = torch.randn(shape[1], generator=g, dtype=torch.float64) * 2
    mask = _mask(kind, sp, shape[0], shape[2])
    ref = [t.clone().requires_grad_() for t in full[:3] + [sinks]]
    out = attention(*ref[:3], causal=causal, key_padding_mask=mask, sinks=ref[3], backend="torch")
    out.backward(full[3])
    loc = [shard(t, 2).float().requires_grad_() for t in full[:3]] + [sinks.float().requires_grad_()]
    got = op(*loc[:3], causal=causal, key_padding_mask=None if mask is None else shard(mask, 1), sinks=loc[3])
    got.backward(shard(full[3], 2).float())
    errs = [rel(gather(got.detach()), out)] + [rel(gather(t.grad), r.grad) for t, r in zip(loc[:3], ref[:3])]
    return errs + [rel(sum(comm.all_gather_list(loc[3].grad, group)), ref[3].grad)]


def _record_sinks(out, key, errs):
    _record(out, key, errs[:4])
    out[f"{key} dsinks"] = (errs[4], TOL)


def _doc_ids(rows):
    """(len(rows), sum of a row's lengths) document ids of packed rows given each row's document lengths."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])


def _layouts(sp, T=T):
    """Packed rows of two rows each: boundaries inside chunks, on chunk edges, a document spanning several
    chunks (and a row of one document), documents of length 1."""
    c = T // (2 * sp)
    return {"inside": _doc_ids([[5, 17, 9, 1, 16], [1, 30, 17]]),
            "edges": _doc_ids([[c] * (2 * sp), [2 * c, c, T - 3 * c]]),
            "spanning": _doc_ids([[3, 40, 5], [48]]),
            "ones": _doc_ids([[1, 1, 1, 20, 1, 1, 23], [2, 1, 1, 1, 43]])}


def _counting(module, name, counter):
    """Wrap ``module.name`` so that each call adds one to ``counter[name]``; returns the original."""
    plain = getattr(module, name)

    def counted(*a, **kw):
        counter[name] = counter.get(name, 0) + 1
        return plain(*a, **kw)

    setattr(module, name, counted)
    return plain


class _World:
    """The sp world of a worker: its group, and the shard/gather functions of the zigzag and contiguous
    layouts."""

    def __init__(self):
        import torch.distributed as dist

        from cuboid.parallel import comm

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.p, self.r = dist.get_world_size(), dist.get_rank()
        self.group = dist.new_group(list(range(self.p)))
        comm.name_group(self.group, "sp")

    def zz_shard(self, t, dim):
        from cuboid.parallel.sequence import zigzag_split

        return zigzag_split(t, self.p, self.r, dim)

    def zz_gather(self, t):
        from cuboid.parallel import comm
        from cuboid.parallel.sequence import zigzag_merge

        return zigzag_merge(comm.all_gather_list(t.contiguous(), self.group), self.p, dim=2)

    def ct_shard(self, t, dim):
        return t.chunk(self.p, dim=dim)[self.r].contiguous()

    def ct_gather(self, t):
        from cuboid.parallel import comm

        return torch.cat(comm.all_gather_list(t.contiguous(), self.group), dim=2)


def packed_worker():
    """Packed rows (document ids) under ring and all-to-all attention: {check: (error, tolerance)}."""
    world = _World()
    out = _packed_parity(world)
    out.update(_packed_skips(world))
    return out


def _packed_parity(w):
    """Ring and all-to-all with document ids against the one-device kernel with them."""
    from cuboid.kernels import interpreter_active, use_backend
    from cuboid.parallel.sequence import ZigzagDocs, all_to_all_attention, ring_attention

    p, group, out = w.p, w.group, {}
    zz_shard, zz_gather, ct_shard, ct_gather = w.zz_shard, w.zz_gather, w.ct_shard, w.ct_gather

    def ring(*a, **kw):
        return ring_attention(*a, group, **kw)

    def a2a(layout):
        return lambda *a, **kw: all_to_all_attention(*a, group, layout=layout, **kw)

    seed = 100
    for name, docs in _layouts(p).items():
        for causal in (False, True):
            seed += 1
            key = f"sp{p} docs={name} causal={causal}"
            _record(out, "ring " + key, _case(seed, causal, None, p, zz_shard, zz_gather, ring, docs=docs))
            _record(out, "a2a contiguous " + key,
                    _case(seed, causal, None, p, ct_shard, ct_gather, a2a("contiguous"), docs=docs))
            _record(out, "a2a zigzag " + key, _case(seed, causal, None, p, zz_shard, zz_gather, a2a("zigzag"), docs=docs))
    layouts = _layouts(p)
    for name, causal, kind, (h, hkv) in (("inside", True, "pad", (8, 4)), ("ones", False, "chunk", (8, 4)),
                                         ("edges", True, "chunk", (4, 1)), ("spanning", True, None, (4, 1))):
        seed += 1
        key = f"sp{p} docs={name} gqa {h}/{hkv} causal={causal} mask={kind}"
        docs, shape = layouts[name], (B, h, T, D)
        _record(out, "ring " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, ring, shape, hkv, docs))
        _record(out, "ring ZigzagDocs " + key, _case(seed, causal, kind, p, zz_shard, zz_gather, ring, shape, hkv, docs,
                                                     ZigzagDocs(docs, p)))
        if hkv % p == 0:
            _record(out, "a2a zigzag " + key,
                    _case(seed, causal, kind, p, zz_shard, zz_gather, a2a("zigzag"), shape, hkv, docs))

    if p == 2 and interpreter_active():  # the Triton kernels with document ids, forward and per-block backward
        with use_backend("triton"):
            docs = _doc_ids([[3, 6, 7], [8, 1, 7]])
            errs = _case(97, True, None, p, zz_shard, zz_gather, ring, shape=(2, 2, 16, 16), hkv=1, docs=docs)
            _record(out, "ring triton mqa causal docs", errs)
            errs = _case(96, False, "pad", p, zz_shard, zz_gather, ring, shape=(2, 1, 16, 16), docs=docs)
            _record(out, "ring triton docs mask=pad", errs)

    return out


def _packed_skips(w):
    """Chunk pairs without a common document are never computed; the ids never travel; a shard's ids are
    refused."""
    import cuboid.kernels as kernels
    from cuboid.kernels import attention
    from cuboid.parallel import comm
    from cuboid.parallel import sequence as seq
    from cuboid.parallel.sequence import ring_attention

    p, group, out = w.p, w.group, {}
    zz_shard, zz_gather, layouts = w.zz_shard, w.zz_gather, _layouts(w.p)
    # skipped chunk pairs: kernel calls counted, forward and backward (one document per chunk: only the
    # diagonal pairs of step 0; one document: every step, as without documents)
    c = T // (2 * p)
    q, k, v = (torch.randn(1, H, T // p, D, requires_grad=True) for _ in range(3))
    for name, docs, causal, want in (("per chunk", _doc_ids([[c] * (2 * p)]), True, 2),
                                     ("per chunk", _doc_ids([[c] * (2 * p)]), False, 2),
                                     ("two chunks", _doc_ids([[2 * c] * p]), False, 4),
                                     ("one", _doc_ids([[T]]), True, p), ("none", None, True, p)):
        counter = {}
        plain = (_counting(kernels, "attention", counter), _counting(seq, "_block_bwd_torch", counter))
        try:
            ring_attention(q, k, v, group, causal=causal, doc_ids=docs).sum().backward()
        finally:
            kernels.attention, seq._block_bwd_torch = plain
        got = (counter.get("attention", 0), counter.get("_block_bwd_torch", 0))
        out[f"ring calls docs={name} causal={causal}"] = (float(got != (want, want)), 0.0)

    # NaN in the keys and values of document 0: rows of the other documents never meet them (their chunk
    # pairs are skipped, forward and backward), so they stay finite and exact
    docs = _doc_ids([[T // 4, T // 4, T // 2]] * B)
    other = (docs[0] != 0)
    for causal in (False, True):
        g = torch.Generator().manual_seed(7)
        full = [torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4)]
        ref = [t.clone().requires_grad_() for t in full[:3]]
        want = attention(*ref, causal=causal, doc_ids=docs, backend="torch")
        want.backward(full[3])
        poisoned = [t.clone() for t in full[:3]]
        for t in poisoned[1:]:
            t[:, :, :T // 4] = float("nan")
        loc = [zz_shard(t, 2).float().requires_grad_() for t in poisoned]
        got = ring_attention(*loc, group, causal=causal, doc_ids=docs)
        got.backward(zz_shard(full[3], 2).float())
        pairs = [(zz_gather(got.detach()), want)] + [(zz_gather(t.grad), s.grad) for t, s in zip(loc, ref)]
        for what, (a, b) in zip(("out", "dq", "dk", "dv"), pairs):
            a, b = a[:, :, other], b[:, :, other]
            err = rel(a, b) if bool(torch.isfinite(a).all()) else float("inf")
            out[f"ring NaN in document 0 causal={causal} {what}"] = (err, TOL)

    # the ids never travel: the bytes are those without documents
    S = T // p
    n, e, a = B * H * S * D, 4, 4
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    with comm.count() as tally:
        ring_attention(q, k, v, group, causal=True, doc_ids=layouts["inside"]).sum().backward()
    want = (p - 1) * 2 * n * e + (p - 1) * 2 * n * e + p * 2 * n * a
    out["ring bytes with documents"] = (abs(tally.total - want), 0.0)

    # doc ids are the whole rows': a shard's are refused with a sentence
    try:
        ring_attention(q, k, v, group, causal=True, doc_ids=zz_shard(layouts["inside"], 1))
        msg = ""
    except ValueError as err:
        msg = str(err)
    want = f"ring_attention: doc_ids are the whole rows' document ids in sequence order, (batch, seq) = {(B, T)}, got {(B, S)}"
    out["doc ids shape error"] = (0.0 if msg == want else 1.0, 0.0)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_packed_rows_under_sequence_parallel_attention(world):
    """Document ids under ring and all-to-all attention match the one-device kernel with them, forward
    and backward; chunk pairs without a common document are never computed."""
    from cuboid.kernels import interpreter_active

    reports = run_world(packed_worker, world, timeout=300)
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not v[0] <= v[1]}
        assert not bad, (rank, bad)
    assert len(reports[0]) >= 4 * 2 * 3 * 4 + 5 + 8
    if world == 2 and interpreter_active():  # the Triton kernels' cases ran
        assert sum("triton" in k for k in reports[0]) == 8


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_attention_matches_single_device(world):
    reports = run_world(sp_worker, world, timeout=180)
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not v[0] <= v[1]}
        assert not bad, (rank, bad)
    assert len(reports[0]) >= 3 * 6 * 4 + 7
    assert sum(" sinks " in k for k in reports[0]) >= 2 * 5  # ring and all-to-all: out, dq, dk, dv, dsinks


def test_one_rank_is_plain_attention():
    from cuboid.kernels import attention, use_backend
    from cuboid.parallel.sequence import all_to_all_attention, ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    mask = _mask("chunk", 1)
    with use_backend("torch"):
        want = attention(q, k, v, causal=True, key_padding_mask=mask)
        for fn in (ring_attention, all_to_all_attention):
            assert torch.equal(fn(q, k, v, None, causal=True, key_padding_mask=mask), want)
        docs = torch.tensor([[0] * 20 + [1] * 28, [0] * 47 + [1]])
        want = attention(q, k, v, causal=True, key_padding_mask=mask, doc_ids=docs)
        for fn in (ring_attention, all_to_all_attention):
            assert torch.equal(fn(q, k, v, None, causal=True, key_padding_mask=mask, doc_ids=docs), want)


def test_zigzag_layout_roundtrip():
    from cuboid.parallel.sequence import zigzag_merge, zigzag_positions, zigzag_split

    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    for sp in (1, 2, 4):
        shards = [zigzag_split(x, sp, r, 1) for r in range(sp)]
        assert torch.equal(zigzag_merge(shards, sp, 1), x)
        c = 16 // (2 * sp)
        assert zigzag_positions(16, sp, 0).tolist() == list(range(c)) + list(range(16 - c, 16))
    with pytest.raises(ValueError, match="2\\*sp = 8 equal chunks"):
        zigzag_split(x, 4, 0, 2)


def test_causal_work_balance_table():
    """The numbers in the module docstring's table."""
    from cuboid.parallel.sequence import causal_work

    total = 4096 * 4097 // 2
    want = {(2, "contiguous"): [2098176, 6292480], (2, "zigzag"): [4195328] * 2,
            (4, "contiguous"): [524800, 1573376, 2621952, 3670528], (4, "zigzag"): [2097664] * 4}
    crit = {(2, "contiguous"): 6292480, (2, "zigzag"): 4195328, (4, "contiguous"): 3670528, (4, "zigzag"): 2097664}
    for (sp, layout), per_rank in want.items():
        w = causal_work(4096, sp, layout)
        assert [sum(row) for row in w] == per_rank and sum(per_rank) == total
        assert sum(max(w[r][t] for r in range(sp)) for t in range(sp)) == crit[sp, layout]
