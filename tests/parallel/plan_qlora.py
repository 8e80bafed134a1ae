"""QLoRA in the generated plan test (test_plans.py): which runs load a 4-bit NF4 base with LoRA adapters.

:func:`qlora_options` is one more field that plan_families.family_options turns by the plan's index: the runs it
picks load as ``cuboid.load(name, plan, quantize="nf4", lora=LORA, ...)`` and one device's reference of the
same overrides is ``cuboid.load(name, quantize="nf4", lora=LORA, ...)``, so the plan is held to one device's
QLoRA run through the public path (``rank_share`` + forward + backward + ``opt.step`` and
``cuboid.train_step``), with the test's tolerances (parameters gathered: the frozen non-block weights and the
adapters; the NF4 weights are buffers, no parameter).

**Every plan meets one**, whatever number of families a world gives each plan (plan_families.families_of:
all six, two, or one): the run on ``FAMILIES[index // 3 % 6]`` (the one family of the one-family rule; among
the six of the all-families rule) takes it, and so does the Llama-family preset ``LLAMA[index // 3 % 3]``
when that family is none of the two-family rule's pair (one of OTHERS and that preset). So the 4- and
8-rank worlds have one QLoRA run a plan; a plan on all six families (the 2-rank enumeration, the ready and
EXTRA plans) one or two. No run is added: the index chooses which runs are QLoRA.

A QLoRA run may also take test_plans' reliability checks (plan_reliability.checks_reliability): a LoRA model's
``checkpoint.save`` is its adapters alone (a peft folder naming no base), so one device reads it back the way
a user would, onto its base: ``cuboid.load(name, lora=folder, quantize="nf4", seed=0, ...)`` with the run's
overrides (plan_reliability.reliability passes them to reliability_checks.save_and_reload_check), its parameters
(the adapters and the frozen non-block weights) compared with the plan's gathered ones.

A 2D/2.5D/3D grid plan is not trained on a 4-bit base: the product refuses it in one sentence, which the run
that would take QLoRA checks (a meta load: no collective, no memory) before training its plain model. Plans
with ``compile=true`` (test_plans.COMPILED, outside the enumeration) stay plain: a compiled run's time is its
blocks' compile, which a second model configuration would double. The mixtures of experts (test_moe_plans)
are not turned here: their experts stay unquantized (transformers' rule), tested in test_qlora_plans.

The widths NF4 needs under 1D tensor parallelism (each rank's slice holds whole blocks of 64 values:
:mod:`cuboid.parallel.quant`; the enumerations reach tp = 4): the Llama family's attention inner width
``n_heads x head_dim`` = 4 x 64 and MLP 256; GPT-2, BERT and ViT, whose attention inner width is ``dim``,
``dim`` = 64 x tp and MLP 4 x dim, so a row cut keeps 64 columns or more a rank and column cuts whole rows.
"""
from __future__ import annotations

LORA = "r=4,alpha=8,targets=attn+mlp"  # a string: a reference's key (test_plans.RefArgs) must hash
FAMILIES = ("gpt-debug", "bert-debug", "vit-debug", "llama-debug", "qwen3-debug", "gemma3-debug")  # plan_families'
LLAMA, OTHERS = FAMILIES[3:], FAMILIES[:3]
NF4_DIMS = {"head_dim": 64, "mlp_hidden": 256}  # the Llama family's inner widths: whole NF4 blocks up to tp = 4


def takes_qlora(name: str, index: int) -> bool:
    """Whether the run of plan ``index`` on family ``name`` loads a 4-bit base with LoRA (module docstring)."""
    one = FAMILIES[index // 3 % len(FAMILIES)]  # plan_families.families_of's one family
    pair = (OTHERS[index % len(OTHERS)], LLAMA[index // 3 % len(LLAMA)])  # its two families
    return name == one or (one not in pair and name == pair[1])


def nf4_dims(name: str, plan) -> dict:
    """The config overrides that give every NF4 layer of ``name`` whole blocks of 64 values a rank under
    ``plan``'s 1D tensor parallelism (module docstring)."""
    if name in LLAMA:
        return dict(NF4_DIMS)
    return {"dim": 64 * plan.tp, "mlp_hidden": 256 * plan.tp}


def check_grid_refused(name: str, plan, config: dict) -> None:
    """A 4-bit base under a 2D/2.5D/3D grid: ``cuboid.load`` refuses it in one sentence (checked on the meta
    device, this rank's layout; AssertionError if it loads)."""
    import cuboid
    from cuboid.parallel import Mesh

    try:
        cuboid.load(name, plan, device="meta", mesh=Mesh.layout(plan), quantize="nf4", lora=LORA, **config)
    except NotImplementedError as e:
        message = str(e)
        assert "2D/2.5D/3D" in message and "\n" not in message and message.count(". ") == 0, message
        return
    raise AssertionError(f"{plan.describe()}: {name} with a 4-bit base loaded under a {plan.tp_mode} grid")


def qlora_options(name: str, plan, index: int, config: dict) -> dict:
    """The load options a QLoRA run adds to the config overrides ``config`` (plan_families.family_options' own):
    ``quantize="nf4"``, the LoRA spec and the widths NF4 needs; {} for a run that does not take it
    (:func:`takes_qlora`), a compiled plan and a grid plan (checked to refuse: :func:`check_grid_refused`)."""
    from cuboid import zoo

    if not takes_qlora(name, index) or plan.compile:
        return {}
    if plan.tp > 1 and plan.tp_mode != "1d":
        check_grid_refused(name, plan, config)
        return {}
    dims = nf4_dims(name, plan)
    plan.validate(zoo.config_of(name, **{**config, **dims}))  # every enumerated plan takes these widths
    return {**dims, "quantize": "nf4", "lora": LORA}
