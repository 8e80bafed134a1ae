"""`cuboid finetune --lora`: adapters only, checkpoints in peft's layout, exact resume of adapters and their
optimizer state, and a final folder peft loads."""
from __future__ import annotations

import shutil

import pytest
import torch

import cuboid

from . import fixtures as F

peft = pytest.importorskip("peft")


def _adapters(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_lora_finetune_saves_adapters_and_resumes_exactly(tmp_path):
    import datasets
    import transformers as T

    model = F.hf_gpt2_folder(tmp_path / "gpt")
    rows = F.sentences(64)
    data = datasets.Dataset.from_dict({"text": [t for t, _ in rows]})
    opts = dict(task="causal", steps=6, batch_size=4, seq_len=24, lr=1e-2, lora="r=4,alpha=8,targets=attn+mlp",
                eval_every=3, save_every=3, progress=False, plot=False)
    a = tmp_path / "a"
    cuboid.finetune(str(model), data, output_dir=str(a), **opts)
    for name in ("checkpoint-3", "checkpoint-6", "final"):
        files = {p.name for p in (a / name).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files, (name, files)
        assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files), (name, files)
    final = _adapters(a / "final")
    assert any(float(t.abs().max()) > 0 for k, t in final.items() if ".lora_B." in k)

    # resume from checkpoint-3 in another folder: the same adapters at step 6 (optimizer state restored too)
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "checkpoint-3", b / "checkpoint-3")
    cuboid.finetune(str(model), data, output_dir=str(b), resume="latest", **opts)
    again = _adapters(b / "final")
    assert final.keys() == again.keys()
    for k in final:
        assert torch.equal(final[k], again[k]), k

    # peft loads the final adapters onto the base folder, with cuboid's logits
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = cuboid.load(model, lora=a / "final").eval()
    theirs = peft.PeftModel.from_pretrained(T.GPT2LMHeadModel.from_pretrained(model), a / "final").eval()
    with torch.no_grad():
        assert (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max() < 1e-5


def _moe_run(tmp_path, *extra):
    """A small local Qwen3-MoE folder (a dense layer between sparse ones, 4 experts) with a chat tokenizer, and
    `cuboid finetune --task sft --plan dp=2,ep=2 <extra>` on chat rows: (folder, tokenizer, run folder, stderr)."""
    import transformers as T

    from . import chat_fixtures as CF
    from .test_finetune import cli, metrics

    base = tmp_path / "moe"
    tok = CF.chat_tokenizer(base, "qwen2")
    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=24,
                              num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=256,
                              pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id)
    T.Qwen3MoeForCausalLM(config).save_pretrained(str(base))
    rows = [{"messages": [dict(m, content="sun moon sun") if m["role"] == "assistant" else m for m in c]}
            for c in CF.conversations(16, seed=7)]
    data = CF.write_jsonl(rows, tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(base), "--data", str(data), "--task", "sft", *extra,
                     "--plan", "dp=2,ep=2", "--max-length", "96", "--steps", "6", "--batch-size", "4",
                     "--log-every", "1", "--eval-every", "6", "--no-progress", "--no-plot", "--output-dir", str(run),
                     timeout=600)
    assert rc == 0, err[-3000:]
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    return base, tok, run, err


def test_sft_lora_on_a_mixture_of_experts(tmp_path):
    """`cuboid finetune --task sft --lora --plan dp=2,ep=2` on a small local Qwen3-MoE folder (a dense layer between
    sparse ones; each rank holds half of the experts and their adapters): the line says the experts train, the
    loss falls, final/ verifies against its record (tokenizer inside), and
    peft on transformers gives cuboid's logits with the final adapters (attention and experts)."""
    import transformers as T

    from cuboid.zoo import checkpoint

    base, tok, run, err = _moe_run(tmp_path, "--lora", "r=4,alpha=8", "--lr", "2e-2")
    assert "the experts of 2 sparse layers are adapted (gate_up, down" in err, err[-3000:]
    final = run / "final"
    assert checkpoint.verify(final)["files"] > 3 and (final / "tokenizer.json").is_file()

    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(1))
    hf = peft.PeftModel.from_pretrained(T.Qwen3MoeForCausalLM.from_pretrained(str(base)), str(final)).eval()
    ours = cuboid.load(str(base), lora=str(final)).eval()
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, ours(input_ids=ids).logits
        plain = T.Qwen3MoeForCausalLM.from_pretrained(str(base)).eval()(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapters moved the logits
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_sft_full_finetune_of_a_mixture_of_experts(tmp_path):
    """The same run without LoRA (every weight trains, each rank holding half of the experts): the loss falls, and
    transformers loads final/ (experts gathered from both ranks into the per-expert layout) with the logits
    cuboid's final model gives, which differ from the base's."""
    import transformers as T

    base, tok, run, _ = _moe_run(tmp_path, "--lr", "5e-3")
    final = run / "final"
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(1))
    theirs = T.Qwen3MoeForCausalLM.from_pretrained(str(final)).eval()
    ours = cuboid.load(str(final)).eval()
    with torch.no_grad():
        want, got = theirs(input_ids=ids).logits, ours(input_ids=ids).logits
        plain = T.Qwen3MoeForCausalLM.from_pretrained(str(base)).eval()(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the run changed the weights
    assert (got - want).abs().max() / want.abs().max() < 1e-5
