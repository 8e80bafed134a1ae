"""Packed rows under tensor parallelism (1D, 2 gloo ranks), through the public path: no gradient crosses a
document, and each document's logits are one device's (the plan parity test trains every plan on packed rows:
tests/parallel/test_plans.py's ``packed_batch``)."""
import torch

from .launch import run_world

FAMILIES = ("gpt-debug", "llama-debug", "bert-debug")


def packed_tp_worker():
    import cuboid
    from cuboid.parallel import Mesh, Plan

    from ..zoo.test_packed import embedding_grads, packed_row, spans

    plan = Plan(tp=2)
    mesh = Mesh.build(plan)
    report = {}
    for name in FAMILIES:
        one = cuboid.load(name, seed=0).eval()
        model = cuboid.load(name, plan, seed=0, mesh=mesh)
        batch = packed_row(vocab=model.config.vocab_size, causal=name != "bert-debug", rows=2)
        for doc in (1, 2):
            grad = embedding_grads(model, batch, doc)
            a, b = spans()[doc]
            report[(name, doc)] = (float(grad[:, :a].abs().max()), float(grad[:, b:].abs().max()),
                                   float(grad[:, a:b].abs().sum()))
        model.eval()
        with torch.no_grad():
            got, want = model(**batch).logits, one(**batch).logits
        report[(name, "logits")] = ((got - want).abs().max() / want.abs().max()).item()
    return report


def test_no_gradient_crosses_a_document_under_tp1d():
    for report in run_world(packed_tp_worker, 2, timeout=300):
        for name in FAMILIES:
            for doc in (1, 2):
                before, after, inside = report[(name, doc)]
                assert before == 0.0 and after == 0.0 and inside > 0, (name, doc, report[(name, doc)])
            assert report[(name, "logits")] < 1e-5, (name, report[(name, "logits")])
