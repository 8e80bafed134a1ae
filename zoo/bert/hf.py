"""BERT <-> Hugging Face BertModel / BertForMaskedLM / BertForSequenceClassification."""
from __future__ import annotations

from cuboid.zoo.hf_io import Family, TensorMap, weight_bias, stacked

from .config import BertConfig
from .model import Bert

ARCHITECTURES = {
    "BertForMaskedLM": {"head": "mlm"},
    "BertForSequenceClassification": {"head": "cls"},
    "BertModel": {"head": "none", "prefixed": False},
}


def config_from_hf(d: dict, arch: str) -> BertConfig:
    act = d.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"BERT hidden_act {act!r} is not supported (gelu)")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT position_embedding_type {d['position_embedding_type']!r} is not supported")
    head = ARCHITECTURES[arch]["head"]
    if head == "cls" and d.get("problem_type") not in (None, "single_label_classification"):
        raise ValueError(f"BERT problem_type {d['problem_type']!r} is not supported (single-label)")
    num_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
    return BertConfig(
        vocab_size=d["vocab_size"], n_positions=d["max_position_embeddings"],
        type_vocab_size=d.get("type_vocab_size", 2), dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=d["num_attention_heads"], mlp_hidden=d["intermediate_size"], eps=d.get("layer_norm_eps", 1e-12),
        head=head, num_labels=num_labels, pooler=head != "mlm", init_std=d.get("initializer_range", 0.02),
    )


def config_to_hf(c: BertConfig) -> dict:
    return {
        "model_type": "bert", "vocab_size": c.vocab_size, "max_position_embeddings": c.n_positions,
        "type_vocab_size": c.type_vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.mlp_hidden, "hidden_act": "gelu",
        "layer_norm_eps": c.eps, "initializer_range": c.init_std, "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": 0.0, "pad_token_id": 0,
        "id2label": {str(i): f"LABEL_{i}" for i in range(c.num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(c.num_labels)},
    }


def architecture_of(c: BertConfig) -> str:
    return {"mlm": "BertForMaskedLM", "cls": "BertForSequenceClassification", "none": "BertModel"}[c.head]



def tensor_maps(c: BertConfig) -> list[TensorMap]:
    e = "embeddings."
    rows = [TensorMap("tok_emb.weight", (e + "word_embeddings.weight",)),
            TensorMap("pos_emb.weight", (e + "position_embeddings.weight",)),
            TensorMap("type_emb.weight", (e + "token_type_embeddings.weight",)),
            *weight_bias("ln_emb", e + "LayerNorm")]
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"encoder.layer.{i}."
        a = h + "attention.self."
        rows += [stacked(z + "attn.qkv.weight", [a + "query.weight", a + "key.weight", a + "value.weight"]),
                 stacked(z + "attn.qkv.bias", [a + "query.bias", a + "key.bias", a + "value.bias"]),
                 *weight_bias(z + "attn.proj", h + "attention.output.dense"),
                 *weight_bias(z + "ln1", h + "attention.output.LayerNorm"),
                 *weight_bias(z + "mlp.fc", h + "intermediate.dense"),
                 *weight_bias(z + "mlp.proj", h + "output.dense"),
                 *weight_bias(z + "ln2", h + "output.LayerNorm")]
    if c.pooler:
        rows += weight_bias("pooler", "pooler.dense")
    if c.head == "mlm":
        t = "cls.predictions."
        rows += [TensorMap(r.zoo, r.hf, top=True) for r in
                 weight_bias("mlm_dense", t + "transform.dense") + weight_bias("mlm_ln", t + "transform.LayerNorm")]
        rows.append(TensorMap("mlm_bias.weight", (t + "bias",), top=True))
    elif c.head == "cls":
        rows += [TensorMap(r.zoo, r.hf, top=True) for r in weight_bias("classifier", "classifier")]
    return rows


FAMILY = Family(
    name="bert", architectures=ARCHITECTURES, base_prefix="bert.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=Bert,
    # the decoder is tied to the word embeddings and its bias to cls.predictions.bias
    ignored=("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "embeddings.position_ids",
             "cls.seq_relationship.weight", "cls.seq_relationship.bias"),
    renames=((".gamma", ".weight"), (".beta", ".bias")),
)
