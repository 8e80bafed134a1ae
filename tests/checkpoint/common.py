"""Shared by the checkpoint tests and their child processes (_child.py)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import cuboid
from cuboid.parallel.optim import AdamW

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("_child.py")


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# ------------------------------------------------------------------ exact resume


def make_training(seed: int = 0):
    """gpt-debug with dropout (RNG matters), cuboid AdamW, a linear-warmup LambdaLR."""
    model = cuboid.load("gpt-debug", dropout=0.1, seed=seed).train()
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, start: int, steps: int) -> int:
    """Batches drawn from numpy and python RNGs (their states matter too), dropout from torch's."""
    for step in range(start, start + steps):
        T = random.randint(8, 16)
        ids = torch.from_numpy(np.random.randint(0, 512, size=(4, T)))
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return start + steps


# --------------------------------------------------------------- child processes


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # children use the torch backend, as the tests do
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *map(str, args)], cwd=str(REPO), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(procs, timeout: float = 120) -> list:
    """(returncode, output) of each process; kills them all on timeout."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    return out
