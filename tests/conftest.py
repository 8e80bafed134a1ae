"""Test-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (Triton reads TRITON_INTERPRET when a kernel is decorated), so it is
set here, at the top of the first conftest pytest loads. Tests that want the
fast torch path on CPU use `cuboid.kernels.use_backend("torch")`.

One exception: a run that selects the GPU tests only (`-m gpu`, exactly) on a
machine with CUDA leaves the interpreter off, so those tests run compiled, as
on a GPU user's machine: `python -m pytest -m gpu tests/kernels`. (The
interpreter cannot run CUDA tensors, and the tests that need it, the kernels
on CPU tensors, are not selected then.) Every other run, and any run with
TRITON_INTERPRET already in the environment, is as before. The marker
expression is read from the command line (and PYTEST_ADDOPTS) here, since
this has to happen before a conftest below imports `cuboid.kernels`;
`pytest_configure` checks the decision against the parsed options.
"""
import functools
import json
import os
import re
import shlex
import sys


def _markexpr_from_command_line() -> str:
    """The value of the last ``-m EXPR`` / ``-mEXPR`` in PYTEST_ADDOPTS and the command line ("" if none)."""
    args = shlex.split(os.environ.get("PYTEST_ADDOPTS", "")) + sys.argv[1:]
    expr = ""
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            expr = args[i + 1]
        elif a.startswith("-m") and len(a) > 2:
            expr = a[2:]
    return expr


def _compiled_gpu_run(markexpr: str) -> bool:
    """A run of the GPU tests only, on a machine with CUDA (torch imported only then)."""
    if (markexpr or "").strip() != "gpu":
        return False
    import torch
    return torch.cuda.is_available()


USER_SET_INTERPRET = "TRITON_INTERPRET" in os.environ
COMPILED_GPU_RUN = not USER_SET_INTERPRET and _compiled_gpu_run(_markexpr_from_command_line())
if not COMPILED_GPU_RUN:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root holds kernels/, parallel/ and zoo/ (installed as cuboid.kernels, ...). `python -m pytest`
# puts it first on sys.path, where those folders would shadow installed top-level packages of the same names
# (Hugging Face's `kernels`, which transformers imports). The tests need the root only to import `tests.*`,
# here and in the processes they spawn (which inherit sys.path), so it goes last: after site-packages.
# pyproject's `--import-mode=append` keeps pytest from putting it back in front.
ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != ROOT] + [ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    """The files handed out in FIRST's order (below); and the interpreter decision above, made from the raw
    command line, against the parsed ``-m`` (they differ when pytest is started from Python,
    ``pytest.main([...])``): corrected while no kernel module is imported, else a usage error rather than GPU
    tests run through the interpreter (or CPU ones without it)."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.7 hands files out by their test count
        config.option.loadscopereorder = False
    if USER_SET_INTERPRET:
        return
    want = _compiled_gpu_run(config.getoption("markexpr", ""))
    if want == COMPILED_GPU_RUN:
        return
    backend = sys.modules.get("cuboid.kernels._backend")  # imported by every kernel module
    if backend is not None and backend.INTERPRETER == want:
        raise pytest.UsageError("tests/conftest.py: cuboid.kernels was imported, "
                                f"{'with' if want else 'without'} the Triton interpreter, before the -m option was "
                                "known; set TRITON_INTERPRET (1: interpreter, 0: compiled) in the environment")
    if want:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"


# The quick tier, `python -m pytest -q -m "not slow"`, runs in under 10 minutes on CI's 2 cores (bench/RESULTS.md
# has the figure); the full suite is the README's test command and CI's. The tests the quick tier leaves out are
# marked slow here, in one place, by node id, not in their files. Each rule keeps a smaller relative in the quick
# tier (the 2-rank world of a test that also runs on 4 or 8 ranks, one family of a per-family test, every k-th case
# of a kernel's matrix), so the quick tier still touches every package; tests/test_quick_tier.py checks that, and
# that every pattern still marks a test. A pattern is a node id in which `*` matches anything (nothing else is
# special: brackets are a parametrization's), or a pair of one and
#   a fixture name: the tests of the pattern that request that fixture;
#   {parameter: values}: the tests of the pattern parametrized with one of those values;
#   an int k: of each test function's cases that the pattern matches, all but the 1st, (k+1)-th, (2k+1)-th, ...
SLOW = [
    # (why, patterns...)
    ("the generated plan parity on 4 and 8 ranks: every enumerated plan, 70-330 s each (its 2-rank worlds, dense "
     "and MoE, stay: dp, ZeRO, tp1d, sp, pp and ep on every family)",
     "tests/parallel/test_plans.py::test_every_enumerated_plan_on_4_ranks",
     "tests/parallel/test_plans.py::test_every_enumerated_plan_on_8_ranks",
     "tests/parallel/test_moe_plans.py::test_moe_plans_on_4_ranks",
     "tests/parallel/test_moe_plans.py::test_moe_plans_on_8_ranks"),
    ("a dedicated gloo world (2, 4 or 8 processes on 2 cores; 10-130 s each, 4 and 8 ranks the most): the quick "
     "tier's worlds are the generated plan parity's on 2 ranks; the same files' single-process tests stay",
     "tests/*_4_ranks", "tests/*_8_ranks",  # compose_zero, contract, cost(_moe), pipeline(_task), zero, lora, ...
     "tests/parallel/test_adapters_off.py::test_adapters_off_under_plans_2_ranks",
     "tests/parallel/test_auto_plan.py::test_*_on_two_ranks",
     "tests/parallel/test_cross_plan_checkpoint.py::test_tp3d_checkpoint_loads_under_tp1d_single_and_hf",
     "tests/parallel/test_data_parallel.py::test_dp_matches_single_process*",
     "tests/parallel/test_dropout.py::test_dropout_masks_follow_the_layout",
     "tests/parallel/test_exit.py::*",
     "tests/parallel/test_experts.py::test_dispatch_matches_one_device*",
     "tests/parallel/test_experts.py::test_step_gradients_match_one_device*",
     "tests/parallel/test_experts.py::test_checkpoint_any_plan_writes_any_plan_reads",
     "tests/parallel/test_generation.py::test_generation_under_plans_equals_one_device_and_transformers",
     "tests/parallel/test_hang.py::test_a_stalled_peer_ends_in_collective_timeout_naming_rank_group_and_op",
     "tests/parallel/test_hang.py::test_the_launcher_names_a_rank_that_exits_without_a_result",
     "tests/parallel/test_head_norm.py::test_qwen3_gemma3_tensor_modes_match_one_device",
     "tests/parallel/test_linear_ce_plans.py::test_fused_head_under_plans_equals_unfused_float64*",
     "tests/parallel/test_lora.py::test_lora_on_experts_under_ep_2_ranks",
     "tests/parallel/test_moe_plans.py::test_other_moe_families_on_2_ranks",
     "tests/parallel/test_moe_split.py::test_moe_aux_loss_under_pp_and_sp_on_2_ranks",
     "tests/parallel/test_optim_exclusion.py::test_exclusion_is_exact_under_tp2_and_zero2",
     "tests/parallel/test_packed.py::test_no_gradient_crosses_a_document_under_tp1d",
     "tests/parallel/test_pipeline.py::test_pp2_schedules_and_heads_on_2_ranks",
     "tests/parallel/test_pipeline_task.py::test_task_loss_under_pp2_schedules_and_moe_on_2_ranks",
     "tests/parallel/test_ring_attention.py::test_packed_rows_under_sequence_parallel_attention*",
     "tests/parallel/test_ring_attention.py::test_sequence_parallel_attention_matches_single_device*",
     "tests/parallel/test_selective_checkpoint.py::test_two_ranks_match_and_send_what_they_recompute",
     "tests/parallel/test_sequence_model.py::test_sequence_parallel_bytes_and_bf16_on_2_ranks",
     "tests/parallel/test_sequence_packed.py::test_packed_rows_under_sequence_plans_match_one_device",
     "tests/parallel/test_sequence_window.py::test_sliding_window_under_sequence_parallelism_matches_one_device",
     "tests/parallel/test_sft_loss.py::test_dp_pp_sp_take_one_devices_step_on_a_packed_sft_batch",
     "tests/parallel/test_tensor_1d.py::test_tensor_1d_matches_single_device*",
     "tests/parallel/test_tensor_2d.py::test_tensor_2*_matches_single_device",
     "tests/parallel/test_tensor_3d.py::test_tensor_3d_matches_single_device",
     "tests/parallel/test_token_logps.py::test_token_logps_under_plans_equal_float64*",
     "tests/checkpoint/test_load_memory.py::test_tp4_folder_load_reads_only_this_ranks_slices",
     "tests/checkpoint/test_pipeline_checkpoint.py::test_dp2_pp2_tp2_checkpoint_loads_everywhere",
     "tests/checkpoint/test_pipeline_checkpoint.py::test_pp2_exact_resume",
     "tests/checkpoint/test_distributed.py::test_two_rank_data_parallel_save_and_load",
     "tests/checkpoint/test_tensor_parallel.py::test_tp2_save_matches_single_process_and_loads_back",
     "tests/test_compile_plans.py::test_compile_plans_match_one_device",
     "tests/parallel/test_no_hang.py::test_uneven_eval_under_zero3_and_experts_on_2_ranks",
     "tests/parallel/test_cls_plans.py::test_classification_heads_under_pp_and_sp_equal_one_device",
     "tests/parallel/test_qlora_plans.py::test_qlora_plans_2_ranks"),
    ("a post-training run against TRL's trainer or on 2 processes (30 GRPO steps through cuboid and TRL; DPO's "
     "fine-tunes under dp and pp): the loss formulas against TRL's code, the evals against TRL's and the "
     "single-process command-line runs stay",
     "tests/front/test_grpo_finetune.py::test_reward_rises_at_least_half_as_much_as_trl",
     "tests/front/test_grpo_finetune.py::test_completions_log_and_metrics",
     "tests/front/test_grpo_finetune.py::test_two_ranks_sample_and_step_as_one_device",
     "tests/front/test_dpo.py::test_finetune_lowers_the_dpo_loss_and_plans_equal_one_device"),
    ("the compile gate: every kernel compiled for sm_80 and sm_90, minutes from a cold Triton cache (the gate's "
     "checker and the interpreter tests in these files stay)",
     ("tests/kernels/test_compile_gate.py::*", "gate"),
     ("tests/kernels/test_grouped_gemm_gate.py::*", "gate")),
    ("a kernel's matrix in the Triton interpreter: 1-7 s a case, hundreds of cases (every 10th case of each test "
     "stays, so every kernel and test still runs)",
     ("tests/kernels/*", 10)),
    ("a model family matrix (a case per preset or family): every 4th case of each test stays; and Mistral's "
     "greedy generation against transformers (30 s: GPT-2's stays)",
     ("tests/zoo/*", 4),
     "tests/zoo/test_generation.py::test_greedy_equals_transformers_generate[MistralForCausalLM]"),
    ("a per-case matrix outside the kernels, 2-5 s a case: every 2nd or 3rd case stays (of the plan enumerations, "
     "the 2- and 4-rank ones)",
     ("tests/parallel/test_auto_plan.py::test_memory_model_against_what_a_forward_keeps[*]", 3),
     ("tests/parallel/test_plan_space.py::*", {"world": (8,)}),
     ("tests/test_compile.py::test_masks_trace_without_host_reads[*]", 2),
     ("tests/checkpoint/test_lora_moe.py::*", 3)),
    ("torch.compile of every family but GPT and Llama, of the Triton-op models but GPT, and inductor's C++ code "
     "generation (a minute on 2 cores): GPT's and Llama's graphs and GPT's custom-op graph stay",
     ("tests/test_compile.py::test_one_graph_and_eager_values[*]",
      {"name": ("qwen3-moe-debug", "mixtral-debug", "olmoe-debug", "qwen3-debug", "gemma3-debug", "bert-debug",
               "vit-debug")}),
     ("tests/test_compile.py::test_triton_path_model_is_one_graph_of_custom_ops[*]",
      {"name": ("llama-debug", "mixtral-debug")}),
     "tests/test_compile.py::test_inductor_one_block_llama"),
    ("a fresh interpreter importing transformers and cuboid from the repository root, 15 s each: the import "
     "contracts and the one-liner in the root stay",
     "tests/test_imports.py::test_a_script_in_the_root_imports_transformers_and_cuboid_as_anywhere_else",
     "tests/test_imports.py::test_the_repository_root_shadows_no_installed_package"),
    ("one loss checked against the step on one device beside the same check on three plans (10 s): the "
     "batch-layout and 4-micro-batch checks stay",
     "tests/parallel/test_sft_loss.py::test_a_mean_per_micro_batch_is_far_from_the_step"),
    ("bench/gpu.py's dry run of its training and generation rows (a minute; its budget test stays)",
     ("tests/test_gpu_bench.py::*", "models_run")),
    ("an end-to-end run on 2+ processes (the launcher, torchrun) or a kill-and-restart loop, 10-70 s each: the "
     "single-process command-line runs stay",
     "tests/front/test_faults.py::test_*_survives_three_kills",
     "tests/front/test_faults.py::test_two_launchers_end_like_one_node",
     "tests/front/test_streaming.py::test_streaming_run_killed_twice_ends_like_the_uninterrupted_one",
     "tests/front/test_finetune.py::test_dp2_through_the_launcher_resumes_exactly",
     "tests/front/test_finetune.py::test_embedded_default_reaches_90_percent",
     "tests/front/test_finetune.py::test_tp2d_on_4_processes_matches_single_and_loads_in_transformers",
     "tests/front/test_finetune.py::test_text_tasks_dp2_under_the_launcher*",
     "tests/front/test_finetune.py::test_bad_value_under_the_launcher_is_one_line",
     "tests/front/test_large_batch_recipe.py::test_cli_default_job_with_lamb_and_sqrt_scaling",
     "tests/front/test_packed_finetune.py::test_packing_from_the_cli_on_one_process_dp2_and_pp2",
     "tests/front/test_lora_finetune.py::test_lora_finetune_saves_adapters_and_resumes_exactly",
     "tests/front/test_lora_finetune.py::test_sft_lora_on_a_mixture_of_experts",
     "tests/front/test_sft_cli.py::test_sft_packed_run_then_chat[dp2]",
     "tests/front/test_sft_cli.py::test_sft_packed_run_then_chat[tp1d-lora]",
     "tests/checkpoint/test_lora_resume.py::test_a_tp1d_lora_checkpoint_resumes_under_dp2_and_on_one_device"),
    ("another single-process fine-tune, eval or generate through the command line, 5-17 s each, beside one like "
     "it that stays (the causal-LM fine-tune, GPT-2's eval, the single-process SFT run, a chat answer, generate "
     "on a merged LoRA folder)",
     "tests/front/test_finetune.py::test_mlm_csv_and_seqcls_parquet_predictions_match_transformers",
     "tests/front/test_finetune.py::test_qwen2_folder_clm_on_a_text_file_and_seqcls_load_in_transformers",
     "tests/front/test_finetune.py::test_imagefolder_and_in_memory_api",
     "tests/front/test_finetune.py::test_config_file_with_flag_override_and_bare_resume",
     "tests/front/test_prepare_cmd.py::test_packed_rows_hold_each_example_once_and_finetune_trains_on_the_folder",
     "tests/front/test_lora_finetune.py::test_sft_full_finetune_of_a_mixture_of_experts",
     "tests/front/test_eval.py::test_perplexity_equals_transformers_recipe_and_the_cli_prints_it[qwen2]",
     "tests/front/test_sft_families.py::test_sft_lora_then_peft[*]",  # LoRA to PEFT also in checkpoint/test_lora_peft
     "tests/front/test_generate_chat.py::test_the_answer_ends_at_the_turns_end_or_at_eos[<|eot_id|>]",
     "tests/front/test_generate_chat.py::test_prompts_file_holds_one_conversation_a_line",
     "tests/front/test_generate_chat.py::test_chat_needs_a_template_and_system_needs_chat",
     "tests/front/test_generate_cli.py::test_generate_streams_one_prompt_and_batches_a_file"),
    ("issue 65's reliability checks that launch dp=2 or stop a run by a signal, 15-40 s each: the stale lock's "
     "takeover, a bad value raised on one rank of a dp=2 launch and the cut-off metrics line stay",
     "tests/front/test_run_safety.py::test_a_second_run_into_a_busy_output_dir_*",
     "tests/front/test_interrupt.py::test_sigterm_says_so_names_the_checkpoint_and_exits_143",
     "tests/front/test_trackers.py::test_ctrl_c_ends_the_tracker_runs_as_killed_with_every_row",
     "tests/front/test_faults.py::test_an_error_on_one_rank_is_the_headline[crash]",
     "tests/front/test_faults.py::test_a_bad_value_every_rank_meets_is_one_line_as_ever",
     "tests/front/test_reward.py::test_a_long_record_is_bounded_by_the_length_kept_under_dp2"),
    ("a save killed mid-write, and the damaged-checkpoint fuzz loop, 12-19 s each: the failed-write test and the "
     "fuzz harness's own tests stay",
     "tests/checkpoint/test_atomic.py::test_killed_save_leaves_the_previous_checkpoint",
     "tests/checkpoint/test_fuzz.py::test_fuzz"),
]


def _matches(pattern, item) -> bool:
    glob, condition = (pattern, None) if isinstance(pattern, str) else pattern
    if not _regex(glob).fullmatch(item.nodeid):
        return False
    if isinstance(condition, str):
        return condition in item.fixturenames
    if isinstance(condition, dict):
        params = getattr(item, "callspec", None)
        return params is not None and any(params.params.get(k, object()) in v for k, v in condition.items())
    return True  # no condition, or a sample (its cases are counted in _mark_slow)


@functools.lru_cache(maxsize=None)
def _regex(glob: str) -> "re.Pattern":
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")))


def _name(pattern) -> str:
    return pattern if isinstance(pattern, str) else f"{pattern[0]} {pattern[1]}"


def _mark_slow(items):
    """Marks the SLOW rules' tests (the first matching rule's reason); with CUBOID_SLOW_REPORT set, writes there,
    as JSON, the node ids each pattern marked among ``items``."""
    hits = {_name(p): [] for _, *patterns in SLOW for p in patterns}
    cases = {}  # (sample pattern, test file, function) -> cases seen so far
    for item in items:
        whys = []
        for why, *patterns in SLOW:
            for pattern in patterns:
                if not _matches(pattern, item):
                    continue
                if not isinstance(pattern, str) and isinstance(pattern[1], int):
                    key = (_name(pattern), str(item.path), item.originalname)
                    cases[key] = cases.get(key, -1) + 1
                    if cases[key] % pattern[1] == 0:
                        continue  # a case the quick tier keeps
                hits[_name(pattern)].append(item.nodeid)
                whys.append(why)
        if whys:
            item.add_marker(pytest.mark.slow(reason=whys[0]))
    report = os.environ.get("CUBOID_SLOW_REPORT")
    if report:
        with open(report, "w") as fh:
            json.dump(hits, fh, indent=1)


# The longest test files (minutes each on 2 cores), run first: CI runs the suite on two pytest-xdist workers by
# file (`-n 2 --dist loadfile`), and one of these handed out last would leave the other worker idle meanwhile.
# pytest-xdist 3.7+ would hand the files out by their number of tests (its loadscope reorder: these few-test files
# last, the 8-rank worlds then overlapping at the end of the run), so pytest_configure turns that off
FIRST = ("tests/parallel/test_moe_plans.py", "tests/parallel/test_plans.py", "tests/front/test_finetune.py",
         "tests/parallel/test_generation.py", "tests/parallel/test_pipeline.py", "tests/front/test_faults.py")


def _longest_first(items) -> None:
    """Items of FIRST's files first (in FIRST's order), the rest in collection order: a stable sort."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rank = {os.path.join(root, f): i for i, f in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(FIRST)))


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection reads the marks
def pytest_collection_modifyitems(config, items):
    _mark_slow(items)
    _longest_first(items)
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU; runs in bench/gpu.py and on GPU machines"
    elif os.environ.get("TRITON_INTERPRET") == "1":  # a whole-suite run on a GPU machine: the CPU tests need it
        reason = ("the Triton interpreter is on in this run and cannot take CUDA tensors; run the GPU tests "
                  "compiled: python -m pytest -m gpu tests/kernels")
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)



# folders whose tests run models, not kernels: on CPU they take a user's path, the torch reference kernels
# (a user's CPU run has no interpreter), not the Triton interpreter this process switches on for tests/kernels.
# Set around a test's whole protocol (its setup too: a module's fixture runs models in its first test's setup).
# A test there that wants the interpreted kernels asks for them with use_backend("triton").
MODEL_FOLDERS = ("checkpoint", "front", "parallel", "zoo")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.path.relpath(str(item.path), os.path.dirname(os.path.abspath(__file__))).split(os.sep)[0]
    if folder not in MODEL_FOLDERS or "gpu" in item.keywords or COMPILED_GPU_RUN:
        yield
        return
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        yield


@pytest.fixture(autouse=True, scope="module")
def _warm_worlds_leave_with_their_module():
    """The warm gloo worlds of tests/parallel/launch.py are kept through a test file and leave at its end: idle
    ranks still take some CPU, and worlds kept through the rest of the suite would slow it."""
    yield
    for name, module in list(sys.modules.items()):
        if name.endswith("parallel.launch") and hasattr(module, "_Warm"):
            module._Warm.stop_all()
