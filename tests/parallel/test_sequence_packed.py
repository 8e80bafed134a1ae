"""Packed rows (Hugging Face's ``position_ids`` restarting at 0 at each document) under sequence
parallelism, through the public path: ``cuboid.load`` with ``sp2`` (ring), ``sp2-a2a`` (all-to-all) and
``tp2-seq`` (Megatron's sequence sharding in a tp group), ``model(**batch)`` against one device.

One 2-rank gloo world runs every check: for GPT (learned positions), Llama (rotary positions, grouped K/V
heads) and BERT (bidirectional), a batch of packed rows of uneven documents (13 tokens: the sequence is
padded to a multiple of 2 sp, the padded tail its own document) gives the one-device logits and loss, and
the gradient of document B's loss with respect to the token embeddings of the other documents is exactly
zero (non-zero on B's own).
"""
import torch

from .launch import run_world

TOL = 1e-5
T = 13
DOCS = [[4, 6, 3], [1, 9, 2, 1]]  # each row's document lengths (document 1 of row 0 is "B" below)


def packed_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(DOCS), T), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    labels = ids.masked_fill(positions == 0, -100)  # a document's first label never comes from the previous
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _embedding_grads(model, batch, doc: int):
    """The grad of document ``doc`` of row 0's loss w.r.t. the embedded sequence (B, T, C), summed over the
    ranks (each sp rank's embedding feeds only its own chunks)."""
    import torch.distributed as dist

    captured = {}
    plain = model.embed  # every rank embeds the whole sequence

    def embed(*a, **kw):
        x = plain(*a, **kw)
        x.retain_grad()
        captured["x"] = x
        return x

    model.embed = embed  # on the instance: the sequence split and the model's forward call it there
    try:
        labels = torch.full_like(batch["labels"], -100)
        start = sum(DOCS[0][:doc])
        span = slice(start + 1, start + DOCS[0][doc])
        labels[0, span] = batch["input_ids"][0, span]
        out = model(**dict(batch, labels=labels))
        out.loss.backward()
    finally:
        del model.embed
    grad = captured["x"].grad.clone()
    dist.all_reduce(grad)
    return grad


def packed_worker():
    import torch.distributed as dist

    import cuboid

    out = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name in ("gpt-debug", "llama-debug", "bert-debug"):
        ref = cuboid.load(name, None, seed=0).eval()
        batch = packed_batch(ref.config.vocab_size)
        if name.startswith("bert"):
            batch["labels"] = batch["labels"].masked_fill(torch.arange(T) % 3 != 0, -100)
        want = ref(**batch)
        doc_of = torch.tensor(sum(([i] * n for i, n in enumerate(DOCS[0])), []))
        for plan in ("sp2", "sp2-a2a", "tp2-seq"):
            model = cuboid.load(name, plan, seed=0).eval()
            got = model(**batch)
            key = f"{plan}/{name}"
            scale = want.logits.abs().max().item()
            out[f"{key} logits"] = ((got.logits - want.logits).abs().max().item() / scale, TOL)
            out[f"{key} loss"] = (abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()), TOL)
            if plan == "tp2-seq":
                continue
            grad = _embedding_grads(model, batch, doc=1)
            other = grad[0, doc_of != 1]
            out[f"{key} grad of document B's loss on the other documents"] = (other.abs().max().item(), 0.0)
            out[f"{key} grad of document B's loss on B"] = (float(grad[0, doc_of == 1].abs().max().item() == 0), 0.0)
            out[f"{key} grad of row 0's loss on row 1"] = (grad[1].abs().max().item(), 0.0)
        out[f"rank {rank} ran"] = (0.0, 0.0)
    return out


def test_packed_rows_under_sequence_plans_match_one_device():
    reports = run_world(packed_worker, 2, timeout=600)
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not v[0] <= v[1]}
        assert not bad, (rank, bad)
    assert len(reports[0]) == 3 * (3 * 2 + 2 * 3) + 1
