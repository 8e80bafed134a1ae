"""Generation under plans: greedy tokens equal transformers' generate, sampled tokens equal one device's (4 ranks).

One world of 4 ranks loads GPT-2, Llama (2 key/value heads for 4 query heads), Qwen2 (1, biases, tied) and
Mistral (4) folders and generates 16 tokens for 3 left-padded prompts under tp=4 (1D: a rank holds its key/value
heads, or a copy of one), tp=4 2D (batch rows and hidden split; the cache holds this rank's rows; Qwen2's one
key/value head is refused in one sentence), dp2 x tp2 (each data-parallel rank generates for its own prompts),
dp2 x tp2 with ZeRO-3 (FSDP2 gathers each block's parameters as in any forward: dp ranks whose rows end at
different steps stop together, and perplexity runs as many windows on each), pp2 x dp2 with 2 micro-batches
(a step is one micro-batch: each stage caches its own layers), pp2 x tp2, and pp2 x tp2 with tp_sequence (the
stages decode as plain 1D tp). Sequence parallelism refuses in one sentence.
"""
import torch

from .launch import run_world

# new tokens a plan's greedy and sampled runs take: past the prompts' 7 positions and the first decode steps
# (every later step is the same cached step); the ZeRO-3 end-of-text and prompt-length checks keep zoo's 64
STEPS = 16
PLANS = ("tp=4", "tp=4,tp_mode=2d", "dp=2,tp=2", "dp=2,tp=2,zero=3", "pp=2,dp=2,microbatches=2", "pp=2,tp=2,microbatches=2",
         "pp=2,tp=2,tp_sequence=true")  # tp_sequence decodes as plain 1D tp


def generation_worker(folders: dict, expected: dict):
    import cuboid
    from cuboid.parallel import Mesh, Plan

    from ..zoo.test_generation import NEW, prompts

    ids, mask = prompts()
    out = {}
    for spec in PLANS:
        plan = Plan.parse(spec)
        mesh = Mesh.build(plan)
        for name, folder in folders.items():
            if plan.tp_mode == "2d" and name == "Qwen2ForCausalLM":  # 1 key/value head: the grid cannot split it
                try:
                    cuboid.load(folder, plan, mesh=mesh)
                except ValueError as e:
                    out[f"{spec}/{name}"] = ("key/value heads do not divide" in str(e), "tp_mode 1d" in str(e))
                continue
            model = cuboid.load(folder, plan, mesh=mesh)
            greedy = model.generate(ids, mask, max_new_tokens=STEPS)
            sampled = model.generate(ids, mask, max_new_tokens=STEPS, do_sample=True, top_p=0.9, seed=11)
            out[f"{spec}/{name}"] = (torch.equal(greedy, expected[name][0]), torch.equal(sampled, expected[name][1]))
    # ZeRO-3 gathers over dp in every forward: dp ranks with different prompts must stop at the same step (rank
    # 0's one row ends early here), and perplexity must run as many windows on each (3 windows over 2 ranks)
    from cuboid.cli.eval import perplexity

    plan = Plan.parse("dp=2,tp=2,zero=3")
    mesh = Mesh.build(plan)
    model = cuboid.load(folders["LlamaForCausalLM"], plan, mesh=mesh)
    eos, wants, text, ppl_one = expected["zero3"]
    dp = mesh.coords["dp"]
    rows, want = (slice(0, 1), slice(1, 3))[dp], wants[dp]
    got = model.generate(ids[rows], mask[rows], max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    out["eos under zero3"] = (torch.equal(got[:, :want.shape[1]], want) and bool((got[:, want.shape[1]:] == 0).all()),
                              want.shape[1] < got.shape[1] if dp == 0 else True)
    try:  # a prompt too long on rank 0 only: every dp rank refuses, none waits in a forward
        model.generate(torch.ones(2, 20 if dp == 0 else 3, dtype=torch.long), max_new_tokens=NEW)
        out["too long under zero3"] = (False, False)
    except ValueError as e:
        out["too long under zero3"] = ("20 prompt tokens" in str(e), "exceed the model's 80 positions" in str(e))
    ppl = perplexity(model, text, 32, 16)
    out["perplexity under zero3"] = (ppl["windows"] == 3, abs(ppl["perplexity"] - ppl_one) <= 1e-5 * ppl_one)
    refused = ""
    try:
        sp = Plan(sp=2, dp=2)
        cuboid.load(folders["LlamaForCausalLM"], sp, mesh=Mesh.build(sp)).generate(ids, mask, max_new_tokens=2)
    except NotImplementedError as e:
        refused = str(e)
    return out, refused


def zero3_references(folder: str) -> tuple:
    """One device's side of the ZeRO-3 checks, computed once here rather than on every rank: the end-of-text id
    at which row 0 ends at its third token, the rows of each dp rank generated with it (dp rank 0: row 0; 1:
    rows 1 and 2), and the text and perplexity of 3 windows."""
    import cuboid
    from cuboid.cli.eval import perplexity
    from cuboid.kernels import use_backend

    from ..zoo.test_generation import NEW, prompts

    ids, mask = prompts()
    one = cuboid.load(folder)
    with use_backend("torch"):  # the ranks' CPU path
        eos = int(one.generate(ids[:1], mask[:1], max_new_tokens=3)[0, -1])
        wants = [one.generate(ids[rows], mask[rows], max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
                 for rows in (slice(0, 1), slice(1, 3))]
        text = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(2))
        return eos, wants, text, perplexity(one, text, 32, 16)["perplexity"]


def test_generation_under_plans_equals_one_device_and_transformers(tmp_path):
    import cuboid
    from cuboid.kernels import use_backend

    from ..zoo.test_generation import DECODERS, long_hf, prompts

    ids, mask = prompts()
    folders, expected = {}, {}
    for name in DECODERS:
        hf = long_hf(name)
        hf.save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
        greedy = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        one = cuboid.load(tmp_path / name)
        with use_backend("torch"):  # the CPU path the ranks run (this process has the Triton interpreter on)
            assert torch.equal(one.generate(ids, mask, max_new_tokens=STEPS), greedy)
            sampled = one.generate(ids, mask, max_new_tokens=STEPS, do_sample=True, top_p=0.9, seed=11)
        expected[name] = (greedy, sampled)
    expected["zero3"] = zero3_references(folders["LlamaForCausalLM"])
    results = run_world(generation_worker, 4, folders, expected, timeout=400)
    for rank, (out, refused) in enumerate(results):
        assert len(out) == len(PLANS) * len(folders) + 3, rank
        for key, (greedy_ok, sampled_ok) in out.items():
            assert greedy_ok and sampled_ok, (rank, key, greedy_ok, sampled_ok)
        assert "generation under sequence parallelism is not built" in refused, (rank, refused)
