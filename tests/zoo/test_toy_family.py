"""A family is one record: a toy family from a test folder (tests/zoo/toy_family), registered with one call,
loads, trains under dp=2 as one device does, and saves a folder one device reads back; and no module of the
front door names a family's module."""
from __future__ import annotations

import ast
import os

import pytest
import torch

from ..parallel.launch import run_world
from . import toy_family

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (4, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _train(model, steps: int = 2):
    import cuboid

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        if step % 2 == 0:  # the natural loop on this rank's share
            out = model(**cuboid.rank_share(model, _batch()))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        else:
            losses.append(cuboid.train_step(model, opt, _batch()).loss)
    return losses


def toy_worker(folder: str):
    import cuboid
    from cuboid.zoo import checkpoint

    toy_family.register()
    model = cuboid.load("toy-debug", plan="dp=2", seed=0)
    losses = _train(model)
    checkpoint.save(model, folder)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_registered_toy_family_trains_under_dp2_and_saves(tmp_path):
    import cuboid
    from cuboid import zoo

    toy_family.register()
    assert "toy-debug" in zoo.PRESETS and zoo.spec_of(zoo.build("toy-debug")).last == ("ln_f", "lm_head")
    one = cuboid.load("toy-debug", seed=0)
    want = _train(one)
    folder = str(tmp_path / "saved")
    (losses, params), (other, _) = run_world(toy_worker, 2, folder, timeout=240)
    losses[0] = (losses[0] + other[0]) / 2  # the natural loop's loss is each rank's share's (equal label counts)
    for a, b in zip(losses, want):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, want)
    ref = dict(one.named_parameters())
    for name, p in params.items():
        assert torch.allclose(p, ref[name], rtol=1e-5, atol=1e-6), name
    back = cuboid.load(folder)  # one device reads the save back: the same weights
    assert type(back).__name__ == "ToyLM"
    for name, p in back.named_parameters():
        assert torch.equal(p, params[name]), name


def test_registering_twice_or_a_clash_is_refused():
    from cuboid import zoo

    toy_family.register()
    with pytest.raises(ValueError, match="a family named 'toy' is registered already"):
        zoo.register_family(toy_family.record())
    clash = toy_family.record()
    import dataclasses

    with pytest.raises(ValueError, match="presets gpt-debug of family 'toy2' are another family's"):
        zoo.register_family(dataclasses.replace(clash, name="toy2", config=type("Other", (), {}),
                                                presets={"gpt-debug": None}))


def test_no_front_door_module_imports_a_family():
    """cuboid/ (the front door) reaches families through the registry (cuboid.zoo), never their modules."""
    families = {"gpt", "bert", "vit", "llama", "deepseek"}
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "cuboid")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{path}: {n}" for n in names if n.startswith("cuboid.zoo.") and n.split(".")[2] in families]
    assert not found, found
