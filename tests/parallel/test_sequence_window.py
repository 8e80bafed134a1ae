"""Sliding-window attention under sequence parallelism: ring and all-to-all attention with ``window`` match the
one-device kernel, with and without packed rows, and a windowed zoo model under ``sp2`` / ``sp2-a2a`` gives the
one-device logits and loss.

One 2-rank gloo world runs every check and returns {check: (error, tolerance)}. T = 48 cuts into 4 zigzag
chunks of c = 12: the windows (1, 12, 13, 30) leave chunk pairs wholly outside the band (skipped),
partly inside and wholly inside (called without a window). The op reference is ``cuboid.kernels.attention``
in float64 on the whole sequence (its window checked against a float64 softmax in tests/kernels).
"""
import pytest
import torch

from .launch import run_world
from .test_ring_attention import TOL, _doc_ids, _mask, _record, _World

T = 48
WINDOWS = (1, 12, 13, 30)


def err(a, b):
    """max |a - b| relative to the reference's largest entry, or absolute where that is below 1 (window 1: a
    query sees itself alone, so dq and dk are zero up to rounding)."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _case(seed, causal, kind, w, shard, gather, op, window, shape, hkv=None, docs=None):
    """(out, dq, dk, dv) errors of ``op`` on fp32 shards against the float64 whole-sequence kernel."""
    from cuboid.kernels import attention

    g = torch.Generator().manual_seed(seed)
    kv_shape = shape if hkv is None else (shape[0], hkv, *shape[2:])
    full = [torch.randn(*sh, generator=g, dtype=torch.float64) for sh in (shape, kv_shape, kv_shape, shape)]
    mask = _mask(kind, w.p, shape[0], shape[2])
    ref = [t.clone().requires_grad_() for t in full[:3]]
    out = attention(*ref, causal=causal, key_padding_mask=mask, doc_ids=docs, window=window, backend="torch")
    out.backward(full[3])
    loc = [shard(t, 2).float().requires_grad_() for t in full[:3]]
    extra = {} if docs is None else {"doc_ids": docs}
    got = op(*loc, causal=causal, key_padding_mask=None if mask is None else shard(mask, 1), window=window, **extra)
    got.backward(shard(full[3], 2).float())
    return [err(gather(got.detach()), out)] + [err(gather(t.grad), r.grad) for t, r in zip(loc, ref)]


def _op_parity(w):
    """Ring and all-to-all (both layouts) with a window against the one-device kernel."""
    from cuboid.kernels import interpreter_active, use_backend
    from cuboid.parallel.sequence import all_to_all_attention, ring_attention

    group, out = w.group, {}

    def ring(*a, **kw):
        return ring_attention(*a, group, **kw)

    def a2a(layout):
        return lambda *a, **kw: all_to_all_attention(*a, group, layout=layout, **kw)

    packed = _doc_ids([[5, 17, 9, 1, 16], [30, 18]])  # documents shorter and longer than the windows
    seed = 300
    for window in WINDOWS:
        for docs, kind in ((None, "pad"), (packed, None)):
            seed += 1
            key = f"window={window} {'packed' if docs is not None else 'mask=pad'}"
            args = (seed, True, kind, w)
            _record(out, "ring " + key, _case(*args, w.zz_shard, w.zz_gather, ring, window, (2, 4, T, 16), 2, docs))
            if window in (1, 30):  # all-to-all hands the window to the kernel on the whole sequence
                _record(out, "a2a zigzag " + key,
                        _case(*args, w.zz_shard, w.zz_gather, a2a("zigzag"), window, (2, 4, T, 16), 2, docs))
    _record(out, "a2a contiguous window=13 packed",
            _case(seed + 1, True, None, w, w.ct_shard, w.ct_gather, a2a("contiguous"), 13, (2, 4, T, 16), 2, packed))
    # multi-query on the ring (all-to-all needs K/V heads divisible by sp), and the window's left bound alone
    _record(out, "ring mqa window=13 mask=chunk", _case(1, True, "chunk", w, w.zz_shard, w.zz_gather, ring, 13,
                                                        (2, 4, T, 16), 1))
    _record(out, "ring non-causal window=13", _case(2, False, None, w, w.zz_shard, w.zz_gather, ring, 13,
                                                    (2, 4, T, 16), 2, packed))
    if interpreter_active():  # the Triton kernels' window_shift, forward and per-block backward, interpreted
        with use_backend("triton"):
            docs = _doc_ids([[3, 6, 7], [8, 1, 7]])
            _record(out, "ring triton window=5 packed",
                    _case(3, True, None, w, w.zz_shard, w.zz_gather, ring, 5, (2, 2, 16, 16), 1, docs))
            _record(out, "ring triton window=6 mask=pad",
                    _case(4, True, "pad", w, w.zz_shard, w.zz_gather, ring, 6, (2, 2, 16, 16), 1))
    return out


def _ring_skips(w):
    """Chunk pairs wholly left of the window get no kernel call: window 1 leaves the diagonal's two chunks
    (one call each, on the first ring step); a window of the whole sequence keeps the grouped calls."""
    import cuboid.kernels as kernels
    from cuboid.parallel.sequence import ring_attention

    out = {}
    calls = []
    plain = kernels.attention

    def counted(*a, **kw):
        calls.append(kw.get("window"))
        return plain(*a, **kw)

    x = torch.randn(1, 2, T // w.p, 16)
    kernels.attention = counted
    try:
        for window, want in ((1, [1, 1]), (T, [None] * w.p)):
            calls.clear()
            ring_attention(x, x, x, w.group, causal=True, window=window)
            out[f"ring kernel calls window={window}"] = (float(calls != want), 0.0)
    finally:
        kernels.attention = plain
    return out


def _model_parity():
    """llama-debug with a window on its first block's attention core: sp2 (ring) and sp2-a2a against one
    device, packed rows and a padded batch; the swapped cores carry their layer's window."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Plan, prepare
    from cuboid.parallel.layers import Attention

    from .test_sequence_packed import packed_batch

    def windowed(window):  # the first block's core windowed, the second's global (Gemma 3's mix of layers)
        model = cuboid.load("llama-debug", None, seed=0).eval()
        cores = [m for m in model.modules() if isinstance(m, Attention)]
        cores[0].window = window
        return model

    out = {}
    ref = windowed(3)
    vocab = ref.config.vocab_size
    plain = cuboid.load("llama-debug", None, seed=0).eval()
    ids = torch.randint(0, vocab, (2, 15), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, 11:] = 0
    batches = {"packed": packed_batch(vocab), "padded": {"input_ids": ids, "attention_mask": mask, "labels": ids}}
    for name, batch in batches.items():
        want = ref(**batch)
        changed = (want.logits - plain(**batch).logits).abs().max().item()
        out[f"{name}: the window changes the one-device logits"] = (float(changed < 1e-3), 0.0)
        for plan, mode in (("sp2", "ring"), ("sp2-a2a", "all_to_all")):
            model = windowed(3)
            model = prepare(model, Plan(sp=2, sp_mode=mode), spec=zoo.spec_of(model))
            windows = [m.window for m in model.modules() if type(m).__name__ == "SequenceAttention"]
            out[f"{plan} cores carry the window"] = (float(windows != [3, None]), 0.0)
            got = model(**batch)
            keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
            scale = want.logits[keep].abs().max().item()
            out[f"{plan}/{name} logits"] = ((got.logits - want.logits)[keep].abs().max().item() / scale, TOL)
            out[f"{plan}/{name} loss"] = (abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()), TOL)
    return out


def window_worker():
    world = _World()
    out = _op_parity(world)
    out.update(_ring_skips(world))
    out.update(_model_parity())
    return out


def test_sliding_window_under_sequence_parallelism_matches_one_device():
    reports = run_world(window_worker, 2, timeout=600)
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not v[0] <= v[1]}
        assert not bad, (rank, bad)
    triton = sum(k.startswith("ring triton") for k in reports[0])  # 8 where the workers run the interpreter
    assert triton in (0, 8)
    # op cases of 4 entries (ring, all-to-all, multi-query and non-causal), the two call counts, the model's
    assert len(reports[0]) - triton == 4 * (2 * len(WINDOWS) + 4 + 1 + 2) + 2 + 2 * (1 + 2 * 2) + 2


def test_cost_model_counts_windowed_layers_by_their_span():
    """The FLOP count's attention term: a windowed layer's causal pairs (counted here) in place of a global
    layer's, through Shape.window / window_layers; nothing changes where the window covers the sequence."""
    from cuboid.parallel.cost import Shape, step_flops

    base = dict(n_layers=6, dim=64, n_heads=4, hidden=128, vocab_size=0, n_positions=8192, tied_head=False)
    plain, local = Shape(**base), Shape(**base, window=512, window_layers=5)
    W, s = 512, 4096
    pairs = sum(min(i + 1, W) for i in range(s)) / (s * (s + 1) / 2)  # windowed / global causal pairs
    want = (1 + 5 * pairs) / 6 * s  # keys per query in the 4 B s^2 q convention, layers averaged
    assert local.attention_span(s) == pytest.approx(want, rel=2e-3)
    attention = 4 * s * plain.q_dim * 3 * 6  # forward + backward of the s^2 term over 6 layers, batch 1
    assert step_flops(plain, 1, s) - step_flops(local, 1, s) == pytest.approx(attention * (s - want), rel=2e-3)
    assert step_flops(local, 1, W) == step_flops(plain, 1, W)
