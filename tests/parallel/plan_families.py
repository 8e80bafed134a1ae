"""The families the plan tests run and what each plan's run of a family takes: the six dense families, the
mixtures of experts (the enumeration's rotation and the others), the config overrides turned by the plan's index
(:func:`family_options`: key/value heads, the classification head, QLoRA, the later MoE presets' shapes), the
families a plan runs on (:func:`families_of`, :func:`moe_family`) and a family's global batch. Used by
test_plans.py's generated worlds and test_moe_plans.py."""
from .plan_qlora import qlora_options
from .test_data_parallel import global_batch as dp_batch

FAMILIES = ("gpt-debug", "bert-debug", "vit-debug", "llama-debug", "qwen3-debug", "gemma3-debug")
# the Llama family's presets (Llama, Qwen3 with q/k norms and head_dim apart from dim / heads, Gemma 3 with
# sliding-window layers, sandwich norms and Gemma's norms); the others: FAMILIES less these
LLAMA = ("llama-debug", "qwen3-debug", "gemma3-debug")
OTHERS = tuple(f for f in FAMILIES if f not in LLAMA)
# a mixture-of-experts preset (Qwen3-MoE: router, 8 experts top 2) trained with its load-balancing loss
# (output_router_logits): test_moe_plans_on_2_ranks runs its enumeration (ep plans included) on it
MOE = ("qwen3-moe-debug",)
MOE_OTHERS = ("mixtral-debug", "olmoe-debug")  # the other two MoE families (test_moe_plans.py): a few plans each
# the late-2025 MoE families: gpt-oss (sinks, alternating windows, a biased router and biased experts) and
# DeepSeek-V3 (latent attention, group-limited routing with a correction bias, a shared expert); the MoE
# enumeration turns MOE_ROTATION by plan index (:func:`moe_family`)
MOE_LATE = ("gpt-oss-debug", "deepseek-v3-debug")
MOE_ROTATION = MOE + MOE_LATE
MOE_FAMILIES = MOE + MOE_OTHERS + MOE_LATE
# the later MoE presets' shapes in the plan worlds: gpt-oss-debug's 4 experts made 8 (ep = 8 splits them) and
# both cut to two layers, each kind still there (a windowed layer and a full one; a dense layer before a sparse
# one, as qwen3-moe-debug): a run's time goes with its sparse layers (all-to-alls, routers, experts), and the
# 8-rank world runs 331 plans
MOE_SHAPES = {"gpt-oss-debug": {"n_experts": 8, "n_layers": 2, "layer_types": ("sliding_attention", "full_attention")},
              "deepseek-v3-debug": {"n_layers": 2}}
KV_HEADS = (1, 2, 4)  # the Llama family's 4 query heads over 1 (multi-query), 2 (grouped) or 4 key/value heads


def family_options(name, plan, index):
    """The config overrides family ``name`` runs ``plan`` with: a vocabulary of 510 (it does not divide tp=4:
    padding) and, for the Llama family, the key/value heads turned by the plan's index over KV_HEADS, the
    first the plan takes (2D/3D and all-to-all need them to divide their head split), and on some plans the
    sequence-classification head (each row's score at its last real token), with three classes or with one
    output (a reward model: plan_tasks.task_of gives it the reward task), turned by the index; on one run of
    every plan (two of some plans on all six families) a 4-bit NF4 base with LoRA adapters, the family turned
    by the index (plan_qlora.qlora_options; a 2D/2.5D/3D grid checked to refuse it); the later MoE presets in
    the shapes of MOE_SHAPES."""
    from cuboid import zoo

    if name in MOE_FAMILIES:
        return {"vocab_size": 510, "output_router_logits": True, **MOE_SHAPES.get(name, {})}
    if name not in LLAMA:
        options = {} if name == "vit-debug" else {"vocab_size": 510}
        return {**options, **qlora_options(name, plan, index, options)}
    # every other run of three and every 2D/3D grid (rows cut over ranks) takes the classification head (under pp
    # each row's last token travels to the last stage; under sp the head gathers the rows)
    cls = {"head": "cls", "num_labels": 1 + 2 * (index % 2)} \
        if (index // 3 + index // 18) % 2 or plan.tp_mode in ("2d", "3d") else {}
    for kv in KV_HEADS[index % 3:] + KV_HEADS[:index % 3]:
        try:
            plan.validate(zoo.config_of(name, n_kv_heads=kv))
        except ValueError:
            continue
        options = {"vocab_size": 510, "n_kv_heads": kv, **cls}
        return {**options, **qlora_options(name, plan, index, options)}
    raise AssertionError(f"{plan.describe()} takes no key/value head count of {KV_HEADS}")


def moe_family(index, plan):
    """The family of MOE_ROTATION that plan number ``index`` of the MoE enumeration runs on: turned by the index,
    the first from there whose config the plan validates (DeepSeek-V3 takes 1D tensor parallelism without
    tp_sequence only)."""
    from cuboid import zoo

    for name in MOE_ROTATION[index % len(MOE_ROTATION):] + MOE_ROTATION[:index % len(MOE_ROTATION)]:
        options = family_options(name, plan, index)
        try:
            plan.validate(zoo.config_of(name, **options))
        except ValueError:
            continue
        return name
    raise AssertionError(f"{plan.describe()} takes none of {MOE_ROTATION}")


def families_of(index, per_plan=len(FAMILIES), families=FAMILIES, plan=None):
    """The families plan number ``index`` runs on, ``per_plan`` of them (:func:`families_per_plan`): all (6); one
    of OTHERS turned by the index and one Llama-family preset turned by ``index // 3`` (2); or one of the six
    turned by ``index // 3`` (1). Three consecutive plans share a family, so over 3 plans (1) or 9 (2) each
    Llama-family preset meets each key/value head count of :func:`family_options` (turned by ``index % 3``)
    and with and without its classification head (on by ``(index // 3 + index // 18) % 2``). Over MOE_ROTATION
    (the MoE enumeration), one family a plan (:func:`moe_family`)."""
    if families == MOE_ROTATION:
        return (moe_family(index, plan),)
    if per_plan == len(FAMILIES):
        return FAMILIES + MOE_FAMILIES
    if per_plan == 2:
        return (OTHERS[index % len(OTHERS)], LLAMA[index // 3 % len(LLAMA)])
    assert per_plan == 1, per_plan
    return (FAMILIES[index // 3 % len(FAMILIES)],)


def global_batch(name, model, size=8):
    """test_data_parallel's global batch of family ``name`` (a Llama-family preset's as llama-debug's: a label per
    row for the classification head)."""
    return dp_batch("llama-debug" if name in LLAMA + MOE_FAMILIES else name, model, size)
