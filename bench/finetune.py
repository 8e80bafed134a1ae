"""Fine-tune throughput: cuboid vs `transformers.Trainer`, same model, data, batch and machine.

Jobs: the embedded default (vit-debug on scikit-learn's digits, global batch
64) and a GPT causal-LM fine-tune (a small GPT-2 on packed token blocks of
generated text, global batch 16 x 64 tokens). Each runs single-process and
dp=2 (two local processes through torch's elastic launcher, gloo), for cuboid
(`cuboid.finetune`) and for HF (`Trainer` + accelerate, DDP over gloo), each
in its own fresh process group. Prints samples/s and the ratio cuboid/HF as a
markdown table and writes JSON.

    python bench/finetune.py [--steps 100] [--out bench/finetune.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOBS = {"digits-vit": dict(batch=64, lr=1e-2), "gpt-causal": dict(batch=16, lr=1e-3)}


def build(job: str):
    """(cuboid model, prepared train tensors) for a job, identical in every process."""
    import torch

    import cuboid
    from cuboid.data import formats as D

    if job == "digits-vit":
        ds = D.load_source("digits")
        model = cuboid.load("vit-debug", seed=0)
        return model, D.image_rows(ds, model.config)
    import random

    rng = random.Random(0)
    blocks = torch.tensor([[rng.randrange(512) for _ in range(64)] for _ in range(2000)])
    model = cuboid.load("gpt-debug", seed=0, dim=128, n_layers=2, n_heads=4)
    return model, {"input_ids": blocks, "labels": blocks.clone()}


def worker(kind: str, job: str, steps: int, out: str) -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, tensors = build(job)
    cfg = JOBS[job]
    if kind == "cuboid":
        from cuboid.data import formats as D
        from cuboid.parallel import Mesh, Plan, prepare
        from cuboid.train.step import train_step
        from cuboid.train.loop import make_optimizer

        plan = Plan(dp=world)
        mesh = Mesh.build(plan, model.config)
        train = prepare(model, plan, mesh)
        opt = make_optimizer("adamw", model, cfg["lr"], 0.01)
        batches = D.GlobalBatches(tensors, cfg["batch"], seed=0)
        t0 = None
        for step in range(steps + 5):
            if step == 5:
                t0 = time.perf_counter()
            train_step(train, opt, batches.next(), max_grad_norm=1.0)
        elapsed = time.perf_counter() - t0
    else:
        import transformers as T

        from cuboid import zoo

        with tempfile.TemporaryDirectory() as d:
            zoo.to_hf(model, d)
            hf = T.AutoModelForImageClassification.from_pretrained(d) if job == "digits-vit" else \
                T.AutoModelForCausalLM.from_pretrained(d)

        class TensorDataset(torch.utils.data.Dataset):
            def __len__(self):
                return len(tensors["labels"])

            def __getitem__(self, i):
                return {k: v[i] for k, v in tensors.items()}

        times: list[float] = []

        class Clock(T.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 5:
                    times.append(time.perf_counter())

        args = T.TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=cfg["batch"] // world, max_steps=steps + 5,
            learning_rate=cfg["lr"], weight_decay=0.01, max_grad_norm=1.0, logging_steps=10_000,
            save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=True, disable_tqdm=True,
            ddp_backend="gloo" if world > 1 else None, seed=0)
        T.Trainer(model=hf, args=args, train_dataset=TensorDataset(), callbacks=[Clock()]).train()
        elapsed = time.perf_counter() - times[0]
    if rank == 0:
        samples = steps * cfg["batch"]
        Path(out).write_text(json.dumps({"samples_per_s": samples / elapsed, "seconds": elapsed}))


def measure(kind: str, job: str, nproc: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={nproc}", "--rdzv-endpoint=127.0.0.1:0", __file__,
               "--worker", kind, "--job", job, "--steps", str(steps), "--result", out]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
               "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false"}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{kind} {job} x{nproc} failed:\n{p.stderr[-3000:]}")
        return json.loads(Path(out).read_text())["samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="bench/finetune.json")
    ap.add_argument("--worker", choices=["cuboid", "hf"])
    ap.add_argument("--job", choices=list(JOBS))
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.job, args.steps, args.result)
        return
    rows = []
    for job in JOBS:
        for nproc in (1, 2):
            # alternate the two so machine noise hits both alike
            ours = measure("cuboid", job, nproc, args.steps)
            theirs = measure("hf", job, nproc, args.steps)
            rows.append({"job": job, "processes": nproc, "cuboid_samples_per_s": ours,
                         "hf_samples_per_s": theirs, "ratio": ours / theirs})
            print(f"{job} x{nproc}: cuboid {ours:.0f}/s, HF Trainer {theirs:.0f}/s, ratio {ours / theirs:.2f}",
                  file=sys.stderr)
    print(f"\n{args.steps} timed steps after 5 warm-up steps, CPU, {os.cpu_count()} cores\n")
    print("| job | processes | cuboid samples/s | HF Trainer samples/s | cuboid/HF |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['job']} | {r['processes']} | {r['cuboid_samples_per_s']:.0f} | {r['hf_samples_per_s']:.0f} | "
              f"{r['ratio']:.2f} |")
    Path(args.out).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
