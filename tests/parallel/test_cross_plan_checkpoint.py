"""A checkpoint saved under tp3d loads under dp x tp1d, on a single device, and in transformers.

GPT-2 loads under dp4 x tp2; the Llama family (2 key/value heads for 4 query heads) under dp2 x tp4, where
each tp rank holds a copy of one key/value head (1D's rule when tp is a multiple of them).
"""
from .launch import run_world
from .test_data_parallel import rel

CASES = (("gpt-debug", "GPT2LMHeadModel", dict(dp=4, tp=2)), ("llama-debug", "LlamaForCausalLM", dict(dp=2, tp=4)))


def cross_plan_worker(folder):
    import torch
    import transformers as T

    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import checkpoint

    results = []
    for name, hf_class, layout in CASES:
        path = f"{folder}/{name}"
        extra = {"vocab_size": 510}  # pads on both grids
        ref = cuboid.load(name, seed=3, **extra).eval()
        tp3d = Plan.parse("tp3d", zoo.READY_PLANS)
        saved = cuboid.load(name, tp3d, seed=3, mesh=Mesh.build(tp3d), **extra)
        checkpoint.save(saved, path, max_shard_size="100KB")

        other = Plan(**layout)
        model = cuboid.load(name, other, seed=0, mesh=Mesh.build(other), **extra)  # seed 0: overwritten
        checkpoint.load(model, path)
        refs = dict(ref.named_parameters())
        tp1d_err = max(rel(mod.full_tensor(local), refs[n]) for n, mod, local, _ in zoo.common.sharded_parameters(model))

        single = cuboid.load(name, seed=0, **extra)
        checkpoint.load(single, path)
        single_err = max(rel(p, refs[n]) for n, p in single.named_parameters())

        hf = getattr(T, hf_class).from_pretrained(path).eval()
        ids = torch.randint(0, 510, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hf_err = rel(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
            plan_err = rel(model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits)
        shards = len(list(__import__("pathlib").Path(path).glob("model-*.safetensors")))
        results.append((name, tp1d_err, single_err, hf_err, plan_err, shards))
    return results


def test_tp3d_checkpoint_loads_under_tp1d_single_and_hf(tmp_path):
    results = run_world(cross_plan_worker, 8, str(tmp_path / "ckpt"), timeout=400)
    for rank, cases in enumerate(results):
        assert [c[0] for c in cases] == [c[0] for c in CASES]
        for name, tp1d_err, single_err, hf_err, plan_err, shards in cases:
            assert shards > 1, (rank, name)
            assert tp1d_err == 0.0 and single_err == 0.0, (rank, name, tp1d_err, single_err)
            assert hf_err < 1e-5 and plan_err < 1e-5, (rank, name, hf_err, plan_err)
