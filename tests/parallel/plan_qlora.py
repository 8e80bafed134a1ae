"""QLoRA in the generated plan test (test_plans.py): which runs load a 4-bit NF4 base with LoRA adapters.

:func:`qlora_options` is one more field that test_plans.family_options turns by the plan's index: on one
plan in :data:`EVERY` (index ``% EVERY == AT``) a Llama-family preset (llama-debug, qwen3-debug,
gemma3-debug) loads as ``cuboid.load(name, plan, quantize="nf4", lora=LORA, ...)``, and one device's
reference of the same overrides is ``cuboid.load(name, quantize="nf4", lora=LORA, ...)``: the plan is held to
one device's QLoRA run through the public path (``rank_share`` + forward + backward + ``opt.step`` and
``cuboid.train_step``), with the test's tolerances (parameters gathered: the frozen non-block weights and
the adapters; the NF4 weights are buffers, no parameter).

The widths NF4 needs under 1D tensor parallelism (each rank's slice holds whole blocks of 64 values:
:mod:`cuboid.parallel.quant`): the attention's inner width ``n_heads x head_dim`` = 4 x 64 = 256 and the MLP's
256, so a row cut over tp = 2 or 4 keeps 128 or 64 columns a rank; column cuts keep whole rows of ``dim`` = 64.

Left out, and why:

- 2D/2.5D/3D tensor grids: the product refuses a 4-bit base there in one sentence (only one device and 1D
  tensor parallelism, with dp, ZeRO, pp and sp, are built);
- plans with ``compile=true`` (test_plans.COMPILED, one family each): a compiled run's time is its blocks'
  compile, which a second model configuration would double;
- gpt-debug, bert-debug and vit-debug: the issue's QLoRA is the Llama family's (peft and bitsandbytes' use);
  the mixtures of experts: their experts stay unquantized (transformers' rule), tested in test_qlora_plans.

The index rule picks odd indices (``% 6 == 1``), which the reliability checks (every 4th or 12th index,
test_plans.RELIABILITY_EVERY) never take, and over which test_plans' tasks alternate (plan_tasks.task_of:
``weighted`` and ``grpo``) and the classification head comes and goes (family_options). On 2 ranks it takes
tp=2 with tp_sequence, pp=2 under ZBV and the EXTRA sp=2 with checkpointing, each on the three presets; on 4
ranks one preset each of ten plans (tp=4 with tp_sequence, pp x tp, dp x tp with ZeRO-3, ...); on 8 ranks,
where each plan runs on one family, the eight of them qwen3-debug takes.
"""
from __future__ import annotations

EVERY, AT = 6, 1
LORA = "r=4,alpha=8,targets=attn+mlp"  # a string: a reference's key (test_plans.RefArgs) must hash
LLAMA = ("llama-debug", "qwen3-debug", "gemma3-debug")
NF4_DIMS = {"head_dim": 64, "mlp_hidden": 256}  # inner widths of whole NF4 blocks per rank up to tp = 4


def takes_qlora(name: str, plan, index: int) -> bool:
    """Whether run ``index`` of ``plan`` on family ``name`` loads a 4-bit base with LoRA (module docstring)."""
    return (index % EVERY == AT and name in LLAMA and not plan.compile
            and (plan.tp == 1 or plan.tp_mode == "1d"))


def qlora_options(name: str, plan, index: int, config: dict) -> dict:
    """The load options a QLoRA run adds to the config overrides ``config`` (test_plans.family_options'
    own): ``quantize="nf4"``, the LoRA spec and the widths NF4 needs; {} for a run that does not take it
    (:func:`takes_qlora`). A plan that those widths do not validate (none of the enumeration's) is left
    plain."""
    from cuboid import zoo

    if not takes_qlora(name, plan, index):
        return {}
    try:
        plan.validate(zoo.config_of(name, **{k: v for k, v in {**config, **NF4_DIMS}.items()
                                             if k not in ("quantize", "lora")}))
    except ValueError:
        return {}
    return {**NF4_DIMS, "quantize": "nf4", "lora": LORA}
