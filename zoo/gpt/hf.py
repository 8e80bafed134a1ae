"""GPT <-> Hugging Face GPT2LMHeadModel / GPT2ForSequenceClassification / GPT2Model."""
from __future__ import annotations

from cuboid.zoo.hf_io import Family, TensorMap, transposed

from .config import GPTConfig
from .model import GPT

ARCHITECTURES = {"GPT2LMHeadModel": {"head": "lm"}, "GPT2ForSequenceClassification": {"head": "cls"},
                 "GPT2Model": {"head": "none", "prefixed": False}}
_ARCH_OF = {spec["head"]: name for name, spec in ARCHITECTURES.items()}


def config_from_hf(d: dict, arch: str) -> GPTConfig:
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {act!r} is not supported (gelu_new, gelu, gelu_pytorch_tanh)")
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
        raise ValueError("GPT-2 configs with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                         "are not supported")
    if d.get("tie_word_embeddings", True) is False and arch == "GPT2LMHeadModel":
        raise ValueError("an untied GPT-2 LM head is not supported (tie_word_embeddings=false)")
    head = ARCHITECTURES[arch]["head"]
    if head == "cls" and d.get("problem_type") not in (None, "single_label_classification"):
        raise ValueError(f"{arch} problem_type {d['problem_type']!r} is not supported (single-label)")
    return GPTConfig(
        vocab_size=d["vocab_size"], n_positions=d["n_positions"], dim=d["n_embd"], n_layers=d["n_layer"],
        n_heads=d["n_head"], mlp_hidden=d.get("n_inner") or 0, eps=d.get("layer_norm_epsilon", 1e-5),
        activation="gelu" if act == "gelu" else "gelu_new", head=head,
        num_labels=len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2),
        pad_token_id=d.get("pad_token_id"), init_std=d.get("initializer_range", 0.02),
    )


def config_to_hf(c: GPTConfig) -> dict:
    d = {
        "model_type": "gpt2", "vocab_size": c.vocab_size, "n_positions": c.n_positions, "n_embd": c.dim,
        "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.mlp_hidden or None,
        "activation_function": c.activation, "layer_norm_epsilon": c.eps, "initializer_range": c.init_std,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": 0.0, "tie_word_embeddings": True,
        "bos_token_id": c.vocab_size - 1, "eos_token_id": c.vocab_size - 1, "pad_token_id": c.pad_token_id,
    }
    if c.head == "cls":
        d.update(id2label={str(i): f"LABEL_{i}" for i in range(c.num_labels)},
                 label2id={f"LABEL_{i}": i for i in range(c.num_labels)})
    return d


def architecture_of(c: GPTConfig) -> str:
    return _ARCH_OF[c.head]


def tensor_maps(c: GPTConfig) -> list[TensorMap]:
    rows = [TensorMap("tok_emb.weight", ("wte.weight",)), TensorMap("pos_emb.weight", ("wpe.weight",)),
            TensorMap("ln_f.weight", ("ln_f.weight",)), TensorMap("ln_f.bias", ("ln_f.bias",))]
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"h.{i}."
        for zn, hn in (("ln1", "ln_1"), ("ln2", "ln_2")):
            rows += [TensorMap(f"{z}{zn}.weight", (f"{h}{hn}.weight",)), TensorMap(f"{z}{zn}.bias", (f"{h}{hn}.bias",))]
        for zn, hn in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                       ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            rows += [transposed(f"{z}{zn}.weight", f"{h}{hn}.weight"), TensorMap(f"{z}{zn}.bias", (f"{h}{hn}.bias",))]
    if c.head == "cls":
        rows.append(TensorMap("classifier.weight", ("score.weight",), top=True))
    return rows


FAMILY = Family(
    name="gpt", architectures=ARCHITECTURES, base_prefix="transformer.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=GPT,
    # causal-mask buffers of old checkpoints; the tied head when a writer stored it
    ignored=(".attn.bias", ".attn.masked_bias", "lm_head.weight"),
)
