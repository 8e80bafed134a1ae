"""Packed rows on one device: several documents in one row, marked by ``position_ids`` restarting at 0.

Each document of a packed row gets the logits transformers gives that
document alone (fp32, 1e-5), the packed loss is the token-weighted mean of
the documents' losses (each document's first label -100, as Hugging Face's
``DataCollatorWithFlattening`` writes it), and no gradient crosses a
document boundary through the public path (``cuboid.load``,
``model(**batch).loss.backward()``).
"""
import pytest
import torch

import cuboid

from .hf_cases import make_hf

LENGTHS = (5, 3, 7, 1, 4)  # a one-token document too; 20 tokens (n_positions 32)
PACKED_CASES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "BertForMaskedLM")


def packed_row(lengths=LENGTHS, vocab: int = 97, seed: int = 2, causal: bool = True, rows: int = 1) -> dict:
    """``rows`` packed rows of documents of ``lengths``: input_ids, position_ids restarting at each document and
    labels (causal: the ids with each document's first token -100; masked LM: every third token)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(1, vocab, (rows, T), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, T).clone()
    if causal:
        labels = ids.masked_fill(positions == 0, -100)
    else:
        labels = ids.masked_fill(torch.arange(T) % 3 != 1, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def spans(lengths=LENGTHS):
    """The (start, end) of each document in the row."""
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(e - n, e) for n, e in zip(lengths, ends)]


@pytest.fixture(scope="module", params=PACKED_CASES)
def packed_case(request, tmp_path_factory):
    name = request.param
    hf = make_hf(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, cuboid.load(folder).eval()


def test_each_document_gets_its_own_logits_and_the_loss_is_token_weighted(packed_case):
    name, hf, model = packed_case
    causal = not name.startswith("Bert")
    batch = packed_row(causal=causal)
    with torch.no_grad():
        out = model(**batch)
        loss_sum = count = 0.0
        for a, b in spans():
            alone = {"input_ids": batch["input_ids"][:, a:b]}
            ref = hf(**alone).logits
            got = out.logits[:, a:b]
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, (name, a, b)
            labels = batch["input_ids"][:, a:b] if causal else batch["labels"][:, a:b]
            n = b - a - 1 if causal else int((labels != -100).sum())
            if n:
                loss_sum += hf(**alone, labels=labels).loss.item() * n
                count += n
    assert abs(out.loss.item() - loss_sum / count) <= 1e-5 * loss_sum / count


def embedding_grads(model, batch: dict, doc: int, lengths=LENGTHS) -> torch.Tensor:
    """The gradient of document ``doc``'s loss (every other label -100) with respect to the token embeddings
    of the whole row: (B, T, C), through ``model(**batch).loss.backward()``."""
    a, b = spans(lengths)[doc]
    labels = torch.full_like(batch["labels"], -100)
    labels[:, a:b] = batch["labels"][:, a:b]
    seen = []

    def keep_grad(module, args, output):
        output.retain_grad()
        seen.append(output)

    handle = model.tok_emb.register_forward_hook(keep_grad)
    try:
        model.zero_grad(set_to_none=True)
        model(**dict(batch, labels=labels)).loss.backward()
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0].grad


@pytest.mark.parametrize("name", ["gpt-debug", "llama-debug", "bert-debug"])
def test_no_gradient_crosses_a_document(name):
    model = cuboid.load(name, seed=0)
    batch = packed_row(vocab=model.config.vocab_size, causal=name != "bert-debug", rows=2)
    for doc in (1, 2):
        grad = embedding_grads(model, batch, doc)
        a, b = spans()[doc]
        assert bool((grad[:, :a] == 0).all()) and bool((grad[:, b:] == 0).all()), (name, doc)
        assert float(grad[:, a:b].abs().sum()) > 0, (name, doc)


def test_position_ids_of_one_row_for_all_and_padding():
    """HF's (1, T) position_ids serve every row; a packed row with right padding (attention_mask 0) gives the
    same documents' logits as without it."""
    model = cuboid.load("llama-debug", seed=0).eval()
    batch = packed_row(vocab=model.config.vocab_size, rows=2)
    with torch.no_grad():
        plain = model(**batch).logits
        shared = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"][:1]).logits
        pad = torch.full((2, 3), 0)
        padded = model(input_ids=torch.cat([batch["input_ids"], pad + 1], 1),
                       position_ids=torch.cat([batch["position_ids"], torch.arange(3).expand(2, 3)], 1),
                       attention_mask=torch.cat([torch.ones_like(batch["input_ids"]), pad], 1)).logits
    assert torch.equal(plain, shared)
    T = batch["input_ids"].shape[1]
    assert (padded[:, :T] - plain).abs().max().item() < 1e-6
