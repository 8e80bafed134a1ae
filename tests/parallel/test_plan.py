"""Plan: data that round-trips, parses, and says in one sentence what does not fit."""
import json

import pytest

from cuboid import zoo
from cuboid.parallel import Plan


def test_round_trips_dict_json_toml_inline(tmp_path):
    plan = Plan(dp=2, tp=8, tp_mode="2.5d", depth=2, zero=1, checkpoint="full", dtype="bf16")
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_toml(plan.to_toml()) == plan
    assert Plan.parse(plan.describe()) == plan
    (tmp_path / "p.json").write_text(plan.to_json())
    (tmp_path / "p.toml").write_text("[plan]\n" + plan.to_toml())
    assert Plan.parse(str(tmp_path / "p.json")) == plan == Plan.parse(str(tmp_path / "p.toml"))
    assert plan.world_size == 16 and plan.tp_grid == (2, 2, 2)
    assert Plan.parse("tp1d", zoo.READY_PLANS) == Plan(tp=2)
    assert Plan().describe() == "single" and Plan.parse(None) == Plan()


def test_activation_checkpoint_is_a_spelling_of_checkpoint():
    """``activation_checkpoint`` is read as ``checkpoint`` by parse, from_dict and replace; the plan has only
    ``checkpoint``, and describes and saves itself with it."""
    full = Plan.parse("dp=2,activation_checkpoint=true")
    assert full == Plan(dp=2, checkpoint="full") == Plan.from_dict({"dp": 2, "activation_checkpoint": True})
    assert not hasattr(full, "activation_checkpoint") and "activation_checkpoint" not in full.to_dict()
    assert full.describe() == "dp=2,checkpoint=full" and Plan.parse(full.describe()) == full
    # dicts that carry both names (as saved plans did) read as the one field
    assert Plan.from_dict({"activation_checkpoint": True, "checkpoint": "full"}) == Plan(checkpoint="full")
    assert Plan.from_dict({"activation_checkpoint": False, "checkpoint": "selective"}) == Plan(checkpoint="selective")
    assert Plan(checkpoint="selective").replace(activation_checkpoint=True).checkpoint == "full"
    assert full.replace(activation_checkpoint=False) == Plan(dp=2)
    with pytest.raises(ValueError, match="contradict each other"):
        Plan.parse("activation_checkpoint=true,checkpoint=selective")
    with pytest.raises(TypeError):
        Plan(activation_checkpoint=True)  # not a field: the constructor takes checkpoint only
    assert zoo.READY_PLANS["dp2-ckpt"] == Plan.parse("dp=2,activation_checkpoint=true")


@pytest.mark.parametrize("kwargs,message", [
    ({"dp": 0}, "dp must be a whole number >= 1"),
    ({"tp_mode": "4d"}, "tp_mode must be one of 1d, 2d, 2.5d, 3d"),
    ({"zero": 4}, "zero must be 0, 1, 2 or 3"),
    ({"depth": 2}, "depth=2 only applies to tp_mode 2.5d"),
    ({"dtype": "fp8"}, "dtype must be one of"),
])
def test_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan(**kwargs)


def test_parse_errors():
    with pytest.raises(ValueError, match="unknown plan 'tp9'"):
        Plan.parse("tp9", zoo.READY_PLANS)
    with pytest.raises(ValueError, match=r"unknown plan field\(s\) pipeline"):
        Plan.parse("pipeline=2")
    with pytest.raises(ValueError, match="is not of the form field=value"):
        Plan.parse("dp=2,tp")
    with pytest.raises(ValueError, match="does not exist"):
        Plan.parse("missing.toml")


def test_pipeline_plans_default_to_the_micro_batches_their_schedule_needs():
    """``pp=2`` alone is a working pipeline: micro-batches left out are ``pp`` for 1f1b, interleaved and zbv (1
    under gpipe and without pp), said by ``describe`` (the plan line), and follow a new pp or schedule."""
    config = zoo.config_of("gpt-debug")
    for spec, micro in (("pp=2", 2), ("pp=2,schedule=interleaved", 2), ("pp=2,schedule=zbv", 2),
                        ("pp=2,schedule=gpipe", 1), ("dp=2", 1), ("pp=2,microbatches=4", 4)):
        plan = Plan.parse(spec)
        assert plan.microbatches == micro, spec
        plan.validate(config, plan.world_size)
    assert Plan.parse("pp=2").describe() == "pp=2,microbatches=2"
    assert Plan(pp=2).microbatches == 2 and Plan().microbatches == 1
    assert Plan.from_dict({"pp": 2}).microbatches == 2 and Plan.from_json('{"pp": 2}') == Plan.parse("pp=2")
    assert Plan.parse("pp=2").replace(pp=4).microbatches == 4  # the default follows
    assert Plan.parse("pp=2,schedule=gpipe").replace(schedule="1f1b").microbatches == 2
    assert Plan.parse("pp=2,microbatches=6").replace(pp=3).microbatches == 6  # a given count stays


@pytest.mark.parametrize("plan,world,message", [
    (Plan(dp=2, tp=2), 2, r"needs dp\*pp\*tp\*sp = 4 processes, but the world size is 2"),
    (Plan(tp=3, tp_mode="2d"), None, "tp_mode 2d needs tp to be a square"),
    (Plan(tp=4, tp_mode="3d"), None, "tp_mode 3d needs tp to be a cube"),
    (Plan(tp=8, tp_mode="2.5d", depth=3), None, "tp_mode 2.5d needs tp = depth"),
    (Plan(tp=3), None, "4 attention heads do not divide over the tensor-parallel split of 3"),
    (Plan(pp=8, microbatches=8), None, "8 pipeline stages for a model of 2 layers"),
    (Plan(pp=2, microbatches=1), None, "needs microbatches >= pp"),
    (Plan(pp=2, microbatches=2, stage_blocks=(2, 1)), None, "stage_blocks 2/1 must give each of the 2 pipeline"),
])
def test_validate_says_what_does_not_fit(plan, world, message):
    config = zoo.config_of("gpt-debug")
    with pytest.raises(ValueError, match=message):
        plan.validate(config, world)


def test_unbuilt_combinations_are_named_not_run():
    with pytest.raises(ValueError, match="sequence parallelism \\(sp=2\\) does not combine with tp_mode 2d: the 2d "
                                         "grid already cuts each batch into blocks"):
        Plan(sp=2, tp=4, tp_mode="2d").validate()
    with pytest.raises(ValueError, match="tp_mode 2.5d needs depth >= 2 and q >= 2"):
        Plan(tp=4, tp_mode="2.5d", depth=1).validate()
    with pytest.raises(ValueError, match="q 1 is data parallelism over the depth"):
        Plan(tp=2, tp_mode="2.5d", depth=2).validate()
    with pytest.raises(NotImplementedError, match="tp_sequence with sequence parallelism"):
        Plan(sp=2, tp=2, tp_sequence=True).require_implemented()
    with pytest.raises(ValueError, match="tp_sequence shards the sequence inside a 1D tensor-parallel group"):
        Plan(tp=4, tp_mode="2d", tp_sequence=True)
    with pytest.raises(ValueError, match="the 6 attention heads to divide over sp x the tensor split of heads = 2 x 2"):
        Plan(sp=2, tp=2, sp_mode="all_to_all").validate(_Heads(6))
    for plan in (Plan(dp=2, zero=2), Plan(sp=2, tp=2), Plan(tp=2, tp_sequence=True), Plan(dp=2, sp=2),
                 Plan(dp=2, sp=2, zero=3), Plan(dp=2, tp=2, tp_sequence=True, zero=2),
                 Plan(dp=2, pp=2, sp=2, zero=2, microbatches=2), Plan(dp=2, pp=2, zero=3, microbatches=2),
                 Plan(dp=2, pp=2, zero=3, microbatches=2, schedule="zbv")):
        assert plan.require_implemented() == plan


class _Heads:
    def __init__(self, heads):
        self.n_heads, self.dim = heads, 768
    assert json.loads(Plan(dp=2).to_json())["dp"] == 2


def test_stage_blocks_round_trip_and_errors():
    plan = Plan.parse("pp=2,microbatches=2,stage_blocks=3/1")
    assert plan.stage_blocks == (3, 1)
    assert Plan.parse(plan.describe()) == plan
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_toml(plan.to_toml()) == plan
    with pytest.raises(ValueError, match="block counts per stage like 2/1/1"):
        Plan.parse("stage_blocks=a/1")
    with pytest.raises(ValueError, match="whole numbers >= 0"):
        Plan(stage_blocks=(-1, 2))
