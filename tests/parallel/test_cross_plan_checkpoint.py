"""A checkpoint saved under tp3d loads under dp4 x tp1d, on a single device, and in transformers."""
from .launch import run_world
from .test_data_parallel import rel


def cross_plan_worker(folder):
    import torch
    import transformers as T

    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import checkpoint

    extra = {"vocab_size": 510}  # pads on both grids
    ref = cuboid.load("gpt-debug", seed=3, **extra).eval()
    tp3d = Plan.parse("tp3d", zoo.READY_PLANS)
    saved = cuboid.load("gpt-debug", tp3d, seed=3, mesh=Mesh.build(tp3d), **extra)
    checkpoint.save(saved, folder, max_shard_size="100KB")

    other = Plan(dp=4, tp=2)
    model = cuboid.load("gpt-debug", other, seed=0, mesh=Mesh.build(other), **extra)  # seed 0: overwritten
    checkpoint.load(model, folder)
    refs = dict(ref.named_parameters())
    tp1d_err = max(rel(mod.full_tensor(local), refs[name])
                   for name, mod, local, _ in zoo.common.sharded_parameters(model))

    single = cuboid.load("gpt-debug", seed=0, **extra)
    checkpoint.load(single, folder)
    single_err = max(rel(p, refs[n]) for n, p in single.named_parameters())

    hf = T.GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.randint(0, 510, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_err = rel(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
    return tp1d_err, single_err, hf_err, len(list(__import__("pathlib").Path(folder).glob("model-*.safetensors")))


def test_tp3d_checkpoint_loads_under_tp1d_single_and_hf(tmp_path):
    results = run_world(cross_plan_worker, 8, str(tmp_path / "ckpt"), timeout=400)
    for rank, (tp1d_err, single_err, hf_err, shards) in enumerate(results):
        assert shards > 1, rank
        assert tp1d_err == 0.0 and single_err == 0.0, (rank, tp1d_err, single_err)
        assert hf_err < 1e-5, (rank, hf_err)
