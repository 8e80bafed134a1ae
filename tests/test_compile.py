"""torch.compile over the zoo models and the kernels' custom ops, on CPU.

- Every family's forward (the MoE presets' with their auxiliary loss, the
  experts' matmul the op ``cuboid::grouped_mm``) traces as one Dynamo graph
  with no break (``torch._dynamo.explain``), and ``fullgraph=True`` compilation through
  AOTAutograd gives one forward and one backward graph, whose loss and
  gradients equal eager's (fp32, 1e-5), for plain, padded and packed batches.
- The Triton custom ops (each kernel file registers its own) pass ``torch.library.opcheck``
  (fake impl, schema, autograd registration) under the interpreter, and a
  function built from them compiles in one graph with eager's values.
- One inductor compile (a one-block Llama) checks the generated code's
  values; inductor on two CPU cores takes minutes per model, so the families
  run through ``aot_eager``-style counting backends, which trace the same
  graphs.
"""
from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import cuboid
import cuboid.kernels as kernels
# each kernel file registers its torch.ops.cuboid ops when imported
import cuboid.kernels.flash_attention  # noqa: F401
import cuboid.kernels.grouped_gemm  # noqa: F401
import cuboid.kernels.linear_cross_entropy  # noqa: F401
import cuboid.kernels.norm  # noqa: F401
import cuboid.kernels.rope  # noqa: F401
import cuboid.kernels.swiglu  # noqa: F401

FAMILIES = ["gpt-debug", "bert-debug", "vit-debug", "llama-debug", "qwen3-debug", "gemma3-debug"]
# the mixture-of-experts presets, with the router's auxiliary loss in the loss (so in the graph)
MOE = ["qwen3-moe-debug", "mixtral-debug", "olmoe-debug"]


def _load(name: str, **kwargs):
    return cuboid.load(name, **({"output_router_logits": True} if name in MOE else {}), **kwargs)


def _batch(model, name: str, variant: str = "plain", B: int = 2, T: int = 16) -> dict:
    g = torch.Generator().manual_seed(1)
    c = model.config
    if name.startswith("vit"):
        return {"pixel_values": torch.randn(B, 3, c.image_size, c.image_size, generator=g),
                "labels": torch.randint(0, 10, (B,), generator=g)}
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    if variant == "padded":
        keep = torch.ones(B, T, dtype=torch.long)
        keep[0, :5] = 0
        batch["attention_mask"] = keep
    elif variant == "packed":  # two documents a row
        batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(T - 6)]).unsqueeze(0).expand(B, -1)
    return batch


def _counting_backend():
    """An AOTAutograd backend that runs the traced graphs as they are and counts them."""
    counts = {"forward": 0, "backward": 0}
    ops: set = set()  # the cuboid custom ops the graphs call (cuboid.norm.default, ...)

    def compiler(kind):
        def run(gm, example_inputs):
            counts[kind] += 1
            for n in gm.graph.nodes:  # an op that writes in place is called through auto_functionalized
                target = n.args[0] if "auto_functionalized" in str(n.target) else n.target
                if str(target).startswith("cuboid."):
                    ops.add(str(target))
            return make_boxed_func(gm.forward)
        return run

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), counts, ops


def _loss_and_grads(model, fn, batch) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = fn(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(eager: tuple, compiled: tuple, tol: float = 1e-5) -> None:
    (l0, g0), (l1, g1) = eager, compiled
    assert torch.allclose(l1, l0, rtol=tol, atol=0), (l0.item(), l1.item())
    assert set(g1) == set(g0) and g0
    for name, g in g0.items():
        err = (g1[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert err < tol, f"{name}: relative gradient difference {err:.2e}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with kernels.use_backend("torch"):  # the CPU path users get (the tests' interpreter is on)
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", FAMILIES + MOE)
def test_one_graph_and_eager_values(name):
    torch.manual_seed(0)
    model = _load(name)
    batch = _batch(model, name)
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager = _loss_and_grads(model, model, batch)
    backend, counts, ops = _counting_backend()
    fn = torch.compile(model, backend=backend, fullgraph=True)
    compiled = _loss_and_grads(model, fn, batch)
    assert counts == {"forward": 1, "backward": 1}
    _assert_same(eager, compiled)
    if name in MOE:  # the experts' matmul is the op, and the auxiliary loss is part of the compiled loss
        assert {"cuboid.grouped_mm.default", "cuboid.grouped_mm_backward.default"} <= ops, sorted(ops)
        aux = fn(**batch).aux_loss
        assert aux > 0 and torch.allclose(aux, model(**batch).aux_loss, rtol=1e-5, atol=0)
        assert counts == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("name,variant", [("gpt-debug", "packed"), ("llama-debug", "padded"),
                                          ("llama-debug", "packed"), ("bert-debug", "padded")])
def test_masks_trace_without_host_reads(name, variant):
    torch.manual_seed(0)
    model = cuboid.load(name)
    batch = _batch(model, name, variant)
    eager = _loss_and_grads(model, model, batch)
    backend, counts, _ = _counting_backend()
    compiled = _loss_and_grads(model, torch.compile(model, backend=backend, fullgraph=True), batch)
    assert counts == {"forward": 1, "backward": 1}
    _assert_same(eager, compiled)


@pytest.mark.parametrize("name", ["gpt-debug", "llama-debug"])
def test_token_logps_compile_in_one_graph(name):
    # model(**batch, logprobs=True): the per-row fused head (reduction="none") traced with the model, packed rows
    torch.manual_seed(0)
    model = _load(name, n_layers=1)
    batch = _batch(model, name, "packed")
    weights = torch.randn(batch["labels"][:, 1:].shape, generator=torch.Generator().manual_seed(2))

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(**batch, logprobs=True)
        loss = (out.token_logps * weights).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = run(model)
    backend, counts, _ = _counting_backend()
    compiled = run(torch.compile(model, backend=backend, fullgraph=True))
    assert counts == {"forward": 1, "backward": 1}
    _assert_same(eager, compiled)


def test_compiled_output_keeps_deferred_logits():
    torch.manual_seed(0)
    model = cuboid.load("gpt-debug")
    batch = _batch(model, "gpt-debug")
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch)
    assert out.is_deferred("logits")  # the training step never makes the (B, T, V) logits
    torch.testing.assert_close(out.logits, model(**batch).logits, rtol=1e-5, atol=1e-6)


def test_inductor_one_block_llama():
    torch.manual_seed(0)
    model = cuboid.load("llama-debug", n_layers=1)
    batch = _batch(model, "llama-debug")
    eager = _loss_and_grads(model, model, batch)
    compiled = _loss_and_grads(model, torch.compile(model, fullgraph=True), batch)
    _assert_same(eager, compiled)


# ---------------------------------------------------------------- the Triton custom ops (interpreter on CPU)

needs_interpreter = pytest.mark.skipif(not kernels.interpreter_active(),
                                       reason="the Triton ops run on CPU only under TRITON_INTERPRET=1")
TRITON_OPS = {"gpt-debug": {"cuboid.norm.default", "cuboid.flash_attention.default", "cuboid.lce_stats.default",
                            "cuboid.lce_grad_.default", "cuboid.norm_backward.default",
                            "cuboid.flash_attention_backward.default"},
              "llama-debug": {"cuboid.norm.default", "cuboid.rope.default", "cuboid.flash_attention.default",
                              "cuboid.swiglu.default", "cuboid.swiglu_backward.default"},
              "mixtral-debug": {"cuboid.grouped_mm.default", "cuboid.grouped_mm_backward.default",
                                "cuboid.norm.default", "cuboid.flash_attention.default"}}


@needs_interpreter
@pytest.mark.parametrize("name", sorted(TRITON_OPS))
def test_triton_path_model_is_one_graph_of_custom_ops(name):
    torch.manual_seed(0)
    model = _load(name, n_layers=1)
    batch = _batch(model, name)
    with kernels.use_backend(None):  # the automatic rule: the interpreter's Triton kernels
        eager = _loss_and_grads(model, model, batch)
        backend, counts, ops = _counting_backend()
        compiled = _loss_and_grads(model, torch.compile(model, backend=backend, fullgraph=True), batch)
    assert counts == {"forward": 1, "backward": 1}
    assert TRITON_OPS[name] <= ops, sorted(ops)
    _assert_same(eager, compiled)


def _opcheck(op, args) -> None:
    # the dynamic-shape AOT test recompiles per size: the fixed-shape ones check fake impl, schema and autograd
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_static"))


@needs_interpreter
def test_norm_and_swiglu_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 5, 24, generator=g, requires_grad=True) for _ in range(2))
    w, b = torch.randn(24, generator=g, requires_grad=True), torch.randn(24, generator=g, requires_grad=True)
    _opcheck(torch.ops.cuboid.norm.default, (x, w, b, r, 1e-5, False))
    _opcheck(torch.ops.cuboid.norm.default, (x, w, None, None, 1e-6, True))
    gate, up = (torch.randn(6, 40, generator=g, requires_grad=True) for _ in range(2))
    _opcheck(torch.ops.cuboid.swiglu.default, (gate, up))


@needs_interpreter
def test_rope_attention_and_loss_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, generator=g, requires_grad=True) for _ in range(2))
    cos, sin = kernels.rope_tables(torch.arange(8), 16, 10000.0)
    _opcheck(torch.ops.cuboid.rope.default, (q, k, cos, sin, False))
    _opcheck(torch.ops.cuboid.flash_attention.default, (q, k, v, None, None, None, True, 0.25, None))
    z, y = torch.randn(5, 33, generator=g), torch.tensor([1, 0, -100, 32, 7])
    torch.library.opcheck(torch.ops.cuboid.lce_stats.default, (z, y, 33, 0, -100))
    lse = torch.logsumexp(z, -1)
    torch.library.opcheck(torch.ops.cuboid.lce_grad_.default, (z.clone(), y, lse, 33, 0, -100))
    torch.library.opcheck(torch.ops.cuboid.lce_stats.default, (z, y, 30, 3, -100, True))  # the entropy's form
    scale = torch.randn(5, generator=g)  # reduction="none": each row's upstream gradient
    torch.library.opcheck(torch.ops.cuboid.lce_grad_.default, (z.clone(), y, lse, 33, 0, -100, scale))


def _block(x, w, wq, wk, wg, wu, head, labels, cos, sin):
    """A Llama-like block over the Triton ops: norm, RoPE, attention, SwiGLU, fused loss."""
    h = kernels.rms_norm(x, w)
    B, T, C = h.shape
    q = (h @ wq).view(B, T, 2, C // 2).transpose(1, 2)
    k = (h @ wk).view(B, T, 2, C // 2).transpose(1, 2)
    q, k = kernels.rope(q, k, cos, sin)
    a = kernels.attention(q, k, k, causal=True).transpose(1, 2).reshape(B, T, C)
    y, res = kernels.rms_norm(a, w, residual=x)
    y = kernels.swiglu(y @ wg, y @ wu) + res
    return kernels.linear_cross_entropy(y, head, labels)


@needs_interpreter
def test_a_block_of_triton_ops_compiles_in_one_graph():
    g = torch.Generator().manual_seed(0)
    C, V = 32, 40
    params = [torch.randn(*s, generator=g).mul_(0.2).requires_grad_()
              for s in ((C,), (C, C), (C, C), (C, C), (C, C), (V, C))]
    x = torch.randn(2, 8, C, generator=g)
    labels = torch.randint(0, V, (2, 8), generator=g)
    cos, sin = kernels.rope_tables(torch.arange(8), C // 2, 10000.0)
    with kernels.use_backend(None):  # the automatic rule: the interpreter's Triton kernels
        loss0 = _block(x, params[0], *params[1:5], params[5], labels, cos, sin)
        grads0 = torch.autograd.grad(loss0, params)
        backend, counts, _ = _counting_backend()
        fn = torch.compile(_block, backend=backend, fullgraph=True)
        loss1 = fn(x, params[0], *params[1:5], params[5], labels, cos, sin)
        grads1 = torch.autograd.grad(loss1, params)
    assert counts == {"forward": 1, "backward": 1}
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _token_logps(x, head, labels, up):
    """Per-row log-probabilities and entropies (reduction="none") and a loss weighted per row."""
    rows, entropy = kernels.linear_cross_entropy(x, head, labels, reduction="none", return_entropy=True, chunk=3)
    return (rows * up).sum(), entropy


@needs_interpreter
def test_per_row_loss_compiles_in_one_graph_with_the_scaled_gradient_op():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    head = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[0, 1] = -100
    up = torch.randn(2, 5, generator=g)
    with kernels.use_backend(None):
        loss0, ent0 = _token_logps(x, head, labels, up)
        grads0 = torch.autograd.grad(loss0, (x, head))
        backend, counts, ops = _counting_backend()
        loss1, ent1 = torch.compile(_token_logps, backend=backend, fullgraph=True)(x, head, labels, up)
        grads1 = torch.autograd.grad(loss1, (x, head))
    assert counts == {"forward": 1, "backward": 1}
    assert {"cuboid.lce_stats.default", "cuboid.lce_grad_.default"} <= ops, sorted(ops)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
