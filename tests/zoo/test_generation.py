"""Generation with a key/value cache: greedy equals transformers' generate token for token; sampling is seeded."""
import pytest
import torch

import cuboid
from cuboid import zoo

from .hf_cases import CASES, make_hf

DECODERS = ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]
# greedy parity only (the stopping and sampling loop is the same for every decoder): windows of 4 and 3 tokens, shorter
# than the prompts of 7 and 6, and Gemma 3's sliding and global layers
WINDOWED = ["Qwen3ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM+window", "Qwen2ForCausalLM+window"]
NEW = 64


def prompts():
    """Three prompts of lengths 7, 4 and 6, left-padded to 7 (id 0 on the padding)."""
    ids = torch.randint(1, 97, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def long_hf(name):
    """The HF case with room for 64 new tokens."""
    cls, cfg, _ = CASES[name]
    config = cfg()
    for key in ("n_positions", "max_position_embeddings"):
        if hasattr(config, key):
            setattr(config, key, 80)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def pair(request, tmp_path_factory):
    hf = long_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, cuboid.load(folder)


@pytest.mark.parametrize("pair", DECODERS + WINDOWED, indirect=True)
def test_greedy_equals_transformers_generate(pair):
    name, hf, ours = pair
    ids, mask = prompts()
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    got = ours.generate(ids, mask, max_new_tokens=NEW)
    assert got.shape == want.shape == (3, 7 + NEW)
    assert torch.equal(got, want), (name, (got != want).sum().item())


@pytest.mark.parametrize("pair", DECODERS, indirect=True)
def test_eos_stops_each_row_and_pads_after_it(pair):
    name, hf, ours = pair
    ids, mask = prompts()
    free = ours.generate(ids, mask, max_new_tokens=12)
    eos = int(free[0, 7 + 3])  # row 0's fourth new token becomes the end of its text
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=eos)
    got = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert (got[0, 7 + 4:] == 0).all()


@pytest.mark.parametrize("pair", DECODERS[:1], indirect=True)
def test_a_list_of_stop_ids_stops_each_row_at_the_first_as_transformers(pair):
    name, hf, ours = pair
    ids, mask = prompts()
    free = ours.generate(ids, mask, max_new_tokens=12)
    stops = [int(free[1, 7 + 2]), int(free[0, 7 + 5])]  # row 1 stops at its third new token, row 0 by its sixth
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=stops)
    got = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=stops, pad_token_id=0)
    assert torch.equal(got, want), (name, (got != want).sum().item())
    assert (got[1, 7 + 3:] == 0).all()


@pytest.mark.parametrize("pair", DECODERS, indirect=True)
def test_sampling_is_seeded_and_respects_top_k(pair):
    _, _, ours = pair
    ids, mask = prompts()
    a = ours.generate(ids, mask, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=5)
    b = ours.generate(ids, mask, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=5)
    c = ours.generate(ids, mask, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    one = ours.generate(ids, mask, max_new_tokens=16, do_sample=True, top_k=1, seed=7)
    assert torch.equal(one, ours.generate(ids, mask, max_new_tokens=16))  # top-1 sampling is greedy


def test_bad_requests_are_clear_errors():
    model = cuboid.load("llama-debug")
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the model's 128 positions"):
        model.generate(ids, max_new_tokens=200)
    with pytest.raises(ValueError, match="temperature > 0"):
        model.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="causal LM head"):
        zoo.generation.generate(cuboid.load("bert-debug"), ids)
    assert not any(type(m).__name__ == "CachedAttention" for m in model.modules())  # cores put back
