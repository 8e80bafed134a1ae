"""ViT <-> Hugging Face ViTModel / ViTForImageClassification."""
from __future__ import annotations

from cuboid.zoo.hf_io import Family, TensorMap, weight_bias, reshaped, stacked

from .config import ViTConfig
from .model import ViT

ARCHITECTURES = {"ViTForImageClassification": {"head": "cls"}, "ViTModel": {"head": "none", "prefixed": False}}


def config_from_hf(d: dict, arch: str) -> ViTConfig:
    if d.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"ViT hidden_act {d['hidden_act']!r} is not supported (gelu)")
    if d.get("qkv_bias", True) is False:
        raise ValueError("ViT without qkv bias (qkv_bias=false) is not supported")
    head = ARCHITECTURES[arch]["head"]
    num_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
    return ViTConfig(
        image_size=d["image_size"], patch_size=d["patch_size"], channels=d.get("num_channels", 3),
        dim=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=d["num_attention_heads"],
        mlp_hidden=d["intermediate_size"], eps=d.get("layer_norm_eps", 1e-12), head=head,
        num_labels=num_labels, pooler=head == "none", init_std=d.get("initializer_range", 0.02),
    )


def config_to_hf(c: ViTConfig) -> dict:
    return {
        "model_type": "vit", "image_size": c.image_size, "patch_size": c.patch_size, "num_channels": c.channels,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.mlp_hidden, "hidden_act": "gelu", "layer_norm_eps": c.eps,
        "initializer_range": c.init_std, "qkv_bias": True, "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": 0.0,
        "id2label": {str(i): f"LABEL_{i}" for i in range(c.num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(c.num_labels)},
    }


def architecture_of(c: ViTConfig) -> str:
    return "ViTForImageClassification" if c.head == "cls" else "ViTModel"



def tensor_maps(c: ViTConfig) -> list[TensorMap]:
    e, p = "embeddings.", c.patch_size
    rows = [TensorMap("cls_token.weight", (e + "cls_token",)),
            TensorMap("pos_emb.weight", (e + "position_embeddings",)),
            reshaped("patch.weight", e + "patch_embeddings.projection.weight",
                     (c.dim, c.channels * p * p), (c.dim, c.channels, p, p)),
            TensorMap("patch.bias", (e + "patch_embeddings.projection.bias",)),
            *weight_bias("ln_f", "layernorm")]
    for i in range(c.n_layers):
        z, h = f"blocks.{i}.", f"encoder.layer.{i}."
        a = h + "attention.attention."
        rows += [*weight_bias(z + "ln1", h + "layernorm_before"),
                 stacked(z + "attn.qkv.weight", [a + "query.weight", a + "key.weight", a + "value.weight"]),
                 stacked(z + "attn.qkv.bias", [a + "query.bias", a + "key.bias", a + "value.bias"]),
                 *weight_bias(z + "attn.proj", h + "attention.output.dense"),
                 *weight_bias(z + "ln2", h + "layernorm_after"),
                 *weight_bias(z + "mlp.fc", h + "intermediate.dense"),
                 *weight_bias(z + "mlp.proj", h + "output.dense")]
    if c.pooler:
        rows += weight_bias("pooler", "pooler.dense")
    if c.head == "cls":
        rows += [TensorMap(r.zoo, r.hf, top=True) for r in weight_bias("classifier", "classifier")]
    return rows


FAMILY = Family(
    name="vit", architectures=ARCHITECTURES, base_prefix="vit.", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, architecture_of=architecture_of, tensor_maps=tensor_maps, build=ViT,
)
