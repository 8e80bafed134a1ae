"""Generation under plans: greedy tokens equal transformers' generate, sampled tokens equal one device's (4 ranks).

One world of 4 ranks loads a GPT-2 and a Llama folder (2 key/value heads for 4 query heads) under tp=4 (1D:
each rank a copy of one key/value head), tp=4 2D (batch rows and hidden split; the cache holds this rank's
rows), dp2 x tp2 (each data-parallel rank generates for its own prompts) and dp2 x tp2 with ZeRO-3 (FSDP2
gathers each block's parameters as in any forward); pipeline plans refuse in one sentence.
"""
import torch

from .launch import run_world

PLANS = ("tp=4", "tp=4,tp_mode=2d", "dp=2,tp=2", "dp=2,tp=2,zero=3")
NEW = 24


def generation_worker(folders: dict, expected: dict):
    import cuboid
    from cuboid.parallel import Mesh, Plan

    from ..zoo.test_generation import prompts

    ids, mask = prompts()
    out = {}
    for spec in PLANS:
        plan = Plan.parse(spec)
        mesh = Mesh.build(plan)
        for name, folder in folders.items():
            model = cuboid.load(folder, plan, mesh=mesh)
            greedy = model.generate(ids, mask, max_new_tokens=NEW)
            sampled = model.generate(ids, mask, max_new_tokens=NEW, do_sample=True, top_p=0.9, seed=11)
            out[f"{spec}/{name}"] = (torch.equal(greedy, expected[name][0]), torch.equal(sampled, expected[name][1]))
    refused = ""
    try:
        pp = Plan(pp=2, dp=2, microbatches=2)
        cuboid.load(folders["LlamaForCausalLM"], pp, mesh=Mesh.build(pp)).generate(ids, mask, max_new_tokens=2)
    except NotImplementedError as e:
        refused = str(e)
    return out, refused


def test_generation_under_plans_equals_one_device_and_transformers(tmp_path):
    import cuboid
    from cuboid.kernels import use_backend

    from ..zoo.test_generation import long_hf, prompts

    ids, mask = prompts()
    folders, expected = {}, {}
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        hf = long_hf(name)
        hf.save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
        greedy = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        one = cuboid.load(tmp_path / name)
        with use_backend("torch"):  # the CPU path the ranks run (this process has the Triton interpreter on)
            assert torch.equal(one.generate(ids, mask, max_new_tokens=NEW), greedy)
            sampled = one.generate(ids, mask, max_new_tokens=NEW, do_sample=True, top_p=0.9, seed=11)
        expected[name] = (greedy, sampled)
    results = run_world(generation_worker, 4, folders, expected, timeout=400)
    for rank, (out, refused) in enumerate(results):
        assert len(out) == len(PLANS) * 2, rank
        for key, (greedy_ok, sampled_ok) in out.items():
            assert greedy_ok and sampled_ok, (rank, key, greedy_ok, sampled_ok)
        assert "generation under pipeline parallelism is not built" in refused, (rank, refused)
