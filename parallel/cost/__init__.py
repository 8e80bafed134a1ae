"""The cost model: what a plan holds, sends and takes per training step, and which plans there are.

- :mod:`.hardware`: hardware profiles (``profiles/*.toml``) and how a collective is priced on them;
- :mod:`.shape`: what the formulas read of a model (:class:`Shape`, filled by the zoo), pipeline stages,
  bubble and FLOPs;
- :mod:`.memory`: bytes a rank holds (model states exact, activations and temporaries estimated);
- :mod:`.traffic`: bytes a rank sends, group by group (exact);
- :mod:`.predict`: the :class:`Estimate` of one plan on one profile (``cuboid plans``, ``plan="auto"``);
- :mod:`.space`: every plan this build runs on ``N`` ranks (:func:`enumerate_plans`), the one enumeration.
"""
from ..plan import Plan
from .hardware import (HARDWARE_DIR, Hardware, Link, detect_hardware, free_memory_bytes, load_hardware,
                       profile_for_device, profile_names, user_hardware_dir)
from .memory import (ADAMW_STATE_BYTES, ADAMW_TOUCHED_BYTES, LAYOUTS, SELECTIVE_KEPT, SELECTIVE_SPLIT_1D,
                     activation_bytes, elementwise_elements, expert_parameters, head_bytes, held_activations, layout_of, model_states,
                     peak_bytes, pipeline_buffers, trainable)
from .predict import (DEFAULT_HEADROOM, LAYOUT_NAMES, Estimate, compute_seconds, elementwise_seconds, predict,
                      tensor_axes)
from .shape import Shape, Stage, bubble_fraction, dtype_bytes, in_flight, register_shape, stages_of, step_flops
from .space import canonical, divisors, enumerate_plans, microbatches_for, refusal, structural
from .traffic import expert_exchange_bytes, traffic

__all__ = ["ADAMW_STATE_BYTES", "ADAMW_TOUCHED_BYTES", "DEFAULT_HEADROOM", "HARDWARE_DIR", "LAYOUTS", "LAYOUT_NAMES",
           "SELECTIVE_KEPT", "SELECTIVE_SPLIT_1D", "Estimate", "Hardware", "Link", "Plan", "Shape", "Stage",
           "activation_bytes", "bubble_fraction", "canonical", "compute_seconds", "detect_hardware", "divisors",
           "dtype_bytes", "elementwise_elements", "elementwise_seconds", "enumerate_plans", "expert_exchange_bytes",
           "expert_parameters", "free_memory_bytes",
           "head_bytes", "held_activations", "in_flight", "layout_of", "load_hardware", "microbatches_for",
           "model_states", "peak_bytes", "pipeline_buffers", "predict", "profile_for_device", "profile_names",
           "refusal", "register_shape", "stages_of", "step_flops", "structural", "tensor_axes", "trainable",
           "traffic", "user_hardware_dir"]
